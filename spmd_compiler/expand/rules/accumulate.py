"""Accumulating writes of split values into a whole tensor: a ``Partial(sum)`` result.

``index_put(x, indices, values, accumulate=True)``, ``index_add`` and ``scatter_add`` add
each value into the row its index names. When the values are split over a mesh axis
along a dim the index walks (a batch-split gradient summed into a replicated table:
Whisper's decoder position-embedding gradient, the backward of a per-token weight
lookup in a mixture of experts), each rank can add its own values into its own copy of
``x``: the copies are partial sums of the result, ``Partial(sum)`` on that axis, and no
value moves (DTensor gathers the values instead). The index is taken as the values are
split (a replicated index is narrowed, no communication; one of size 1 along that dim
broadcasts). ``x`` is replicated there; so that the sum counts it once, the ranks at
another coordinate of that axis start from ``x * 0`` (a zero table, in every case seen).
Values that are already ``Partial(sum)`` with a replicated index give ``Partial(sum)``
the same way. Anything else (``x`` split, an in-place write whose target must keep its
placements, ``None`` entries in the index list) goes to DTensor.

Terms: the *index dims* are the dims of ``x[indices]`` that the broadcast index shape
makes (the leading ones here, since the indices index the leading dims of ``x``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ... import _private_torch as pt
from ..args import ExpandContext, TensorArg, _out_tensor
from ..builder import SubgraphBuilder
from ..redistribute import emit_redistribute

__all__ = ["partial_index_put", "partial_index_add", "partial_scatter_add"]

aten = torch.ops.aten

_INDEX_DTYPES = (torch.int64, torch.int32)


def _replicated(n: int) -> list[Any]:
    return [pt.Replicate()] * n


def _counted_once(b: SubgraphBuilder, x: TensorArg, axes: list[int]) -> Any:
    """``x`` on the ranks at coordinate 0 of every axis in ``axes``, zeros elsewhere (the
    same ops on every rank): a Replicate value as the base of a Partial(sum)."""
    node = x.node
    for axis in axes:
        if x.spec.placements[axis].is_replicate():
            first = b.call(operator.eq, b.coords[axis], 0)
            node = b.call(aten.mul.Scalar, node, first)
    return node


def _to(b: SubgraphBuilder, ctx: ExpandContext, x: TensorArg, placements: list[Any], why: str) -> Any:
    dst = pt.make_spec(ctx.mctx.mesh, placements, x.spec.shape, x.spec.stride, x.spec.tensor_meta.dtype)
    node, _ = emit_redistribute(b, x.node, x.spec, dst, reason=why, input_index=x.index, value_label=x.label)
    return node


def _plan_axes(ctx: ExpandContext, x: TensorArg, values: TensorArg, index_ndim: int, out_ndim: int) -> dict[int, int | None] | None:
    """Per mesh axis the placement story of an accumulating write, or None (not ours):
    ``{axis: j}`` where the values are split along dim ``j`` of the broadcast index shape,
    ``{axis: None}`` where they are Partial(sum); axes where everything is replicated are
    left out. ``x`` must be replicated (or Partial(sum)) on every such axis."""
    plan: dict[int, int | None] = {}
    lead = out_ndim - len(values.spec.shape)  # values broadcast against x[indices] from the right
    for axis, (p, v) in enumerate(zip(x.spec.placements, values.spec.placements)):
        if v.is_replicate():
            if not (p.is_replicate() or (p.is_partial() and p.reduce_op == "sum")):
                return None
            continue
        if not (p.is_replicate() or (p.is_partial() and p.reduce_op == "sum")) or isinstance(v, pt.MaskPartial):
            return None
        if v.is_partial():
            if v.reduce_op != "sum":
                return None
            plan[axis] = None
        elif type(v) is pt.Shard and 0 <= v.dim + lead < index_ndim:
            plan[axis] = v.dim + lead
        else:
            return None  # split along a sliced dim of x: x would have to be split too
    return plan


def _index_placements(ctx: ExpandContext, idx: TensorArg, plan: dict[int, int | None], index_ndim: int, size: dict[int, int]) -> list[Any] | None:
    """Where a tensor of the index list must be for the write: split as the values on the
    axes they are split (unless it broadcasts there), replicated elsewhere; None when it
    cannot be (split in another way)."""
    want = _replicated(ctx.mctx.ndim)
    lead = index_ndim - len(idx.spec.shape)
    for axis, j in plan.items():
        if j is None or j < lead or idx.spec.shape[j - lead] == 1:
            if not idx.spec.placements[axis].is_replicate():
                return None
            continue
        if idx.spec.shape[j - lead] != size[j]:
            return None
        want[axis] = pt.Shard(j - lead)
    for axis, p in enumerate(idx.spec.placements):
        if axis not in plan and not p.is_replicate():
            return None
        if axis in plan and not (p.is_replicate() or p == want[axis]):
            return None
    return want


def _result(ctx: ExpandContext, b: SubgraphBuilder, node: Any, x: TensorArg, plan: dict[int, int | None]) -> Any:
    placements = [pt.Partial() if axis in plan else p for axis, p in enumerate(x.spec.placements)]
    spec = pt.make_spec(ctx.mctx.mesh, placements, x.spec.shape, x.spec.stride, x.spec.tensor_meta.dtype)
    return _out_tensor(b, node, spec, {})


def partial_index_put(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``index_put(x, indices, values, accumulate=True)`` as partial sums, or None."""
    if op is not aten.index_put.default or kwargs or len(args) < 4 or args[3] is not True:
        return None
    x, indices, values = args[0], list(args[1]), args[2]
    if not isinstance(x, TensorArg) or not isinstance(values, TensorArg) or not indices:
        return None
    if any(not isinstance(i, TensorArg) or i.spec.tensor_meta.dtype not in _INDEX_DTYPES for i in indices):
        return None
    index_shape = list(torch.broadcast_shapes(*[tuple(i.spec.shape) for i in indices]))
    out_ndim = len(index_shape) + len(x.spec.shape) - len(indices)
    plan = _plan_axes(ctx, x, values, len(index_shape), out_ndim)
    if not plan:
        return None
    lead = out_ndim - len(values.spec.shape)
    for axis, j in plan.items():
        if j is not None and values.spec.shape[j - lead] != index_shape[j]:
            return None  # values broadcast along the split dim: not one value per row
    size = dict(enumerate(index_shape))
    wanted = [_index_placements(ctx, i, plan, len(index_shape), size) for i in indices]
    if any(w is None for w in wanted):
        return None
    why = f"index of {op} (taken as its values are split)"
    local = [_to(b, ctx, i, w, why) for i, w in zip(indices, wanted)]
    node = b.call(op, _counted_once(b, x, list(plan)), local, values.node, True)
    return _result(ctx, b, node, x, plan)


