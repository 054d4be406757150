"""``constant_pad_nd`` of a tensor whose sharded dim has a symbolic size (``dynamic=True``).

Hugging Face's causal-LM loss pads the labels, ``F.pad(labels, (0, 1), value=-100)``,
before shifting them, on a batch split along dim 0. DTensor's strategy is right (pad
dims that no mesh axis splits: every rank pads its own rows), but it computes the
result's size by running torch's ``constant_pad_nd`` kernel on the global fake tensor,
and that kernel reads every size as an int: a guard that pins the batch size (one
program per shape). Here the placements are the input's, the global size is the sizes'
arithmetic, and each rank pads its local tensor (its fake value from torch's Python
decomposition, which keeps sizes symbolic). Padding a split dim, a negative pad (a
crop) or a ``Partial`` input (a nonzero pad value would be summed) go to DTensor.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _private_torch as pt
from ..args import ExpandContext, TensorArg, _out_tensor
from ..builder import SubgraphBuilder
from ..dispatch import generic_expand
from ..registry import register_rule
from .views import _contiguous_strides

aten = torch.ops.aten

__all__: list[str] = []


@register_rule(aten.constant_pad_nd.default)
def _constant_pad_nd(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    pad = list(args[1] if len(args) > 1 else kwargs.get("pad", []))
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    if not (isinstance(x, TensorArg) and b.sizes is not None and any(pt.is_symbolic(s) for s in x.spec.shape)):
        return generic_expand(ctx, b, op, args, kwargs)
    if any(not isinstance(p, int) or p < 0 for p in pad) or len(pad) % 2 or len(pad) // 2 > len(x.spec.shape):
        return generic_expand(ctx, b, op, args, kwargs)
    ndim = len(x.spec.shape)
    padded = {ndim - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}
    placements = x.spec.placements
    if any(isinstance(p, pt.Partial) for p in placements):
        return generic_expand(ctx, b, op, args, kwargs)
    if any(isinstance(p, (pt.Shard, pt.StridedShard)) and p.dim % ndim in padded for p in placements):
        return generic_expand(ctx, b, op, args, kwargs)
    shape = [s + sum(padded[d]) if d in padded else s for d, s in enumerate(x.spec.shape)]
    node = b.call(op, x.node, pad, value)
    spec = pt.make_spec(ctx.mctx.mesh, placements, shape, _contiguous_strides(shape), x.spec.tensor_meta.dtype)
    return _out_tensor(b, node, spec, {})
