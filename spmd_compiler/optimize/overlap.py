"""Overlapping communication with computation.

Functional collectives are asynchronous until their ``wait_tensor``. This pass issues
each collective as soon as its input exists and waits for it as late as its first use,
so local work runs while data moves. All ranks run the same graph, so every group sees
its collectives issued in the same order on every rank.

Gathers of sharded parameters (FSDP-style plans) are the exception: issued as early as
possible they would materialize every parameter at once. Each is issued only when the
``prefetch``-th previous parameter gather of the same phase is first used, i.e. one step
ahead of need (a phase's first gathers: not before the phase starts; in backward
``backward_prefetch``, 1 as in FSDP2, since backward starts where activations peak), and
the gathered tensor is released after its last use (the generated code drops it).
"""

from __future__ import annotations

import torch.fx as fx

from .graph_utils import alias_root, hoist, param_root, is_collective, is_wait, move_before, positions, prep_chain, writes_by_root

__all__ = ["overlap_pass", "is_param_gather"]


def is_param_gather(n: fx.Node) -> bool:
    """An all_gather of parameter shards (FSDP), its own or fused per unit."""
    if "spmd_param_gather" in n.meta:
        return True
    if n.meta["spmd_comm"]["kind"] != "all_gather":
        return False
    chain = prep_chain(n)
    src = chain[-1].args[0] if chain else n.args[0]
    root = param_root(src)
    inp = root.meta.get("spmd_input") if isinstance(root, fx.Node) else None
    return root.op == "placeholder" and inp is not None and inp.kind in ("param", "buffer")


def _first_use(n: fx.Node, pos: dict[fx.Node, int]) -> fx.Node | None:
    users = list(n.users)
    return min(users, key=lambda u: pos[u]) if users else None


def _first_compute_use(n: fx.Node, pos: dict[fx.Node, int]) -> fx.Node | None:
    """The first user of ``n`` that is not the copy-out of a fused gather."""
    found = []
    for u in n.users:
        if u.meta.get("spmd_copy_out"):
            f = _first_compute_use(u, pos)
            if f is not None:
                found.append(f)
        else:
            found.append(u)
    return min(found, key=lambda u: pos[u]) if found else None


def overlap_pass(gm: fx.GraphModule, *, prefetch: int = 2, backward_prefetch: int = 1) -> fx.GraphModule:
    """Issue collectives early and wait late; parameter gathers ``prefetch`` ahead in
    forward, ``backward_prefetch`` ahead in backward (FSDP2's default: one unit; the first
    backward units are gathered where activations peak)."""
    for name, value in (("prefetch", prefetch), ("backward_prefetch", backward_prefetch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 (gathers issued ahead of need), got {value!r}")
    pos = positions(gm)
    writes = writes_by_root(gm)
    collectives = [n for n in gm.graph.nodes if is_collective(n)]
    gathers = [n for n in collectives if is_param_gather(n)]
    gather_set = set(gathers)
    for n in collectives:
        if n not in gather_set:
            hoist(gm, n, pos, writes=writes)
    # parameter gathers: in order of need, each issued when an earlier one is first used
    waits = {n: next(u for u in n.users if is_wait(u)) for n in gathers}
    def need(n: fx.Node) -> float:
        use = _first_compute_use(waits[n], pos)
        return pos[use] if use is not None else pos[n]

    # counted within each phase: a backward gather (Plan(reshard_after_forward=True)) is
    # not issued in forward, where it would hold the full parameter through the forward
    starts: dict[object, fx.Node] = {}
    for node in gm.graph.nodes:
        starts.setdefault(node.meta.get("spmd_phase"), node)
    first_phase = next((n.meta.get("spmd_phase") for n in sorted(gathers, key=need)), None)
    by_phase: dict[object, list[fx.Node]] = {}
    for n in sorted(gathers, key=need):
        by_phase.setdefault(n.meta.get("spmd_phase"), []).append(n)
    for phase, order in by_phase.items():
        ahead = backward_prefetch if phase == "backward" else prefetch
        for i, n in enumerate(order):
            if i < ahead:
                start = starts[phase].prev if phase != first_phase else None
                hoist(gm, n, pos, not_before=start, writes=writes)
            else:
                earlier = order[i - ahead]
                use = _first_compute_use(waits[earlier], pos)
                if use is not None and use.prev is not None:
                    hoist(gm, n, pos, not_before=use.prev, writes=writes)
    # waits: as late as the first use
    for w in [n for n in gm.graph.nodes if is_wait(n)]:
        use = _first_use(w, pos)
        if use is not None and use is not w.next:
            move_before(w, use, pos)
    return gm
