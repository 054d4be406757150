"""Rank-independent redistribution: local ops and functional collectives.

DTensor's own ``redistribute_local_tensor`` bakes the tracing rank's coordinate into the
graph (``split(...)[rank]``). Here the coordinate is a runtime value (a placeholder of the
recipe), so the same graph runs on every rank of an evenly sharded program, and every
collective node records why it exists.

Per-axis transitions (``n`` = mesh axis size, ``d`` = tensor dim):

=====================  ==============================================================
Partial -> Replicate   all_reduce (MaskPartial: zero masked rows first; p-norm partial:
                       x^p before, ^(1/p) after)
Partial -> Shard(d)    reduce_scatter along d (padded to a multiple of n if uneven)
Shard(d) -> Replicate  all_gather along d (pad before, drop padding after if uneven)
Shard(a) -> Shard(b)   all_to_all when both dims divide evenly, else gather + narrow
Replicate -> Shard(d)  narrow at ``coord * chunk`` (no communication)
Replicate -> Partial   sum: divide by n; avg/max/min: identity; MaskPartial: mask ids
=====================  ==============================================================
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..errors import UnsupportedPlacementError
from .builder import SubgraphBuilder
from .orders import OrderEscape
from .values import placements_text
from .head_tail import from_head_tail, reduce_scatter_head_tail, split_of, to_head_tail
from .collectives import (
    COLLECTIVE_OPS, _all_gather, _all_to_all, _collective, _narrow_shard, _reduce_scatter, _replicate_to_strided, _strided_to_replicate,
    shard_to_strided, strided_all_to_all_ok,
)

__all__ = ["emit_redistribute", "logical_shape", "COLLECTIVE_OPS"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional



def logical_shape(b: SubgraphBuilder, global_shape: tuple[int, ...], placements: list, axis: int) -> list[int]:
    """The tensor shape that mesh ``axis`` splits: global shape with the shards of the
    axes before ``axis`` applied (DTensor shards left to right)."""
    shape = list(global_shape)
    for i in range(axis):
        p = placements[i]
        if pt.split_period(p) is not None:  # blocks of a static period, each split n ways
            shape[p.dim] = shape[p.dim] // pt.split_period(p) * (pt.split_period(p) // b.mctx.shape[i])
        elif isinstance(p, pt.StridedShard):
            shape[p.dim] = b.local_strided(shape[p.dim], int(p.split_factor), i)
        elif isinstance(p, pt.Shard):
            shape[p.dim] = b.local_chunk(shape[p.dim], i)
    return shape


def _reduce_op(p: Any) -> str:
    op = p.reduce_op
    if op not in ("sum", "avg", "max", "min", "product"):
        raise UnsupportedPlacementError(
            f"Partial reduce op {op!r} is not supported; expected one of sum, avg, max, min, product. "
            f"fix: give this value a Partial('sum') or a Shard/Replicate placement"
        )
    return op


def _apply_mask(b: SubgraphBuilder, x: fx.Node, mask: fx.Node | None) -> fx.Node:
    if mask is None:
        raise UnsupportedPlacementError("a MaskPartial value lost its mask; this is a bug in spmd-compiler")
    m = mask
    if x.meta["val"].dim() > mask.meta["val"].dim():
        m = b.call(aten.unsqueeze.default, mask, -1)
    return b.call(aten.masked_fill.Scalar, x, m, 0)


def emit_redistribute(
    b: SubgraphBuilder,
    x: fx.Node,
    src: Any,
    dst: Any,
    *,
    mask: fx.Node | None = None,
    reason: str = "",
    input_index: int | None = None,
    value_label: str | None = None,
) -> tuple[fx.Node, fx.Node | None]:
    """Emit the ops that turn local tensor ``x`` laid out as ``src`` into ``dst``.

    ``reason`` and ``input_index`` (which tensor argument of the op is redistributed)
    are recorded on every collective emitted, for provenance.
    Returns the new local node and, when ``dst`` has a MaskPartial placement created here,
    its mask node (else the incoming ``mask``).
    """
    if tuple(src.placements) == tuple(dst.placements):
        return x, mask
    guard = getattr(b, "routing", None)
    if guard:
        moved = [a for a in guard if src.placements[a] != dst.placements[a]]
        if moved:
            raise OrderEscape(guard[moved[0]], f"{reason or 'a value'} would move on mesh axis {moved[0]} "
                              f"({placements_text(src.placements)} -> {placements_text(dst.placements)}) next to rank-local rows")
    mctx = b.mctx
    current = list(src.placements)
    global_shape = tuple(src.shape)
    steps = _conservative_steps(src, dst) if _needs_conservative(src, dst) else pt.transform_steps(src, dst)
    applied = None  # the mask once a MaskPartial reduction has zeroed the masked rows
    for step in steps:
        axis, s, t = step.axis, step.src, step.dst
        n = mctx.shape[axis]
        if s == t:
            continue
        if n == 1:
            current[axis] = t
            continue
        if isinstance(s, pt.MaskPartial) and applied is not None:
            # an index split over several axes has one mask for all of them (the OR of
            # each axis's); once applied, the other axes' terms are plain sums
            s = pt.Partial(s.reduce_op)
        logical = logical_shape(b, global_shape, current, axis)
        b.uneven = {d: _globally_uneven(global_shape, current, axis, d, mctx.shape) for d in range(len(global_shape))}
        transition = f"{placements_text([s])}->{placements_text([t])}"
        why = f"{reason}: {transition} on '{mctx.axis_names[axis]}'"
        b.comm_context = {
            "input_index": input_index,
            "transition": transition,
            "from": placements_text(src.placements),
            "to": placements_text(dst.placements),
            "why": reason,
            **({"value_label": value_label} if value_label else {}),
        }
        if s.is_replicate() and isinstance(t, pt.MaskPartial):
            x, mask = _mask_ids(b, x, axis, *_mask_size(b, t, current, axis), mask)
        else:
            before = mask
            x, mask = _emit_step(b, x, axis, s, t, logical, mask, why)
            if before is not None and mask is None and isinstance(s, pt.MaskPartial):
                applied = before
        current[axis] = t
    if applied is not None and mask is None and any(isinstance(p, pt.MaskPartial) for p in dst.placements):
        mask = b.call(aten.zeros_like.default, applied)  # nothing left to mask on the remaining axes
    return x, mask


def _mask_size(b: SubgraphBuilder, t: Any, current: list, axis: int) -> tuple[int, bool]:
    """The size of the embedding dim that mesh ``axis`` splits for MaskPartial ``t``: the
    full dim, or this rank's chunk of it when earlier axes already split it (a weight
    ``[Shard(0), Shard(0)]`` gives indices ``MaskPartial`` on both axes); and whether
    some rank's split is uneven (from the global size, so every rank emits the same ops)."""
    size = global_size = int(t.offset_shape[t.offset_dim])
    ways = b.mctx.shape[axis]
    for i in range(axis):
        p = current[i]
        if isinstance(p, pt.MaskPartial) and p.offset_dim == t.offset_dim and p.offset_shape == t.offset_shape:
            size = b.local_chunk(size, i)
            ways *= b.mctx.shape[i]
    return size, global_size % ways != 0


