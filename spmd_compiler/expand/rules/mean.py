"""``mean`` over a batch dim whose size is symbolic (``compile(dynamic=True)``).

DTensor averages per-rank means (``Partial(avg)``), which is wrong for unequal shards,
so an uneven mean replicates its input first (:func:`..guards._guard_uneven_avg`). A
symbolic size may be even or uneven, and gathering every element for every size would
cost a program that serves all sizes far more than the per-shape one (the per-sample
losses, not one number). Exact for every size instead: each rank sums its rows and
divides by the global count (an expression of the size symbols), and the result is
``Partial(sum)``: the reduction adds the pieces, empty shards included.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import SubgraphBuilder
from ..args import ExpandContext, TensorArg, _out_tensor
from ..dispatch import generic_expand
from ..registry import register_rule

aten = torch.ops.aten


@register_rule(aten.mean.default, aten.mean.dim)
def _mean(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    if not isinstance(x, TensorArg) or not any(pt.is_symbolic(s) for s in x.spec.shape) or kwargs.get("dtype") is not None:
        return generic_expand(ctx, b, op, args, kwargs)
    shape = list(x.spec.shape)
    ndim = len(shape)
    if op is aten.mean.default:
        dims, keepdim = list(range(ndim)), False
    else:
        given = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = sorted({d % max(ndim, 1) for d in (given if given else range(ndim))})
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    placements = list(x.spec.placements)
    if not all(p.is_replicate() or type(p) is pt.Shard for p in placements):
        return generic_expand(ctx, b, op, args, kwargs)
    if not any(type(p) is pt.Shard and p.dim in dims for p in placements):
        return generic_expand(ctx, b, op, args, kwargs)  # no sharded dim reduced: DTensor's mean is local
    kept = [d for d in range(ndim) if d not in dims]
    out_placements = []
    for p in placements:
        if type(p) is pt.Shard and p.dim in dims:
            out_placements.append(pt.Partial("sum"))
        elif type(p) is pt.Shard:
            out_placements.append(pt.Shard(p.dim if keepdim else kept.index(p.dim)))
        else:
            out_placements.append(p)
    count = math.prod(shape[d] for d in dims)  # the global number of elements averaged
    local_sum = b.call(aten.sum.dim_IntList, x.node, dims, keepdim)
    out = b.call(aten.div.Tensor, local_sum, torch.sym_float(count))
    out_shape = [1 if d in dims else shape[d] for d in range(ndim)] if keepdim else [shape[d] for d in kept]
    stride, acc = [], 1
    for s in reversed(out_shape):
        stride.append(acc)
        acc = acc * s
    spec = pt.make_spec(ctx.mctx.mesh, out_placements, out_shape, tuple(reversed(stride)), x.spec.tensor_meta.dtype)
    return _out_tensor(b, out, spec, {})
