"""One launch for independent small all_reduces of the same group.

After :mod:`.bucketing` some all_reduces are still launches of their own: values that are
not gradients and could not ride in a gradient bucket. Under Megatron TP, backward reduces
the input gradients of q, k and v (and of w1 and w3), each a Partial(sum) of its own that
no other reads; a ``clip_grad_norm_`` norm that the expansion could not stack as one
Partial (:mod:`spmd_compiler.expand.rules.norms`) is another (``P(norm2)->R``:
:func:`spmd_compiler.expand.redistribute._norm_pre` raises to the power 2, one
``all_reduce`` sum, then the root). None of them reads another's result.

This pass merges such all_reduces into one, as a bucket does: reshape(-1) each input,
cat, one all_reduce, then a slice and a view per member in place of its wait. An
all_reduce is elementwise, so every member gets the same values as alone (the same
sums, in the same order of ranks). Members of one fused collective have the same group
name, group size, reduce op and dtype, a static size that is the same on every rank,
are standalone (not a bucket, not a mean pair of :mod:`.mean_reductions`) and are each
waited by one ``wait_tensor``.

Placement: it runs after :mod:`.overlap` and :mod:`.schedule`, on the program as it will
run (with each wait at its first use, independent reductions have slack between their
inputs and their readers). Members are taken in program order while every member's input
exists before the first read of any member's result; the fused collective is issued right
after the last member's input and waited right before that first read. So no reader moves
(a value the forward or backward needs is never delayed) and no member depends on another's
result (a dependency goes through a reader). A group closes when the next candidate breaks
this or the payload would pass ``max_mb``; only groups of two or more are fused. The 1-layer
torchtitan Llama under TP (``tests/test_optimize_fuse_all_reduces.py``): its backward's 4
input-gradient reductions in 2 (the clip's norms are already one all_reduce there).

Skipped (left as they are): a member whose input's storage is written in place anywhere
in the program (an all_reduce copies its input at issue; issuing later would read the
write), symbolic or per-rank sizes (uneven shards: ``RANK_SIZES``), and programs split
into pipeline stages (``MARKER``: a collective does not move across a stage boundary).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from ..expand.splice import RANK_SIZES
from ..trace.markers import MARKER
from .graph_utils import WAIT, alias_root, fused_comm, is_collective, is_wait, new_node, positions, written_roots

__all__ = ["fuse_all_reduces_pass"]

log = logging.getLogger(__name__)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _standalone(n: fx.Node, written: set[fx.Node]) -> tuple | None:
    """The group key ``(group, group size, op, dtype)`` of a standalone all_reduce that can
    join a fused one, or None."""
    if not (is_collective(n) and n.target is c10d.all_reduce.default) or RANK_SIZES in n.meta:
        return None
    comm = n.meta.get("spmd_comm") or {}
    x = n.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if comm.get("op") in ("bucket", "mean_pair") or not isinstance(val, torch.Tensor):
        return None
    if not all(isinstance(d, int) for d in val.shape) or RANK_SIZES in x.meta or alias_root(x) in written:
        return None
    if len(n.users) != 1 or not is_wait(next(iter(n.users))):
        return None
    return (n.args[2], comm.get("group_size"), n.args[1], val.dtype)


def _first_read(n: fx.Node, pos: dict[fx.Node, float]) -> float:
    """Position of the first reader of all_reduce ``n``'s result (its wait's users)."""
    wait = next(iter(n.users))
    return min((pos[u] for u in wait.users), default=float("inf"))


def _groups(gm: fx.GraphModule, pos: dict[fx.Node, float], max_bytes: float) -> list[list[fx.Node]]:
    written = written_roots(gm)
    open_: dict[tuple, tuple[list[fx.Node], float, float, int]] = {}  # key -> (members, ready, first read, bytes)
    done: list[list[fx.Node]] = []
    for n in gm.graph.nodes:
        key = _standalone(n, written)
        if key is None:
            continue
        ready, read = pos[n.args[0]], _first_read(n, pos)
        size = n.args[0].meta["val"].numel() * n.args[0].meta["val"].element_size()
        if key in open_:
            members, g_ready, g_read, g_bytes = open_[key]
            new_ready, new_read = max(g_ready, ready), min(g_read, read)
            if new_ready < new_read and g_bytes + size <= max_bytes:
                open_[key] = (members + [n], new_ready, new_read, g_bytes + size)
                continue
            log.debug("%s starts a new group: its input is ready after a member's result is read, or the group is full", n.name)
            done.append(members)
        open_[key] = ([n], ready, read, size)
    done.extend(members for members, *_ in open_.values())
    return [g for g in done if len(g) > 1]


def _fuse(gm: fx.GraphModule, members: list[fx.Node], pos: dict[fx.Node, float]) -> fx.Node:
    g = gm.graph
    inputs = [m.args[0] for m in members]
    anchor = max(inputs, key=lambda x: pos[x])
    waits = [next(iter(m.users)) for m in members]
    phase = members[0].meta.get("spmd_phase")
    phases = {m.meta.get("spmd_phase") for m in members}
    origin = {"node": " + ".join(m.name for m in members), "op": "fuse_all_reduces", "source": None}
    meta = {"spmd_phase": phase if len(phases) == 1 else anchor.meta.get("spmd_phase"), "spmd_origin": origin}
    reasons = "; ".join(sorted({str(m.meta["spmd_comm"].get("reason", "?")) for m in members}))
    comm = fused_comm(members, reason=f"{len(members)} independent all_reduces in one launch: {reasons}", label="fused",
                      what="independent all_reduces")
    comm["op"] = "fused_all_reduce"
    readers = [u for w in waits for u in w.users]
    first = min(readers, key=lambda u: pos[u]) if readers else None
    nodes: list[fx.Node] = []

    def add(target: Any, args: tuple, extra: dict | None = None, before: fx.Node | None = None) -> fx.Node:
        """A new node after the last one added (or right before ``before``), with a position between its neighbours."""
        prev = before.prev if before is not None else (nodes[-1] if nodes else anchor)
        with g.inserting_after(prev):
            node = new_node(g, target, args, None, {**meta, **(extra or {})})
        nodes.append(node)
        nxt = node.next
        pos[node] = (pos[prev] + (pos[nxt] if nxt.op != "root" else pos[prev] + 2.0)) / 2.0
        return node

    flat = [add(aten.reshape.default, (x, [-1])) for x in inputs]
    buf = add(aten.cat.default, (flat,))
    coll = add(c10d.all_reduce.default, (buf, members[0].args[1], members[0].args[2]), {"spmd_comm": comm})
    # waited right before the first read of any member's result (after the issue: _groups)
    done = add(WAIT, (coll,), {"spmd_wait": True}, before=first)
    start = 0
    for m, x, w in zip(members, inputs, waits):
        numel = int(x.meta["val"].numel())
        piece = add(aten.view.default, (add(aten.slice.Tensor, (done, 0, start, start + numel)), list(w.meta["val"].shape)))
        start += numel
        assert piece.meta["val"].shape == w.meta["val"].shape and piece.meta["val"].dtype == w.meta["val"].dtype, w
        w.replace_all_uses_with(piece)
        g.erase_node(w)
        g.erase_node(m)
    return coll


def fuse_all_reduces_pass(gm: fx.GraphModule, *, max_mb: float = 25.0) -> fx.GraphModule:
    """Merge independent standalone all_reduces of the same group, reduce op and dtype into
    one all_reduce of their concatenation, at most ``max_mb`` MB each (see the module
    docstring for when it refuses)."""
    if any(n.target is MARKER for n in gm.graph.nodes):
        return gm  # pipeline stages: a collective does not move across a stage boundary
    pos = positions(gm)
    for members in _groups(gm, pos, max_mb * 2**20):
        coll = _fuse(gm, members, pos)
        log.debug("fused %d all_reduces (%s) into %s", len(members), ", ".join(m.name for m in members), coll.name)
    return gm
