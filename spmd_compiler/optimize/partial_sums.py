"""Sum Partial terms before reducing them: one all_reduce where autograd's order made two.

Autograd accumulates a tensor's gradient contributions one add at a time, in the order
its backward produced them. Under Megatron TP a composite norm's input (torchtitan's
``nn.RMSNorm``, any norm written in aten ops) gets three: the residual's (Replicate) and
two through the norm (``x * rsqrt(...)`` and the ``rsqrt`` of ``x.pow(2)``), both
Partial(sum) over tp. Accumulated as ``(residual + P1) + P2``, each add of a Partial into
a Replicate reduces it first, so backward all_reduces two activations per norm where
Megatron reduces one. The expansion works node by node and cannot see the second add
when it expands the first; this pass can:

    add(add(y, wait(all_reduce(q))), wait(all_reduce(p)))
        -> add(y, wait(all_reduce(q + p)))

An all_reduce is linear (sum, or avg of the same group), so both are the same value up to
rounding: the reduced sum of the terms in place of the sum of reduced terms, the order a
one-device program sums its terms in no less than before. Chains fold one add at a time
(``((y + P1) + P2) + P3`` -> one all_reduce), two Partial terms with no Replicate
(``wait(ar(q)) + wait(ar(p))``) too. The cost is linear in the graph: each add is looked
at once.

Rewritten only when: both all_reduces have the same group, reduce op (sum or avg), dtype
and shape as each other and as both adds (no broadcast, no type promotion); each is
waited by one ``wait_tensor`` whose one reader is its add; the inner add has no other
reader; neither input's storage is written in place anywhere (the first reduction is
issued later); buckets are left alone. Under per-rank sizes (``RANK_SIZES``: an uneven
split, a symbolic batch) the decision is taken on the global shapes and splits, which
every rank has, not on this rank's sizes, so every rank makes the same program. The kept
all_reduce is the later one, so no value is needed earlier than before; the other
reduction's input waits until then (its reduction is no longer in flight).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ..expand.splice import RANK_SIZES
from .graph_utils import alias_root, is_collective, is_wait, new_node, positions, written_roots

__all__ = ["sum_partials_before_reducing_pass"]

log = logging.getLogger(__name__)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_LINEAR_OPS = ("sum", "avg")


def _shape(n: fx.Node) -> tuple[str, ...] | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(str(d) for d in val.shape) if isinstance(val, torch.Tensor) else None


def _reduced(w: object, written: set) -> fx.Node | None:
    """The all_reduce that ``w`` waits for, when ``w`` is the only use of a plain linear
    all_reduce and has one reader itself; else None."""
    if not (isinstance(w, fx.Node) and is_wait(w) and len(w.users) == 1):
        return None
    ar = w.args[0]
    if not (isinstance(ar, fx.Node) and is_collective(ar) and ar.target is c10d.all_reduce.default and len(ar.users) == 1):
        return None
    comm = ar.meta.get("spmd_comm") or {}
    x = ar.args[0]
    if ar.args[1] not in _LINEAR_OPS or comm.get("op") in ("bucket", "mean_pair", "fused_all_reduce"):
        return None
    if not isinstance(x, fx.Node) or alias_root(x) in written:
        return None
    return ar


def _layout(n: fx.Node) -> tuple | None:
    """The global shape and the split of ``n`` (Partial and Replicate alike), the same on
    every rank; None when the expansion left no spec."""
    spec = n.meta.get("spmd_spec")
    if spec is None:
        return None
    return tuple(str(d) for d in spec.shape), tuple("R" if p.is_partial() or p.is_replicate() else repr(p) for p in spec.placements)


def _plain_add(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is aten.add.Tensor and not n.kwargs and len(n.args) == 2


def _terms(n: fx.Node, written: set) -> tuple[object, fx.Node] | None:
    """``(other, wait)`` when ``n`` adds a reduced Partial ``wait`` to ``other`` (either side)."""
    if not _plain_add(n):
        return None
    a, b = n.args
    for other, w in ((a, b), (b, a)):
        if _reduced(w, written) is not None:
            return other, w
    return None


def _merge(gm: fx.GraphModule, outer: fx.Node, written: set, pos: dict) -> bool:
    """Fold ``outer = inner + wait(ar(p))`` with ``inner = y + wait(ar(q))`` (or ``inner =
    wait(ar(q))``) into one all_reduce of ``q + p``; True when it did."""
    found = _terms(outer, written)
    if found is None:
        return False
    inner, w_p = found
    if not isinstance(inner, fx.Node) or len(inner.users) != 1:
        return False
    if _reduced(inner, written) is not None:  # wait(ar(q)) + wait(ar(p))
        y, w_q = None, inner
    else:
        inner_terms = _terms(inner, written)
        if inner_terms is None:
            return False
        y, w_q = inner_terms
    ar_p, ar_q = w_p.args[0], w_q.args[0]
    p, q = ar_p.args[0], ar_q.args[0]
    if ar_p.args[1:] != ar_q.args[1:]:
        return False  # another group or reduce op
    vals = [n.meta.get("val") for n in (p, q, outer, inner)]
    if not all(isinstance(v, torch.Tensor) for v in vals) or len({v.dtype for v in vals}) != 1:
        return False
    if len({_shape(n) for n in (p, q, outer, inner)}) != 1:
        return False
    if any(RANK_SIZES in n.meta for n in (ar_p, ar_q, p, q)):
        # this rank's sizes (an uneven split): decide on what every rank has, the global
        # shapes and splits, so that every rank of the group makes the same program
        layouts = {_layout(n) for n in (p, q, outer, inner)}
        if len(layouts) != 1 or None in layouts:
            return False
    keep, drop = (ar_p, ar_q) if pos[ar_p] >= pos[ar_q] else (ar_q, ar_p)
    w_keep, w_drop = (w_p, w_q) if keep is ar_p else (w_q, w_p)
    g = gm.graph
    meta = {k: keep.args[0].meta[k] for k in ("spmd_phase", "spmd_origin", "spmd_spec") if k in keep.args[0].meta}
    with g.inserting_before(keep):
        total = new_node(g, aten.add.Tensor, (q, p), None, meta)
    prev = total.prev
    pos[total] = (pos[prev] + pos[keep]) / 2.0 if prev.op != "root" else pos[keep] - 1.0
    keep.args = (total, *keep.args[1:])
    comm = keep.meta.get("spmd_comm")
    if isinstance(comm, dict):
        terms = comm.get("partial_terms", 1) + ((drop.meta.get("spmd_comm") or {}).get("partial_terms", 1))
        reason = str(comm.get("reason", "?")).split(": ", 1)[-1] if comm.get("partial_terms") else str(comm.get("reason", "?"))
        keep.meta["spmd_comm"] = {
            **comm, "partial_terms": terms,
            "reason": f"{terms} Partial terms summed, reduced once: {reason}",
            "history": [*comm.get("history", []), f"sums {drop.name}'s Partial input before reducing (one all_reduce for both)"],
        }
    if y is None:  # outer = wait(ar(q)) + wait(ar(p)) is now wait(ar(q + p))
        outer.replace_all_uses_with(w_keep)
        g.erase_node(outer)
    else:
        outer.args = (y, w_keep)
        g.erase_node(inner)
    g.erase_node(w_drop)
    g.erase_node(drop)
    return True


def sum_partials_before_reducing_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Reduce Partial terms that are added together once, after summing them (see the
    module docstring for the pattern and when it refuses)."""
    written = written_roots(gm)
    pos = positions(gm)
    merged = 0
    for n in list(gm.graph.nodes):
        if n.graph is gm.graph and not getattr(n, "_erased", False):
            while _merge(gm, n, written, pos):
                merged += 1
                if getattr(n, "_erased", False):
                    break
    if merged:
        log.info("summed %d Partial terms into the reduction of another (one all_reduce each pair)", merged)
    return gm
