"""Indexing a sharded tensor by its own row numbers: ``x[arange(b)[:, None], j]``.

Hugging Face's ``create_causal_mask`` (``use_cache=False``, or any packed-sequence
check) evaluates its mask functions on a batch-shaped tensor indexed by
``arange(batch)[:, None, None, None]`` and a replicated sequence index; its
sequence-classification heads pool ``logits[arange(batch), last_token]`` with a
per-row index. With the batch split, DTensor has no strategy that keeps the indexed
tensor sharded and gathers it.

When the index of a sharded dim ``d`` is a position tensor (:mod:`..positions`, an
arange over the same global size, split the same way), each rank's index holds exactly
the global numbers of the rows it has: the local result is the indexed tensor's local
rows taken at ``index - offset`` (this rank's first row), sharded where the index is;
``index_put`` (its backward, ``x[rows] = v``) writes each rank's own rows the same way.
This is exact for uneven splits too (4 rows over 3 ranks: 2, 2, 0).

``x[mask] = v`` with a boolean mask of ``x``'s own shape and one value (Rprop's
``grad[sign.eq(etaminus)] = 0``) is ``x.masked_fill(mask, v)``, a pointwise op that
keeps every split of ``x``; DTensor's ``index_put`` strategy reads the mask as row
numbers of dim 0 and would index a column-split ``x`` with the whole mask.
Everything else goes to DTensor.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import SubgraphBuilder
from ..args import ExpandContext, TensorArg, _out_tensor
from ..dispatch import generic_expand
from ..registry import register_rule
from .routing import index_by_rows, put_by_rows
from .accumulate import partial_index_put

aten = torch.ops.aten

_INDEX_DTYPES = (torch.int64, torch.int32)


def _local_rows_plan(ctx: ExpandContext, x: TensorArg, indices: list[Any]) -> tuple[int, int, int] | None:
    """``(axis, d, kb)`` when ``x`` is sharded on mesh ``axis`` only, along dim ``d``, and
    ``indices[d]`` is a position tensor along its dim ``k`` of the same global size,
    sharded there on ``axis`` only; every other index either replicated and of size 1
    where it broadcasts against dim ``k``, or split there exactly as dim ``k`` is. None
    otherwise; ``kb`` is dim ``k`` within the broadcast shape of the indices."""
    sharded = [(a, p) for a, p in enumerate(x.spec.placements) if not p.is_replicate()]
    if len(sharded) != 1 or type(sharded[0][1]) is not pt.Shard:
        return None
    axis, d = sharded[0][0], sharded[0][1].dim
    if ctx.mctx.head_tail(axis):  # a rank's rows are two chunks, not one run from an offset
        return None
    if d >= len(indices) or not isinstance(indices[d], TensorArg) or indices[d].positions is None:
        return None
    idx, k = indices[d], indices[d].positions
    want = [pt.Replicate()] * ctx.mctx.ndim
    want[axis] = pt.Shard(k)
    if tuple(idx.spec.placements) != tuple(want) or idx.spec.shape[k] != x.spec.shape[d]:
        return None
    tensors = [i for i in indices if i is not None]
    if any(not isinstance(i, TensorArg) or i.spec.tensor_meta.dtype not in _INDEX_DTYPES for i in tensors):
        return None
    b_ndim = max(len(i.spec.shape) for i in tensors)
    kb = k + b_ndim - len(idx.spec.shape)  # dim k of the index within the broadcast shape
    for other in tensors:
        if other is idx:
            continue
        j = kb - (b_ndim - len(other.spec.shape))  # its dim that meets dim k (broadcast)
        if j < 0 or other.spec.shape[j] == 1:  # the same for every row: replicated
            if all(p.is_replicate() for p in other.spec.placements):
                continue
            return None
        # one value per row (``logits[arange(b), last_token]``): split as the rows are
        want[axis] = pt.Shard(j)
        if tuple(other.spec.placements) != tuple(want) or other.spec.shape[j] != x.spec.shape[d]:
            return None
    return axis, d, kb


def _local_indices(ctx: ExpandContext, b: SubgraphBuilder, x: TensorArg, indices: list[Any], axis: int, d: int) -> list[Any]:
    """The recipe's index list with ``indices[d]`` turned into this rank's local rows."""
    size = x.spec.shape[d]  # a symbolic batch size (dynamic=True) stays one: clamped as if uneven
    b.local_chunk(size, axis)  # marks the recipe per-rank when the split is uneven
    offset = b.shard_offset(size, axis)
    local_rows = b.call(aten.sub.Tensor, indices[d].node, offset)
    return [local_rows if j == d else (i.node if i is not None else None) for j, i in enumerate(indices)]


def _indexed(b: SubgraphBuilder, x: TensorArg, indices: list[Any], kb: int) -> tuple[torch.Tensor, int]:
    """The global ``x[indices]`` on the meta device, and its dim that dim ``kb`` of the
    broadcast index shape becomes: advanced indexing puts the broadcast dims where the
    indexed dims were when those are adjacent, else first."""
    present = [j for j, i in enumerate(indices) if i is not None]
    adjacent = present == list(range(present[0], present[-1] + 1))
    with b.fake_mode:  # symbolic sizes (dynamic=True) need the trace's fake mode
        meta = torch.empty_strided(tuple(x.spec.shape), tuple(x.spec.stride), dtype=x.spec.tensor_meta.dtype, device="meta")
        meta_indices = [
            torch.empty(tuple(i.spec.shape), dtype=i.spec.tensor_meta.dtype, device="meta") if i is not None else None for i in indices
        ]
        return aten.index.Tensor(meta, meta_indices), (present[0] if adjacent else 0) + kb


@register_rule(aten.index.Tensor)
def _index(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    routed = index_by_rows(ctx, b, op, args, kwargs)
    if routed is not None:
        return routed
    x, indices = args[0], list(args[1])
    found = _local_rows_plan(ctx, x, indices) if not kwargs else None
    if found is None:
        return generic_expand(ctx, b, op, args, kwargs)
    axis, d, kb = found
    node = b.call(op, x.node, _local_indices(ctx, b, x, indices, axis, d))
    out, out_dim = _indexed(b, x, indices, kb)
    placements = [pt.Replicate()] * ctx.mctx.ndim
    placements[axis] = pt.Shard(out_dim)
    spec = pt.make_spec(ctx.mctx.mesh, placements, tuple(out.shape), tuple(out.stride()), out.dtype)
    return _out_tensor(b, node, spec, {})


def _mask_fill(x: Any, indices: list[Any], values: Any, accumulate: Any) -> bool:
    """Whether ``index_put(x, indices, values, accumulate)`` is ``masked_fill``: one
    boolean index of ``x``'s shape, one value, no accumulation."""
    if accumulate or len(indices) != 1 or not isinstance(indices[0], TensorArg) or not isinstance(values, TensorArg):
        return False
    mask = indices[0]
    return (mask.spec.tensor_meta.dtype == torch.bool and tuple(mask.spec.shape) == tuple(x.spec.shape)
            and len(values.spec.shape) == 0)