def _needs_conservative(src: Any, dst: Any) -> bool:
    """Strided shards, or one tensor dim split by several axes: the order of the per-axis
    steps decides which shape each step sees, so we use a fixed, always-valid order."""
    for spec in (src, dst):
        dims = [getattr(p, "dim", None) for p in spec.placements if p.is_shard() or isinstance(p, pt.StridedShard)]
        masks = [p.offset_dim for p in spec.placements if isinstance(p, pt.MaskPartial)]
        if len(masks) != len(set(masks)):  # an index split over several axes: first axis first
            return True
        if any(isinstance(p, pt.StridedShard) for p in spec.placements) or len(dims) != len(set(dims)):
            return True
    return False


def _conservative_steps(src: Any, dst: Any) -> list[Any]:
    """Gather/reduce the axes that must change to Replicate from the last axis to the
    first, then split into the target from the first axis to the last. Each step then
    sees the tensor as left-to-right sharding defines it (all later axes that split the
    same dim already replicated).

    An axis keeps its shard when its placement stays and no earlier axis changes how the
    same dim is split: a later axis that newly splits that dim narrows this rank's chunk
    (``S(0),R -> S(0),S(0)`` is a local narrow, no communication)."""
    ndim = len(src.placements)
    cur = list(src.placements)
    target = list(dst.placements)

    def shard_dim(p: Any) -> int | None:
        return p.dim if (p.is_shard() or isinstance(p, pt.StridedShard)) else None

    steps = []
    for axis in range(ndim):  # Shard(d) <-> _StridedShard(d, sf) where no other axis splits d: direct (one all_to_all)
        if _direct_strided(cur, target, axis):
            steps.append(pt.TransformStep(axis, cur[axis], target[axis]))
            cur[axis] = target[axis]
    for axis in reversed(range(ndim)):
        s = cur[axis]
        if s.is_replicate():
            continue
        d = shard_dim(s)
        earlier_changes = d is not None and any(
            d in (shard_dim(cur[i]), shard_dim(target[i])) and cur[i] != target[i] for i in range(axis)
        )
        if s == target[axis] and not earlier_changes:
            continue
        steps.append(pt.TransformStep(axis, s, pt.Replicate()))
        cur[axis] = pt.Replicate()
    for axis in range(ndim):
        if cur[axis] != target[axis]:
            steps.append(pt.TransformStep(axis, cur[axis], target[axis]))
            cur[axis] = target[axis]
    return steps