def partial_index_add(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``index_add(x, dim, index, source, alpha=...)`` as partial sums, or None."""
    if op is not aten.index_add.default or len(args) < 4:
        return None
    x, dim, index, source = args[:4]
    if not all(isinstance(t, TensorArg) for t in (x, index, source)) or len(index.spec.shape) != 1:
        return None
    dim = dim % max(1, len(x.spec.shape))
    plan = {}
    for axis, (p, s) in enumerate(zip(x.spec.placements, source.spec.placements)):
        if s.is_replicate() and p.is_replicate():
            continue
        if not (p.is_replicate() or (p.is_partial() and p.reduce_op == "sum")):
            return None
        if type(s) is pt.Shard and s.dim == dim or (s.is_partial() and not isinstance(s, pt.MaskPartial) and s.reduce_op == "sum"):
            plan[axis] = dim if s.is_shard() else None
        else:
            return None
    if not plan:
        return None
    want = _replicated(ctx.mctx.ndim)
    for axis, j in plan.items():
        if j is not None:
            want[axis] = pt.Shard(0)
        if not (index.spec.placements[axis].is_replicate() or index.spec.placements[axis] == want[axis]):
            return None
    if any(not p.is_replicate() for a, p in enumerate(index.spec.placements) if a not in plan):
        return None
    local = _to(b, ctx, index, want, f"index of {op} (taken as its source is split)")
    node = b.call(op, _counted_once(b, x, list(plan)), dim, local, source.node, *args[4:], **kwargs)
    return _result(ctx, b, node, x, plan)


def partial_scatter_add(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``scatter_add(x, dim, index, src)`` with ``index`` and ``src`` split alike along
    ``dim`` (each rank scatters its rows) as partial sums, or None."""
    if op is not aten.scatter_add.default or kwargs or len(args) != 4:
        return None
    x, dim, index, src = args
    if not all(isinstance(t, TensorArg) for t in (x, index, src)) or tuple(index.spec.shape) != tuple(src.spec.shape):
        return None
    dim = dim % max(1, len(x.spec.shape))
    plan = {}
    for axis, (p, i, s) in enumerate(zip(x.spec.placements, index.spec.placements, src.spec.placements)):
        if p.is_replicate() and i.is_replicate() and s.is_replicate():
            continue
        if not (p.is_replicate() or (p.is_partial() and p.reduce_op == "sum")):
            return None
        if type(s) is pt.Shard and s.dim == dim and i == s:
            plan[axis] = dim
        else:
            return None
    if not plan:
        return None
    node = b.call(op, _counted_once(b, x, list(plan)), dim, index.node, src.node)
    return _result(ctx, b, node, x, plan)

# index_add and scatter_add are registered in routing.py (rows by local row numbers
# first), which falls back to partial_index_add / partial_scatter_add here
