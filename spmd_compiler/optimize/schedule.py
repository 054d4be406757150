"""Scheduling compute around collectives so communication overlaps it.

:mod:`.overlap` issues each collective as soon as its inputs exist and waits at its
first use. That only overlaps what happens to lie in between. This pass moves compute
into that gap, in two ways:

* **sink independent work**: nodes between one collective and the next that the next
  one does not need (the weight-gradient matmuls autograd computed before the summed
  input gradient that Megatron reduces; earlier layers' backward before a gradient
  bucket) move to right after it, so they run while it is in flight;
* **optimizer by readiness**: after backward, updates run in the order their
  gradients arrive (the parameters of the first bucket first), so a late bucket's
  reduction overlaps the updates of the early ones. A hand-built DDP step waits for
  every bucket before ``optimizer.step()``.
* **updates into waits**: an update whose gradient is final before a backward
  collective is waited runs inside that wait instead of after backward. Under
  Megatron TP the input gradients' all_reduces are synchronous; the last layers'
  AdamW updates now run while the earlier layers' all_reduces are in flight (what
  "optimizer in backward" does by hand, with the same results: only order changes).

Both keep every data dependency and every ordering a mutation implies
(:func:`~.graph_utils.mutation_edges`). Nothing is sunk past a collective of a
checkpointed region's recomputation (``meta[RECOMPUTE]``): the forward's tail (the head,
the loss) moved behind the last block's recomputed all_reduce (TP) made that
recomputation start before the forward ended; nor is what precedes a recomputation sunk
past a collective that reads it (the key/value gather of context-parallel attention's
backward). Parameter gathers of FSDP plans, random ops
and pipeline markers never move, and nothing moves across them. Each moved node
records why in ``meta["spmd_schedule"]``.
"""

from __future__ import annotations

from bisect import insort

import torch.fx as fx

from ..expand.rules.random import is_random
from ..trace.markers import MARKER, RECOMPUTE
from .graph_utils import alias_root, is_collective, is_wait, move_before, mutation_edges, positions, written_inputs
from .overlap import is_param_gather

__all__ = ["schedule_for_overlap_pass"]


def _pinned(n: fx.Node) -> bool:
    """Nodes that keep their place and that nothing moves across."""
    if n.op != "call_function" or n.target is MARKER:
        return True
    if is_random(n):
        return True  # random ops draw from the generator in program order
    return is_collective(n) and is_param_gather(n)


def _needed_by(c: fx.Node, region: set[fx.Node], preds: dict[fx.Node, set[fx.Node]]) -> set[fx.Node]:
    """The nodes of ``region`` that ``c`` depends on (data and mutation order)."""
    seen: set[fx.Node] = set()
    stack = [c]
    while stack:
        n = stack.pop()
        for p in list(n.all_input_nodes) + list(preds.get(n, ())):
            if p in region and p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _sink_independent(gm: fx.GraphModule, preds: dict[fx.Node, set[fx.Node]]) -> int:
    """Walks the graph once: each region (from the last fence to the next collective)
    is visited once, and moved work lands behind the new fence."""
    boundary = gm.graph._root
    moved = 0
    for c in [n for n in gm.graph.nodes if is_collective(n)]:
        region = []
        n = boundary.next
        while n is not c:
            if _pinned(n) and n.op == "call_function":
                region = []  # a fence: nothing moves across it
            else:
                region.append(n)
            n = n.next
        if _pinned(c):
            boundary = c
            continue
        needed = _needed_by(c, set(region), preds)
        anchor = c
        recomputed = RECOMPUTE in c.meta  # a checkpointed region's recomputation starts no earlier than it did
        # nor does one that ``c`` reads (context-parallel attention's backward gathers recomputed keys):
        # what runs before its first node stays before it
        before_recomputation = any(RECOMPUTE in m.meta for m in needed)
        for n in region:
            if before_recomputation and RECOMPUTE in n.meta and n in needed:
                before_recomputation = False
            if n in needed or is_wait(n) or n.op != "call_function" or (recomputed and RECOMPUTE not in n.meta):
                continue
            if before_recomputation and RECOMPUTE not in n.meta:
                continue
            anchor.append(n)
            n.meta["spmd_schedule"] = f"runs while {c.name} is in flight (does not feed it)"
            anchor = n
            moved += 1
        boundary = anchor  # moved work is not moved again past the next collective
    return moved