def _direct_strided(cur: list, target: list, axis: int) -> bool:
    """``cur[axis]`` and ``target[axis]`` are ``Shard(d)`` and ``_StridedShard(d, sf)`` (either
    way) and no other mesh axis splits ``d`` on either side."""
    s, t = cur[axis], target[axis]
    pair = {type(s), type(t)}
    if pair != {pt.Shard, pt.StridedShard} or s.dim != t.dim:
        return False
    strided = s if isinstance(s, pt.StridedShard) else t
    if pt.split_period(strided) is not None:
        return False
    return not any(getattr(p, "dim", None) == s.dim and (p.is_shard() or isinstance(p, pt.StridedShard))
                   for a in range(len(cur)) if a != axis for p in (cur[a], target[a]))


def _globally_uneven(global_shape: tuple[int, ...], placements: list, axis: int, dim: int, mesh_shape: tuple[int, ...]) -> bool:
    """Whether splitting ``dim`` over ``axis`` can be uneven on *some* rank.

    Decided from the global size alone, so every rank emits the same ops (padding of zero
    where its own chunk happens to be full): the graph's structure never depends on the
    coordinate, only its sizes do.
    """
    ways = mesh_shape[axis]
    for j in range(axis):
        p = placements[j]
        if getattr(p, "dim", None) == dim and (p.is_shard() or isinstance(p, pt.StridedShard)):
            ways *= mesh_shape[j]
    if pt.is_symbolic(global_shape[dim]):
        return True  # dynamic=True: the padded form serves every size (no guard on evenness)
    return global_shape[dim] % ways != 0


def _emit_step(b: SubgraphBuilder, x: fx.Node, axis: int, s: Any, t: Any, logical: list[int], mask: fx.Node | None, why: str) -> tuple[fx.Node, fx.Node | None]:
    n = b.mctx.shape[axis]
    if b.mctx.head_tail(axis) and (split_of(s) or split_of(t)):
        return _head_tail_step(b, x, axis, s, t, logical, mask, why)
    if isinstance(s, pt.StridedShard) or isinstance(t, pt.StridedShard):
        return _strided_step(b, x, axis, s, t, logical, mask, why)
    if s.is_partial() and t.is_replicate():
        if isinstance(s, pt.MaskPartial):
            x = _apply_mask(b, x, mask)
        x = _norm_pre(b, x, s)
        out = _collective(b, c10d.all_reduce.default, "all_reduce", x, axis, (_reduce_op(s),), why)
        return _norm_post(b, out, s), None
    if s.is_partial() and isinstance(t, pt.Shard):
        if isinstance(s, pt.MaskPartial):
            x = _apply_mask(b, x, mask)
        x = _norm_pre(b, x, s)
        out = _reduce_scatter(b, x, axis, t.dim, logical[t.dim], _reduce_op(s), why)
        return _norm_post(b, out, s), None
    if isinstance(s, pt.Shard) and t.is_replicate():
        return _all_gather(b, x, axis, s.dim, logical[s.dim], why), mask
    if isinstance(s, pt.Shard) and isinstance(t, pt.Shard):
        a, d = s.dim, t.dim
        la, ld = logical[a], logical[d]
        if not b.uneven[a] and not b.uneven[d]:
            return _all_to_all(b, x, axis, a, d, n, why), mask
        full = _all_gather(b, x, axis, a, la, why + " (uneven: gather then narrow)")
        return _narrow_shard(b, full, axis, d, ld), mask
    if s.is_replicate() and isinstance(t, pt.Shard):
        return _narrow_shard(b, x, axis, t.dim, logical[t.dim]), mask
    if s.is_replicate() and t.is_partial():
        if isinstance(t, pt.MaskPartial):
            size = int(t.offset_shape[t.offset_dim])
            return _mask_ids(b, x, axis, size, size % n != 0, mask)
        if isinstance(t, pt.NormPartial) and t.reduce_op == "sum":
            return b.call(aten.div.Scalar, x, float(n) ** (1.0 / t.norm_type)), None
        if t.reduce_op == "sum":
            return b.call(aten.div.Scalar, x, n), None
        if t.reduce_op in ("avg", "max", "min"):
            return x, None
    raise UnsupportedPlacementError(
        f"cannot redistribute {placements_text([s])} -> {placements_text([t])} ({why}); expected a transition between "
        f"Shard, Replicate and Partial that has a collective. fix: plan Replicate() on mesh axis "
        f"'{b.mctx.axis_names[axis]}' for the values this op reads"
    )


