"""Lowering the per-rank program's peak memory without changing what it computes.

Two passes, run after :mod:`.schedule` (they see the program in its final order):

* :func:`rematerialize_pass` recomputes in backward the cheap elementwise activations
  that autograd saved only because backward reads them (``gelu(h)`` for the weight
  gradient of the next linear) when their input stays alive until then anyway
  (``gelu_backward`` reads ``h``). The saved output then dies after its last forward
  use instead of living from forward to backward, at the cost of one elementwise op per
  activation. The recomputed op runs the same kernel on the same input, so the values
  are bitwise the ones forward computed (what ``torch.compile``'s min-cut partitioner
  does by default for pointwise ops).
* :func:`budget_prefetch_pass` moves each parameter gather (FSDP) that :mod:`.overlap`
  issued ahead of need later, to the earliest point from which holding its output (and
  the backend's staging buffer, :data:`spmd_compiler.dump.memory.STAGING`) until its
  wait does not raise the program's peak above what it would be with the gather issued
  at its wait. The prefetch still overlaps the work that fits under the peak (the rest
  of the previous unit's backward once its activations are freed). A gather never moves
  past another collective (every rank issues them in the same order), a write to the
  shards it reads, or a pipeline marker.

Both only reorder or duplicate pure nodes; :func:`~.graph_utils.mutation_edges` order is kept.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..trace.markers import MARKER
from .live_bytes import LiveBytes
from .graph_utils import alias_root, is_collective, is_inplace, is_view, is_wait, move_before, positions, prep_chain, writes_by_root, written_inputs
from .overlap import is_param_gather

__all__ = ["rematerialize_pass", "budget_prefetch_pass", "RECOMPUTABLE"]

aten = torch.ops.aten
# elementwise ops of one activation input, deterministic, cheap next to the matmuls around them
RECOMPUTABLE = {aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default}


def _phase(n: fx.Node) -> Any:
    return n.meta.get("spmd_phase")


def _storage_last_use(gm: fx.GraphModule, pos: dict[fx.Node, float]) -> dict[Any, float]:
    """Storage root -> position of the last node reading it (through any alias)."""
    out: dict[Any, float] = {}
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            out[alias_root(a)] = pos[n]
    return out


def _last_use_of(root: fx.Node, pos: dict[fx.Node, float]) -> float | None:
    """Position of the last node reading ``root``'s storage (through any alias: the views
    and in-place results taken of it), or None: what :func:`_storage_last_use` says for
    one root, from the nodes around it."""
    aliases, todo, last = {root}, [root], None
    while todo:
        for u in todo.pop().users:
            p = pos[u]
            last = p if last is None or p > last else last
            if u not in aliases and (is_view(u) or is_inplace(u)) and u.args and u.args[0] in aliases:
                aliases.add(u)
                todo.append(u)
    return last


def _insert_position(node: fx.Node, pos: dict[fx.Node, float]) -> None:
    """A position for ``node``, just inserted, between its neighbours'."""
    pos[node] = (pos[node.prev] + pos[node.next]) / 2.0


def _forward_views(n: fx.Node) -> list[fx.Node]:
    """``n`` and the forward views taken of it (transitively), in program order."""
    out, todo = [n], [n]
    while todo:
        for u in todo.pop().users:
            if _phase(u) == "forward" and is_view(u) and u.args and u.args[0] in out:
                out.append(u)
                todo.append(u)
    return out


def rematerialize_pass(gm: fx.GraphModule, *, ops: frozenset | set | None = None) -> fx.GraphModule:
    """Recompute saved elementwise activations in backward where that frees memory
    (see module doc). ``ops``: the recomputable targets (default :data:`RECOMPUTABLE`)."""
    ops = RECOMPUTABLE if ops is None else ops
    pos = positions(gm)  # kept up to date as copies are inserted (floats between their neighbours)
    last_use = _storage_last_use(gm, pos)  # and this, for the roots each rewrite touches
    written = writes_by_root(gm)
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in ops or _phase(n) != "forward" or len(n.all_input_nodes) != 1:
            continue
        src = n.all_input_nodes[0]
        root = alias_root(src)
        if root.op == "placeholder" or root in written:  # a parameter (updated in place) or a written value
            continue
        views = _forward_views(n)
        readers = list(dict.fromkeys(u for v in views for u in v.users if _phase(u) == "backward"))
        if not readers:
            continue
        first = min(readers, key=lambda u: pos[u])
        needed = {v for u in readers for v in views if v in u.all_input_nodes}
        for v in reversed(views):  # and the views they are taken of
            if v in needed and v is not n:
                needed.add(v.args[0])
        if last_use.get(root, -1.0) < pos[first]:  # recomputing would keep the input alive longer
            continue
        # the recomputation (and the views backward reads), right before the first backward reader
        copies: dict[fx.Node, fx.Node] = {}
        with gm.graph.inserting_before(first):
            for v in (v for v in views if v in needed):
                args = tuple(copies.get(a, a) if isinstance(a, fx.Node) else a for a in v.args)
                c = gm.graph.call_function(v.target, args, dict(v.kwargs))
                c.meta.update({k: val for k, val in v.meta.items() if k != "spmd_schedule"})
                c.meta["spmd_phase"] = _phase(first)
                c.meta["spmd_remat"] = f"{v.name} computed again for backward (its input {src.name} is alive there anyway)"
                copies[v] = c
                _insert_position(c, pos)
        touched = {alias_root(a) for c in copies.values() for a in c.all_input_nodes} | {root, n, copies[n]}
        for u in readers:
            for v in needed:
                if v in u.all_input_nodes:
                    u.replace_input_with(v, copies[v])
        for v in reversed(views):
            if not v.users:
                touched.update(alias_root(a) for a in v.all_input_nodes)
                gm.graph.erase_node(v)
                touched.discard(v)
                del pos[v]
        for r in touched:
            last = _last_use_of(r, pos)
            if last is None:
                last_use.pop(r, None)
            else:
                last_use[r] = last
    gm.graph.lint()
    return gm


