"""Which collective of inductor's compiled code failed (a dead peer, a timeout), for
:meth:`spmd_compiler.runtime.inductor.InductorRunner.failed_node`.

In generated Python code the traceback has the line of the failing ``_c10d_functional``
call (:func:`generated_collective`). Code with inductor's C++ wrapper has no Python frame:
there the process groups' launch counts, read when the code started and again at the
failure, name the collective launched last (:func:`last_launched`).
"""

from __future__ import annotations

import linecache
import re
import traceback

import torch.fx as fx

from .. import _private_torch as pt
from ..optimize.graph_utils import is_collective

__all__ = ["collective_groups", "generated_collective", "group_of", "last_launched"]

_C10D_CALL = re.compile(r"_c10d_functional\.(\w+)\.")


def _c10d_call(line: str) -> str | None:
    """The ``_c10d_functional`` op a line of generated code calls (not a comment), or None."""
    m = _C10D_CALL.search(line)
    return m.group(1) if m and not line.lstrip().startswith("#") else None


def generated_collective(error: BaseException) -> tuple[bool, int, int] | None:
    """Where in inductor's generated code ``error`` was raised, if by a functional
    collective: (a wait?, its index among the code's waits, or among its other collective
    calls, in code order, and how many of those the code has). None if no generated-code
    frame was calling one."""
    root = pt.inductor_cache_dir()
    hit = None
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        filename = frame.f_code.co_filename
        if filename.startswith(root):
            op = _c10d_call(linecache.getline(filename, lineno))
            hit = (filename, lineno, op) if op else hit
    if hit is None:
        return None
    filename, lineno, op = hit
    wait = op == "wait_tensor"
    same = [i for i, text in enumerate(linecache.getlines(filename), 1)
            if (other := _c10d_call(text)) is not None and (other == "wait_tensor") == wait]
    return wait, same.index(lineno), len(same)


def group_of(n: fx.Node) -> str | None:
    """The ``group_name`` of a functional collective node (its last argument in every
    ``_c10d_functional`` collective's schema), or None."""
    group = n.kwargs.get("group_name", n.args[-1] if n.args else None)
    return group if isinstance(group, str) else None


def collective_groups(gm: fx.GraphModule) -> list[str]:
    """The process groups (names) of ``gm``'s collectives."""
    return sorted({g for n in gm.graph.nodes if is_collective(n) and (g := group_of(n)) is not None})


def last_launched(gm: fx.GraphModule, before: dict[str, int | None]) -> fx.Node | None:
    """The collective of ``gm`` launched last, by the process groups' launch counts now
    against ``before`` (taken when ``gm``'s compiled code started; its collectives launch in
    the graph's order): the one a failure came from, unless an earlier one still in flight
    failed first. None if no count moved or a group does not count."""
    last = None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for group, start in before.items():
        now = pt.collectives_launched(group)
        if start is None or now is None or now <= start:
            continue
        nodes = [n for n in gm.graph.nodes if is_collective(n) and group_of(n) == group]
        if now - start <= len(nodes):
            node = nodes[now - start - 1]
            last = node if last is None or order[node] > order[last] else last
    return last