def _head_tail_step(b: SubgraphBuilder, x: fx.Node, axis: int, s: Any, t: Any, logical: list[int], mask: fx.Node | None,
                    why: str) -> tuple[fx.Node, fx.Node | None]:
    """A change involving a split on the context-parallel axis with the load-balanced
    layout (:mod:`.head_tail`): to/from Replicate and Partial -> Shard directly, anything
    else through Replicate."""
    src, dst = split_of(s), split_of(t)
    if s.is_replicate() and dst is not None:
        return to_head_tail(b, x, axis, dst[0], dst[1], logical[dst[0]], why), mask
    if src is not None and t.is_replicate():
        return from_head_tail(b, x, axis, src[0], src[1], logical[src[0]], why), mask
    if s.is_partial() and type(t) is pt.Shard and not isinstance(s, (pt.MaskPartial, pt.NormPartial)):
        return reduce_scatter_head_tail(b, x, axis, t.dim, logical[t.dim], _reduce_op(s), why), None
    if src is not None and dst is not None and src == dst and type(s) is type(t):
        return x, mask
    whole, mask = _emit_step(b, x, axis, s, pt.Replicate(), logical, mask, why)
    return _emit_step(b, whole, axis, pt.Replicate(), t, logical, mask, why)


def _norm_pre(b: SubgraphBuilder, x: fx.Node, p: Any) -> fx.Node:
    """A partial p-norm reduces as (sum x^p)^(1/p): raise to p before the sum."""
    if isinstance(p, pt.NormPartial) and p.reduce_op == "sum" and p.norm_type != 1:
        return b.call(aten.pow.Tensor_Scalar, x, p.norm_type)
    return x


def _norm_post(b: SubgraphBuilder, x: fx.Node, p: Any) -> fx.Node:
    if isinstance(p, pt.NormPartial) and p.reduce_op == "sum" and p.norm_type != 1:
        return b.call(aten.pow.Tensor_Scalar, x, 1.0 / p.norm_type)
    return x


def _mask_ids(b: SubgraphBuilder, x: fx.Node, axis: int, size: int, uneven: bool, mask: fx.Node | None) -> tuple[fx.Node, fx.Node]:
    """Replicate -> MaskPartial: shift ids into this rank's chunk of a vocab of ``size``,
    mask the rest (together with what ``mask`` already masks on earlier axes)."""
    local = b.local_chunk(size, axis)
    start = b.shard_offset(size, axis, uneven)
    end = b.call(operator.add, start, local)
    below = b.call(aten.lt.Scalar, x, start)
    above = b.call(aten.ge.Scalar, x, end)
    new = b.call(aten.bitwise_or.Tensor, below, above)
    mask = new if mask is None else b.call(aten.bitwise_or.Tensor, mask, new)
    shifted = b.call(aten.sub.Scalar, x, start)
    masked = b.call(aten.masked_fill.Scalar, shifted, mask, 0)
    return masked, mask


def _strided_step(b: SubgraphBuilder, x: fx.Node, axis: int, s: Any, t: Any, logical: list[int], mask: fx.Node | None, why: str) -> tuple[fx.Node, fx.Node | None]:
    """Transitions involving a strided shard go through Replicate, but ``Shard(d) <->
    _StridedShard(d, sf)`` is one all_to_all where sizes allow (:func:`.collectives.shard_to_strided`).

    ``_StridedShard(d, sf)`` splits dim d (size L) as ``[sf, n, L/(sf*n)]`` and gives
    rank j the slice ``[:, j, :]``: it is what a sharded inner dim becomes after a view
    merges it with an outer one (heads into batch*heads in attention).
    """
    if isinstance(s, pt.StridedShard) and isinstance(t, pt.StridedShard) and s == t:
        return x, mask
    n = b.mctx.shape[axis]
    for plain, strided, inverse in ((s, t, False), (t, s, True)):  # Shard(d) <-> _StridedShard(d, sf): one all_to_all
        if (type(plain) is pt.Shard and isinstance(strided, pt.StridedShard) and strided.dim == plain.dim
                and pt.split_period(strided) is None and strided_all_to_all_ok(logical[plain.dim], int(strided.split_factor), n)):
            return shard_to_strided(b, x, axis, plain.dim, int(strided.split_factor), logical[plain.dim], why, inverse), mask
    if s.is_replicate():
        return _replicate_to_strided(b, x, axis, t, logical[t.dim], why), mask
    if t.is_replicate() and isinstance(s, pt.StridedShard):
        return _strided_to_replicate(b, x, axis, s, logical[s.dim], why), mask
    # anything else: to Replicate first, then to the target
    if isinstance(s, pt.StridedShard):
        full = _strided_to_replicate(b, x, axis, s, logical[s.dim], why)
    else:
        full, mask = _emit_step(b, x, axis, s, pt.Replicate(), logical, mask, why)
    return _emit_step(b, full, axis, pt.Replicate(), t, logical, mask, why)


