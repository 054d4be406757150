"""Gathering FSDP parameters per module unit, in one collective each.

Under an FSDP-style plan every parameter shard is all-gathered before its use. One
collective per parameter pays the collective's latency for each of them (on gloo about
0.35 ms, so a 2-block GPT spends 13 ms per step on latency alone). ``fully_shard``
gathers one flat buffer per wrapped module instead. This pass does the same: the
parameter gathers of one *unit* are fused into a single all_gather of their local
shards laid end to end (copy-in), and each parameter is cut back out of the gathered
buffer (copy-out), giving exactly what its own all_gather gave.

A unit is the module a parameter belongs to, cut at the first numbered component of its
name: ``blocks.3.attn.q.weight`` is in unit ``blocks.3``, ``tok.weight`` in the root
unit ``""`` (as torchtitan wraps every block of a ModuleList and the root). The fused
gather stays a parameter gather for :mod:`.overlap`, which issues it one unit ahead of
its first use. Forward and backward gathers of a unit (``Plan(reshard_after_forward=True)``)
are fused apart: one collective per unit and phase (the root unit, kept for backward as
``fully_shard`` keeps its root, has only the forward's: expand/fsdp.py).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from ..expand.fsdp import unit_of
from ..expand.splice import FSDP_GATHER
from .graph_utils import WAIT, alias_root, fused_comm, param_root, is_collective, is_wait, new_node, positions, prep_chain, written_inputs

__all__ = ["bucket_parameter_gathers_pass", "unit_of"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _param_of(n: fx.Node) -> str | None:
    """The FQN of the parameter (or buffer) a gather collects, if it is one."""
    inp = _gathered_input(n)
    return None if inp is None else inp.name


def _gathered_input(n: fx.Node) -> Any:
    """The GraphInput of the parameter or buffer a gather collects, if it is one."""
    if n.meta.get("spmd_comm", {}).get("kind") != "all_gather":
        return None
    chain = prep_chain(n)
    src = chain[-1].args[0] if chain else n.args[0]
    root = param_root(src)  # the parameter, or (mixed precision) the parameter whose cast shard it gathers
    inp = root.meta.get("spmd_input") if isinstance(root, fx.Node) else None
    if isinstance(root, fx.Node) and root.op == "placeholder" and inp is not None and inp.kind in ("param", "buffer"):
        return inp
    return None


def _gathered_what(members: list[fx.Node]) -> str:
    """``3 parameters``, ``2 parameters and 1 buffer``: what the fused gather collects."""
    buffers = sum(1 for m in members if getattr(_gathered_input(m), "kind", None) == "buffer")
    params = len(members) - buffers
    parts = [f"{k} {word}{'s' if k != 1 else ''}" for k, word in ((params, "parameter"), (buffers, "buffer")) if k]
    return " and ".join(parts)


def _sources(m: fx.Node) -> set[fx.Node]:
    """The values gather ``m`` and its prep chain read from outside the chain."""
    inside = set(prep_chain(m)) | {m}
    return {a for x in inside for a in x.all_input_nodes if a not in inside}


def _ready(m: fx.Node, pos: dict[fx.Node, float], writes: dict[Any, list[fx.Node]]) -> float:
    """Where gather ``m`` could start at the earliest: after every input of its prep chain
    (whatever the shard dim: ``movedim`` for ``Shard(1)``, padding for uneven shards) and
    after every write to their storage that precedes it."""
    sources = _sources(m)
    ready = max((pos[a] for a in sources), default=-1.0)
    for a in sources:
        for w in writes.get(alias_root(a), ()):
            if pos[w] < pos[m]:
                ready = max(ready, pos[w])
    return ready


def _need(m: fx.Node, pos: dict[fx.Node, float]) -> float:
    wait = next(u for u in m.users if is_wait(u))
    return min((pos[u] for u in wait.users), default=pos[wait])


def _fusable(members: list[fx.Node], pos: dict[fx.Node, float], writes: dict[Any, list[fx.Node]]) -> list[fx.Node]:
    """The members one fused gather can serve: its inputs must all be ready before the
    first use of any member's result. A gather of a view made late (``t(weight)`` in
    backward, under a plan without ``fsdp_axes``) or of a parameter already updated is
    left out, latest first."""
    members = sorted(members, key=lambda m: _ready(m, pos, writes))
    while len(members) > 1 and _ready(members[-1], pos, writes) >= min(_need(m, pos) for m in members):
        members.pop()
    # a gather moved later, to the first use, must not read its input after a write to it
    # that came between (the parameter as updated, not as gathered)
    while len(members) > 1:
        at = min(_need(m, pos) for m in members)  # where _fuse places the fused gather
        kept = [m for m in members if not _written_between(m, pos[m], at, pos, writes)]
        if len(kept) == len(members):
            break
        members = kept  # a later first use: check the rest again
    return members


def _written_between(m: fx.Node, start: float, end: float, pos: dict[fx.Node, float], writes: dict[Any, list[fx.Node]]) -> bool:
    return any(start < pos[w] < end for a in _sources(m) for w in writes.get(alias_root(a), ()))


def _fuse(gm: fx.GraphModule, members: list[fx.Node], unit: str, pos: dict[fx.Node, float]) -> None:
    """Replace ``members`` by one gather (see the pass); ``pos`` is kept up to date."""
    g = gm.graph
    gathered = _gathered_what(members)  # before the copy-in reads the members' prep chains
    members = sorted(members, key=lambda m: pos[m])
    first = members[0].meta["spmd_comm"]
    n = first["group_size"]
    group = members[0].args[-1]
    waits = [next(u for u in m.users if is_wait(u)) for m in members]
    # insert where the earliest member's result is first needed: overlap moves it earlier
    uses = [u for w in waits for u in w.users]
    anchor = min(uses, key=lambda u: pos[u]) if uses else waits[0]

    def add(target: Any, args: tuple, meta: dict | None = None) -> fx.Node:
        with g.inserting_before(anchor):
            node = new_node(g, target, args, None, meta)
        node.meta["spmd_phase"] = members[0].meta.get("spmd_phase")
        if FSDP_GATHER in members[0].meta:
            node.meta[FSDP_GATHER] = members[0].meta[FSDP_GATHER]
        node.meta["spmd_origin"] = {"node": f"gather of unit {unit or '<root>'}", "op": "bucket_parameter_gathers", "source": None}
        placed.append(node)
        return node

    placed: list[fx.Node] = []  # moved or made, all right before the anchor in this order
    for m in members:  # each member's input preparation (contiguous, pad) comes first
        for prep in reversed(prep_chain(m)):
            anchor.prepend(prep)
            placed.append(prep)
    flats = [add(aten.reshape.default, (m.args[0], [-1])) for m in members]
    sizes = [int(f.meta["val"].numel()) for f in flats]
    buf = add(aten.cat.default, (flats,))
    comm = fused_comm(
        members, reason=f"FSDP: gather the {gathered} of unit {unit or '<root>'} in one collective",
        label="unit", what="parameter gathers",
    )
    coll = add(c10d.all_gather_into_tensor.default, (buf, n, group), meta={"spmd_comm": comm, "spmd_param_gather": unit})
    coll.meta["spmd_copy_in"] = flats + [buf]
    wait = add(WAIT, (coll,), meta={"spmd_wait": True})
    copy_out = {"spmd_copy_out": True}
    rows = add(aten.reshape.default, (wait, [n, sum(sizes)]), meta=copy_out)
    parts = add(aten.split_with_sizes.default, (rows, sizes, 1), meta=copy_out)
    for i, (m, w) in enumerate(zip(members, waits)):
        piece = add(operator.getitem, (parts, i), meta=copy_out)
        # copy-out: rank j's shard of this parameter is row j's slice, as its own all_gather gave
        out = add(aten.reshape.default, (piece, list(w.meta["val"].shape)), meta=copy_out)
        w.replace_all_uses_with(out)
        g.erase_node(w)
        g.erase_node(m)
    _place_run(gm, placed, anchor, pos)


def _place_run(gm: fx.GraphModule, run: list[fx.Node], anchor: fx.Node, pos: dict[fx.Node, float]) -> None:
    """Positions for ``run``, the nodes right before ``anchor`` in this order, between
    their neighbours' (all positions afresh if the floats between are used up)."""
    lo, hi = pos[run[0].prev], pos[anchor]
    step = (hi - lo) / (len(run) + 1)
    if lo + step <= lo or hi - step >= hi:
        pos.clear()
        pos.update(positions(gm))
        return
    for i, n in enumerate(run, 1):
        pos[n] = lo + i * step


def bucket_parameter_gathers_pass(gm: fx.GraphModule, *, by: str = "unit") -> fx.GraphModule:
    """Fuse the FSDP parameter gathers of each module unit into one all_gather
    (``by="unit"``); ``by="none"`` leaves one gather per parameter."""
    if by not in ("unit", "none"):
        raise ValueError(f"by must be 'unit' or 'none', got {by!r}")
    if by == "none":
        return gm
    pos = positions(gm)
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if not is_collective(n):
            continue
        fqn = _param_of(n)
        if fqn is None:
            continue
        c = n.meta["spmd_comm"]
        groups[(unit_of(fqn), n.meta.get("spmd_phase"), n.args[-1], c["dtype"], c["group_size"])].append(n)
    writes: dict[Any, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        for x in written_inputs(n):
            writes[alias_root(x)].append(n)
    for (unit, *_), members in groups.items():
        members = _fusable(members, pos, writes)
        if len(members) > 1:
            _fuse(gm, members, unit, pos)
    gm.graph.eliminate_dead_code()
    return gm