def _backend(backend: str | None) -> str | None:
    if backend != "auto":
        return backend
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def _blocks(n: fx.Node, roots: set[Any]) -> bool:
    """``n`` is a node no gather moves past: a marker, a non-call, or a write to the shards it reads."""
    if n.op != "call_function" or n.target is MARKER:
        return True
    return bool(roots.intersection(alias_root(x) for x in written_inputs(n)))


def _window(g: fx.Node, wait: fx.Node, chain: list[fx.Node]) -> tuple[fx.Node | None, fx.Node]:
    """(the last gradient reduction a backward gather may be issued after, or None; the
    first node after ``g`` it cannot move past: another collective, a write to its shards,
    a marker, or its wait). Only the order of collectives decides the first: it is the same
    on every rank, while bytes alive may not be (an uneven batch)."""
    roots = {alias_root(a) for c in [*chain, g] for a in c.all_input_nodes if a not in chain}
    after, n = None, g.next
    while n is not wait and not _blocks(n, roots):
        if is_collective(n):
            if is_param_gather(n) or _phase(n) != "optimizer" or _phase(g) != "backward":
                break
            after = n
        n = n.next
    n = (after or g).next
    while n is not wait and not _blocks(n, roots) and not is_collective(n):
        n = n.next
    return after, n


def _place(gm: fx.GraphModule, movers: list[fx.Node], anchor: fx.Node, pos: dict[fx.Node, float]) -> None:
    for m in movers:
        move_before(m, anchor, pos)


def _to_latest(gm: fx.GraphModule, g: fx.Node, pos: dict[fx.Node, float]) -> tuple[list[fx.Node], set[fx.Node]] | None:
    """Move gather ``g`` (and its prep chain) as late as it may go; returns the movers and
    the nodes it may be issued before again (where it was, up to there), or None.
    ``pos`` (:func:`~.graph_utils.positions`) is kept up to date."""
    waits = [u for u in g.users if is_wait(u)]
    if len(waits) != 1 or not isinstance(g.meta.get("val"), torch.Tensor):
        return None
    chain = sorted(prep_chain(g), key=lambda c: pos[c])
    movers = [*chain, g]
    after, limit = _window(g, waits[0], chain)
    if after is not None:  # a gradient bucket's reduction first: its copy-in is freed before the gather's buffers come
        _place(gm, movers, after.next, pos)
        g.meta["spmd_prefetch_budget"] = f"issued after the gradient reduction {after.name}"
    spots, n = set(), g.next
    while n is not limit:
        spots.add(n)
        n = n.next
    _place(gm, movers, limit, pos)
    return movers, spots


def _pull_earlier(gm: fx.GraphModule, movers: list[fx.Node], spots: set[fx.Node], live: LiveBytes, staged: bool,
                  pos: dict[fx.Node, float]) -> None:
    """Issue the gather (``movers[-1]``) at the earliest of ``spots`` from which holding
    its buffers does not raise the program's peak (``live``: the program's memory trace,
    kept up to date)."""
    from ..dump.memory import tensor_bytes

    g = movers[-1]
    out = tensor_bytes(g.meta["val"]) * (2 if staged else 1)  # its output (and staging) until the wait
    peak, nodes, counts = live.peak, live.order, live.live
    hi = at = live.index[movers[0]]
    while at > 0 and nodes[at - 1] in spots and counts[at - 1] + out <= peak:
        at -= 1
    while at < hi and live.peak_if_moved(movers, at) > peak:  # the copy-in is alive at the issue too: check the placement
        at += 1
    before, anchor = nodes[at - 1], nodes[at]
    if at < hi:
        live.move(movers, at)
        _place(gm, movers, anchor, pos)
    if before in spots:
        g.meta["spmd_prefetch_budget"] = f"issued before {anchor.name}: earlier would raise the peak ({peak} bytes)"


def budget_prefetch_pass(gm: fx.GraphModule, *, backend: str | None = "auto") -> fx.GraphModule:
    """Issue each parameter gather as early as its memory allows (see module doc).
    ``backend``: the process group's backend whose staging buffers count ("auto": the
    initialized default group's, None: none). Every gather first goes as late as it may
    (the budget: that program's peak), then each, in program order, as early as fits
    under that peak. The memory trace is counted once and kept up to date per move
    (:class:`~.live_bytes.LiveBytes`): the pass's cost grows with the program, not with
    the program times its gathers."""
    from ..dump.memory import STAGING

    backend = _backend(backend)
    staged = STAGING.get(backend or "", {}).get("all_gather") == "output"
    gathers = [n for n in gm.graph.nodes if is_collective(n) and is_param_gather(n)]
    pos = positions(gm)
    spans = [s for s in (_to_latest(gm, g, pos) for g in gathers) if s is not None]
    if spans:
        live = LiveBytes(gm, backend=backend)  # the budget: the peak with every gather as late as it may go
        for movers, spots in spans:
            _pull_earlier(gm, movers, spots, live, staged, pos)
    gm.graph.lint()
    return gm
