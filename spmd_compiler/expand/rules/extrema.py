"""``amax``/``amin`` over a sharded dim whose size is symbolic (``compile(dynamic=True)``);
``argmax``/``argmin`` along a dim no mesh axis splits (local, where DTensor would gather).

DTensor reduces each rank's rows locally and combines the pieces (``Partial(max)``), but
``amax`` of no rows raises, so for a concrete size with an empty shard (1 row over 2
ranks, 5 rows over 4: 2, 2, 1, 0) :func:`..guards._guard_empty_shards` gathers the input
first. A symbolic size has empty shards for some sizes and not for others; one program
for every size does what is exact for all of them instead: each rank appends one row of
the reduction's identity (``-inf`` for ``amax``, ``+inf`` for ``amin``; the dtype's
extreme for integers) along every sharded reduced dim, so no local input is empty and
the padding never wins, and the result is ``Partial(max)`` / ``Partial(min)``: the same
collective as the per-shape program of an even size.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _private_torch as pt
from ..args import ExpandContext, TensorArg, _out_tensor
from ..builder import SubgraphBuilder
from ..dispatch import generic_expand
from ..registry import register_rule

aten = torch.ops.aten

__all__: list[str] = []


def _identity(op: Any, dtype: torch.dtype) -> Any:
    """The value that never wins the reduction ``op`` in ``dtype``."""
    is_max = op is aten.amax.default
    if dtype is torch.bool:
        return not is_max
    if dtype.is_floating_point:
        return -float("inf") if is_max else float("inf")
    info = torch.iinfo(dtype)
    return info.min if is_max else info.max


@register_rule(aten.amax.default, aten.amin.default)
def _extremum(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    if not isinstance(x, TensorArg) or not any(pt.is_symbolic(s) for s in x.spec.shape):
        return generic_expand(ctx, b, op, args, kwargs)
    shape = list(x.spec.shape)
    ndim = len(shape)
    given = args[1] if len(args) > 1 else kwargs.get("dim", ())
    dims = sorted({d % max(ndim, 1) for d in (given if given else range(ndim))})
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    placements = list(x.spec.placements)
    if not all(p.is_replicate() or type(p) is pt.Shard for p in placements):
        return generic_expand(ctx, b, op, args, kwargs)
    padded = sorted({p.dim for p in placements if type(p) is pt.Shard and p.dim in dims})
    if not padded or ndim == 0:
        return generic_expand(ctx, b, op, args, kwargs)  # no sharded dim reduced: DTensor's amax is local
    kept = [d for d in range(ndim) if d not in dims]
    reduce_op = "max" if op is aten.amax.default else "min"
    out_placements = []
    for p in placements:
        if type(p) is pt.Shard and p.dim in dims:
            out_placements.append(pt.Partial(reduce_op))
        elif type(p) is pt.Shard:
            out_placements.append(pt.Shard(p.dim if keepdim else kept.index(p.dim)))
        else:
            out_placements.append(p)
    dtype = x.spec.tensor_meta.dtype
    local = x.node
    for d in padded:  # one identity row at the end of each sharded reduced dim
        # (a cat: constant_pad_nd's fake kernel asks for concrete sizes)
        row = [1 if i == d else s for i, s in enumerate(b.val(local).shape)]
        fill = b.call(aten.new_full.default, local, row, _identity(op, dtype))
        local = b.call(aten.cat.default, [local, fill], d)
    out = b.call(op, local, dims, keepdim)
    out_shape = [1 if d in dims else shape[d] for d in range(ndim)] if keepdim else [shape[d] for d in kept]
    stride, acc = [], 1
    for s in reversed(out_shape):
        stride.append(acc)
        acc = acc * s
    spec = pt.make_spec(ctx.mctx.mesh, out_placements, out_shape, tuple(reversed(stride)), dtype)
    return _out_tensor(b, out, spec, {})


@register_rule(aten.argmax.default, aten.argmin.default)
def _arg_extremum(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``argmax``/``argmin`` along a dim no mesh axis splits (a token's best expert, an
    accuracy's predicted class): each rank's rows on their own, split as they were.
    DTensor runs these through a custom handler, which would gather the input."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    ndim = len(x.spec.shape) if isinstance(x, TensorArg) else 0
    if not isinstance(x, TensorArg) or dim is None or ndim == 0:
        return generic_expand(ctx, b, op, args, kwargs)
    dim %= ndim
    placements = list(x.spec.placements)
    if not all(p.is_replicate() or (type(p) is pt.Shard and p.dim != dim) for p in placements):
        return generic_expand(ctx, b, op, args, kwargs)
    out = b.call(op, x.node, dim, keepdim)
    shape = [s for d, s in enumerate(x.spec.shape) if d != dim or keepdim]
    if keepdim:
        shape[dim] = 1
    out_placements = [p if p.is_replicate() or keepdim or p.dim < dim else pt.Shard(p.dim - 1) for p in placements]
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc = acc * s
    spec = pt.make_spec(ctx.mctx.mesh, out_placements, tuple(shape), tuple(reversed(stride)), torch.int64)
    return _out_tensor(b, out, spec, {})
