"""Matrix products whose fused form hides a better plan.

``addmm(bias, x, w)`` after a row-parallel split (``x`` and ``w`` sharded on the
contracted dim) has a Partial product. DTensor keeps the result Partial by splitting the
replicated bias into ``bias / n`` pieces; every later op then carries the Partial value
(and its inexact division) until something non-linear forces the reduction, often in
the backward too. We split it as Megatron does: ``mm`` (Partial), reduce, add the bias.
"""

from __future__ import annotations

from typing import Any

import torch

from ..builder import SubgraphBuilder
from ..args import ExpandContext, TensorArg
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
