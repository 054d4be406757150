"""Reading a number out of a tensor (``.item()``) and ops that copy without a strategy.

``aten._local_scalar_dense`` (what ``.item()`` traces to) needs the whole value on every
rank: its input is redistributed to Replicate and every rank reads the same number. The
result is a run-time scalar (:class:`~spmd_compiler.expand.values.RScalar`) that later
ops take as an argument, as Adam's bias correction does with its ``step`` tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import OutScalar, SubgraphBuilder
from ..args import ExpandContext, _out_tensor
from ..redistribute import emit_redistribute
from ..registry import register_rule

aten = torch.ops.aten


def _replicated(ctx: ExpandContext, x: Any) -> Any:
    return pt.DTensorSpec(x.spec.mesh, (pt.Replicate(),) * ctx.mctx.ndim, tensor_meta=x.spec.tensor_meta)


@register_rule(aten._local_scalar_dense.default)
def _item(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    local, _ = emit_redistribute(b, x.node, x.spec, _replicated(ctx, x), mask=x.mask, reason="input of .item()")
    dtype = x.spec.tensor_meta.dtype
    hint = 1.0 if dtype.is_floating_point else (True if dtype == torch.bool else 1)
    node = b.call(op, local, _val=hint)
    return OutScalar(b.slot(node), hint)


@register_rule(aten.lift_fresh_copy.default, aten.lift_fresh.default)
def _lift(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """A lifted constant is copied as is; it keeps its placement."""
    x = args[0]
    node = b.call(op, x.node)
    return _out_tensor(b, node, x.spec, {})