@register_rule(aten.index_put.default, aten.index_put_.default)
def _index_put(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``x[rows, ...] = values`` (or ``+=``, the backward of the index above): each rank
    writes its own rows, taking the values of those rows, when ``values`` is split like
    the index result or the same for every row. ``x[mask] = v``: ``masked_fill``."""
    x, indices, values = args[0], list(args[1]), args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if len(indices) == 1 and isinstance(indices[0], TensorArg) and indices[0].rows is not None and indices[0].rows.into is not None:
        routed = put_by_rows(ctx, b, op, x, indices[0], values, bool(accumulate), lambda s, i, v: b.call(op, s, [i], v, accumulate))
        if routed is not None:
            return routed
    if _mask_fill(x, indices, values, accumulate):
        fill = aten.masked_fill_.Tensor if op is aten.index_put_.default else aten.masked_fill.Tensor
        return generic_expand(ctx, b, fill, (x, indices[0], values), {})
    if op is aten.index_put_.default:
        return generic_expand(ctx, b, op, args, kwargs)
    found = _local_rows_plan(ctx, x, indices) if isinstance(values, TensorArg) and not kwargs else None
    if found is not None:
        axis, d, kb = found
        out, out_dim = _indexed(b, x, indices, kb)
        j = out_dim - (out.dim() - len(values.spec.shape))  # the dim of values that meets the rows
        want = [pt.Replicate()] * ctx.mctx.ndim
        if j >= 0 and values.spec.shape[j] != 1:
            want[axis] = pt.Shard(j)
            fits = values.spec.shape[j] == out.shape[out_dim]
        else:
            fits = True
        if fits and tuple(values.spec.placements) == tuple(want):
            node = b.call(op, x.node, _local_indices(ctx, b, x, indices, axis, d), values.node, *args[3:])
            return _out_tensor(b, node, x.spec, {})
    summed = partial_index_put(ctx, b, op, args, kwargs)  # split values added into a whole x (.accumulate)
    return summed if summed is not None else generic_expand(ctx, b, op, args, kwargs)