def _tail(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes after the last forward/backward node (the optimizer and write-back)."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    last = max((i for i, n in enumerate(nodes) if n.meta.get("spmd_phase") in ("forward", "backward")), default=-1)
    return nodes[last + 1 :]


def _order_tail_by_readiness(gm: fx.GraphModule, pos: dict[fx.Node, float], preds: dict[fx.Node, set[fx.Node]]) -> int:
    tail = _tail(gm)
    if not tail or any(_pinned(n) for n in tail if n.op == "call_function"):
        return 0
    order = {c: i + 1 for i, c in enumerate(n for n in gm.graph.nodes if is_collective(n))}
    in_tail = set(tail)
    rank: dict[fx.Node, int] = {}
    for n in tail:  # rank = the latest-issued collective this node waits for, directly or not
        r = order[n.args[0]] if is_wait(n) else 0
        for p in list(n.all_input_nodes) + list(preds.get(n, ())):
            if p in in_tail:
                r = max(r, rank[p])
        rank[n] = r
    # (rank, position) is a topological order: both grow along every edge
    new = sorted(tail, key=lambda n: (rank[n], pos[n]))
    if new == tail:
        return 0
    anchor = tail[0].prev
    moved = 0
    for i, n in enumerate(new):
        if n is not tail[i]:
            moved += 1
            n.meta.setdefault("spmd_schedule", f"optimizer work ordered by gradient arrival (after collective #{rank[n]})")
        anchor.append(n)
        anchor = n
    for i, n in enumerate(gm.graph.nodes):
        pos[n] = float(i)
    return moved


def _updates_into_waits(gm: fx.GraphModule, pos: dict[fx.Node, float], preds: dict[fx.Node, set[fx.Node]]) -> int:
    """Move each optimizer-tail node to before the first wait of a backward collective
    at which everything it needs, data and mutation order, is done.

    A collective reads its input until it is waited (gloo and NCCL read the buffer
    asynchronously), so a node that writes the storage of a collective still in flight
    at that point stays where it is (an FSDP re-gather of a parameter shard while
    weight decay scales the shard would race).

    The waits are visited in program order and a node is looked at only once every
    input from outside the tail precedes the wait (``ready_at``, which only grows), in
    tail order: linear in the program, not in waits times tail nodes.
    """
    tail = _tail(gm)
    if not tail or any(_pinned(n) for n in tail if n.op == "call_function"):
        return 0
    in_tail = set(tail)
    pending = [n for n in tail if n.op == "call_function" and not is_wait(n) and not is_collective(n)]
    order = {n: i for i, n in enumerate(pending)}
    tail_deps: dict[fx.Node, list[fx.Node]] = {}
    ready_at: dict[fx.Node, float] = {}  # the position every dependency from outside the tail precedes
    for n in pending:
        deps = list(n.all_input_nodes) + list(preds.get(n, ()))
        tail_deps[n] = [d for d in deps if d in in_tail]
        ready_at[n] = max((pos[d] for d in deps if d not in in_tail), default=float("-inf"))
    by_ready = sorted(pending, key=lambda n: ready_at[n])
    flights = []  # (issue, wait, storages read) of collectives issued before the tail, by issue
    for c in gm.graph.nodes:
        if is_collective(c) and c not in in_tail:
            waits = [u for u in c.users if is_wait(u)]
            end = max((pos[u] for u in waits), default=float("inf"))
            flights.append((pos[c], end, {alias_root(x) for x in c.all_input_nodes}))
    moved: set[fx.Node] = set()
    windows = [n for n in gm.graph.nodes if is_wait(n) and n not in in_tail and n.args[0].meta.get("spmd_phase") == "backward"]
    candidates: list[fx.Node] = []  # pending, every outside dependency before the wait; tail order
    active: list[tuple[float, float, set]] = []  # flights issued before the wait
    k = f = 0
    for w in windows:  # in program order: positions grow
        at = pos[w]
        while k < len(by_ready) and ready_at[by_ready[k]] < at:
            insort(candidates, by_ready[k], key=order.__getitem__)
            k += 1
        if not candidates:
            continue
        while f < len(flights) and flights[f][0] < at:
            active.append(flights[f])
            f += 1
        active = [fl for fl in active if at <= fl[1]]
        busy = set().union(*(roots for _, _, roots in active))
        left = []
        for n in candidates:  # tail order is topological, so one sweep settles chains
            ready = all(d in moved for d in tail_deps[n])
            if ready and not busy.intersection(alias_root(x) for x in written_inputs(n)):
                move_before(n, w, pos)
                moved.add(n)
                n.meta["spmd_schedule"] = f"optimizer work that runs while {w.args[0].name} is in flight (its gradient is final)"
            else:
                left.append(n)
        candidates = left
    pos.update(positions(gm))  # many moves before one wait exhaust the fractional positions
    return len(moved)


def _sink_waits(gm: fx.GraphModule, pos: dict[fx.Node, float]) -> None:
    for w in [n for n in gm.graph.nodes if is_wait(n)]:
        users = list(w.users)
        if users:
            use = min(users, key=lambda u: pos[u])
            if use is not w.next:
                move_before(w, use, pos)


def schedule_for_overlap_pass(
    gm: fx.GraphModule, *, sink_independent: bool = True, optimizer_by_readiness: bool = True, updates_into_waits: bool = True
) -> fx.GraphModule:
    """Move compute into the gaps between collectives and their waits (see module doc)."""
    preds = mutation_edges(gm)
    if sink_independent:
        _sink_independent(gm, preds)
    pos = positions(gm)
    if optimizer_by_readiness:
        _order_tail_by_readiness(gm, pos, preds)
    _sink_waits(gm, pos)
    if updates_into_waits:
        _updates_into_waits(gm, pos, preds)
    return gm
