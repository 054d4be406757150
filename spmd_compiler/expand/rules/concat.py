"""Concatenation and splitting of fused projections (qkv) along a sharded dim.

A fused ``qkv`` projection split by output features for tensor parallelism must give
each rank its share of q, of k and of v: ``_StridedShard(d, split_factor=3)`` of the
fused dim (GPT-2's ``c_attn``). DTensor gathers such a value before ``split``, and
gathers the three ``Shard(d)`` gradients before ``cat`` in backward. Neither needs data
from another rank:

* ``split`` / ``split_with_sizes`` of a ``_StridedShard(d, sf)`` dim into ``k`` equal
  pieces, ``k`` dividing ``sf``: each piece holds ``sf / k`` whole blocks, so it is
  ``_StridedShard(d, sf / k)`` (``Shard(d)`` when ``k == sf``) and each rank's local
  pieces are the local tensor split into ``k`` equal parts (a view merging a split
  batch dim behind another, :mod:`.views`, gives such values);
* ``cat`` along ``d`` of ``k`` tensors of equal size, each ``Shard(d)`` on a mesh axis:
  the result is ``_StridedShard(d, k)`` on that axis, the local ``cat``.

(Only where no other mesh axis splits ``d``.) ``cat`` also drops the legacy empty 1-D
inputs that ``torch.cat`` skips (an empty KV cache, ``cat([tensor([]), x], -2)``),
whose placements DTensor cannot line up with the others; a ``cat`` of one tensor is a copy
laid out as it is (DTensor gathered a sequence split, context parallelism's keys).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import SubgraphBuilder
from ..args import RESULT, ExpandContext, TensorArg, _out_tensor
from ..collectives import strided_all_to_all_ok
from ..redistribute import emit_redistribute
from ..dispatch import expand_op, generic_expand
from ..registry import register_rule
from ..values import DSymInt

aten = torch.ops.aten


def _only_axis(placements: Any, dim: int, kind: type) -> int | None:
    """The one mesh axis whose placement is ``kind`` on ``dim``; None when another axis
    also splits ``dim`` or none does."""
    axes = [a for a, p in enumerate(placements) if getattr(p, "dim", None) == dim and (p.is_shard() or isinstance(p, pt.StridedShard))]
    if len(axes) != 1 or type(placements[axes[0]]) is not kind:
        return None
    return axes[0]


def _spec(spec: Any, axis: int, placement: Any, shape: Any) -> Any:
    placements = list(spec.placements)
    placements[axis] = placement
    stride = torch.empty(tuple(shape), device="meta").stride()
    return pt.make_spec(spec.mesh, placements, tuple(shape), stride, spec.tensor_meta.dtype)


@register_rule(aten.cat.default)
def _cat(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    tensors, dim = list(args[0]), (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    if not all(isinstance(t, TensorArg) for t in tensors):
        return generic_expand(ctx, b, op, args, kwargs)
    kept = [t for t in tensors if not (len(t.spec.shape) == 1 and t.spec.shape[0] == 0)]
    if kept and len(kept) < len(tensors) and any(len(t.spec.shape) > 1 for t in kept):
        return expand_op(ctx, b, op, (kept, dim), {})  # torch.cat skips legacy empty inputs
    ndim = len(tensors[0].spec.shape)
    dim = dim % ndim if ndim else dim
    first = tensors[0].spec
    if len(tensors) == 1 and ndim:  # a copy (after dropping an empty KV cache): laid out as its input
        node = b.call(op, [tensors[0].node], dim)
        return _out_tensor(b, node, _spec(first, 0, first.placements[0], list(first.shape)), {})
    axis = _only_axis(first.placements, dim, pt.Shard)
    same = all(tuple(t.spec.placements) == tuple(first.placements) and tuple(t.spec.shape) == tuple(first.shape) for t in tensors)
    if axis is None or len(tensors) < 2 or not same:
        return generic_expand(ctx, b, op, args, kwargs)
    node = b.call(op, [t.node for t in tensors], dim)
    shape = list(first.shape)
    shape[dim] *= len(tensors)
    out = _spec(first, axis, pt.StridedShard(dim, split_factor=len(tensors)), shape)
    param = (ctx.grad_of or {}).get(RESULT)  # the gradient of a fused weight stored Shard(dim): back to its layout
    if param is not None and tuple(param.shape) == tuple(shape) and param.placements[axis] == pt.Shard(dim) and strided_all_to_all_ok(
            shape[dim], len(tensors), ctx.mctx.shape[axis]) and not ctx.mctx.head_tail(axis):
        want = _spec(first, axis, pt.Shard(dim), shape)
        node, _ = emit_redistribute(b, node, out, want, reason=f"gradient of a fused weight, to its Shard({dim}) layout")
        return _out_tensor(b, node, want, {})
    return _out_tensor(b, node, out, {})


def _fused_pieces(ctx: ExpandContext, x: TensorArg, sizes: Any, dim: int) -> tuple[int, int] | None:
    """``(axis, k)`` when ``x`` is a plain ``Shard(dim)`` on one mesh axis being split into
    ``k > 1`` equal pieces that its ``_StridedShard(dim, k)`` layout splits locally (one
    all_to_all away, :func:`..collectives.strided_all_to_all_ok`); else None."""
    axis = _only_axis(x.spec.placements, dim, pt.Shard)
    if axis is None or ctx.mctx.head_tail(axis):
        return None
    size = x.spec.shape[dim]
    k = len(sizes) if isinstance(sizes, (list, tuple)) else (-(-size // sizes) if isinstance(sizes, int) and sizes > 0 else 0)
    equal = isinstance(sizes, (list, tuple)) and len(set(sizes)) == 1 or isinstance(sizes, int) and size % sizes == 0
    if k < 2 or not equal or not strided_all_to_all_ok(size, k, ctx.mctx.shape[axis]):
        return None
    return axis, k


def _to_strided(ctx: ExpandContext, b: SubgraphBuilder, x: TensorArg, axis: int, k: int, why: str) -> TensorArg:
    placements = list(x.spec.placements)
    placements[axis] = pt.StridedShard(placements[axis].dim, split_factor=k)
    dst = pt.make_spec(ctx.mctx.mesh, placements, x.spec.shape, x.spec.stride, x.spec.tensor_meta.dtype)
    node, mask = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=why, input_index=x.index, value_label=x.label)
    return x.moved(node, dst, mask)


def _global(size: Any) -> Any:
    return size.global_value if isinstance(size, DSymInt) else size


@register_rule(aten.split.Tensor, aten.split_with_sizes.default)
def _split(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    x, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    # sizes read from the traced program (``y.chunk(2)`` of a symbolic batch) count globally
    sizes = [_global(s) for s in sizes] if isinstance(sizes, (list, tuple)) else _global(sizes)
    if not isinstance(x, TensorArg) or any(not isinstance(s, int) for s in (sizes if isinstance(sizes, list) else [sizes])):
        return generic_expand(ctx, b, op, args, kwargs)
    dim = dim % len(x.spec.shape)
    fused = _fused_pieces(ctx, x, sizes, dim)
    if fused is not None:  # a plain Shard of a fused dim: to the strided layout of its pieces (one all_to_all)
        x = _to_strided(ctx, b, x, *fused, f"{op} of a fused dim into {fused[1]} pieces (each piece split alike; a weight stored "
                                                    f"with spmd_compiler.fused_shard(d, {fused[1]}) keeps this layout and saves it)")
    axis = _only_axis(x.spec.placements, dim, pt.StridedShard)
    if axis is None or pt.split_period(x.spec.placements[axis]) is not None:  # a symbolic block count
        return generic_expand(ctx, b, op, args, kwargs)
    sf, size = int(x.spec.placements[axis].split_factor), x.spec.shape[dim]
    pieces = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes] * -(-size // sizes)
    k = len(pieces)
    if sf % k or size % sf or any(p != size // k for p in pieces):
        return generic_expand(ctx, b, op, args, kwargs)
    per_piece = sf // k  # whole blocks in each piece
    local = per_piece * b.local_chunk(size // sf, axis)  # this rank's part of each block
    node = b.call(aten.split_with_sizes.default, x.node, [local] * k, dim)
    shape = list(x.spec.shape)
    shape[dim] = size // k
    placement = pt.Shard(dim) if per_piece == 1 else pt.StridedShard(dim, split_factor=per_piece)
    spec = _spec(x.spec, axis, placement, shape)
    return [_out_tensor(b, item, spec, {}) for item in b.getitems(node)]
