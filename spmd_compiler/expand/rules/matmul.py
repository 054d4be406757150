"""Matrix products whose fused form hides a better plan.

``addmm(bias, x, w)`` after a row-parallel split (``x`` and ``w`` sharded on the
contracted dim) has a Partial product. DTensor keeps the result Partial by splitting the
replicated bias into ``bias / n`` pieces; every later op then carries the Partial value
(and its inexact division) until something non-linear forces the reduction, often in
the backward too. We split it as Megatron does: ``mm`` (Partial), reduce, add the bias.

``mm(a, m)`` whose contracted dim both operands split as the same ``_StridedShard`` (tokens
flattened from ``(batch, seq)`` with the sequence split, context parallelism's weight
gradients) is a per-rank partial sum; DTensor gathered both.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import SubgraphBuilder
from ..args import ExpandContext, TensorArg, _out_tensor
from ..dispatch import expand_op, generic_expand, _propagate
from ..guards import partition_axes
from ..registry import register_rule

aten = torch.ops.aten


@register_rule(aten.addmm.default)
def _addmm(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    bias, m1, m2 = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    try:
        out = _propagate(b, op, args, kwargs)
    except Exception:
        return generic_expand(ctx, b, op, args, kwargs)
    if not partition_axes(args, kwargs, out) or beta != 1 or alpha != 1 or len(args) > 3:
        return generic_expand(ctx, b, op, args, kwargs)
    product = expand_op(ctx, b, aten.mm.default, (m1, m2), {})
    node = b._outputs[product.index]
    # "{1} @ {2}" is filled with the traced names of addmm's inputs when spliced
    left = m1.label or ("{%d}" % m1.index if m1.index is not None else "input 1")
    right = m2.label or ("{%d}" % m2.index if m2.index is not None else "input 2")
    product_arg = TensorArg(node, product.spec, label=f"{left} @ {right}")
    return expand_op(ctx, b, aten.add.Tensor, (product_arg, bias), {})


def _split(p: Any, dim: int) -> tuple | None:
    """How placement ``p`` splits tensor ``dim``: ("S",) / ("SS", sf), or None."""
    if isinstance(p, pt.StridedShard) and p.dim == dim:
        return ("SS", p.split_factor, pt.split_period(p))
    if isinstance(p, pt.Shard) and p.dim == dim:
        return ("S",)
    return None


@register_rule(aten.mm.default)
def _mm(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``a @ m`` with the contracted dim split alike as ``_StridedShard`` in both (a weight
    gradient over tokens flattened from ``(batch, seq)`` with the sequence split: context
    parallelism): each rank sums over the same tokens, so the product is ``Partial(sum)``
    there. DTensor has no such strategy and gathered both operands."""
    a, m = args[0], args[1]
    if kwargs or not isinstance(a, TensorArg) or not isinstance(m, TensorArg):
        return generic_expand(ctx, b, op, args, kwargs)
    contracted = [_split(p, 1) for p in a.spec.placements]
    if contracted != [_split(p, 0) for p in m.spec.placements] or not any(c and c[0] == "SS" for c in contracted):
        return generic_expand(ctx, b, op, args, kwargs)
    placements = []
    for pa, pm, c in zip(a.spec.placements, m.spec.placements, contracted):
        if c is not None:
            placements.append(pt.Partial())
        elif pa.is_replicate() and pm.is_replicate():
            placements.append(pt.Replicate())
        elif pm.is_replicate() and _split(pa, 0) is not None:
            placements.append(pa)
        elif pa.is_replicate() and _split(pm, 1) is not None:
            placements.append(pm)
        elif {type(pa), type(pm)} == {pt.Partial, pt.Replicate} and (pa.is_replicate() or pa.reduce_op == "sum") and (
                pm.is_replicate() or pm.reduce_op == "sum"):
            placements.append(pt.Partial())
        else:
            return generic_expand(ctx, b, op, args, kwargs)
    node = b.call(op, a.node, m.node)
    shape = (a.spec.shape[0], m.spec.shape[1])
    spec = pt.make_spec(ctx.mctx.mesh, placements, shape, (shape[1], 1), node.meta["val"].dtype)
    return _out_tensor(b, node, spec, {})
