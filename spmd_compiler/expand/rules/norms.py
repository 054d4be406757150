"""Norms of a value with a pending sum: reduce the sum, keep the shards.

Under 2-D data x tensor parallelism, ``clip_grad_norm_`` reads each gradient of a
tensor-parallel weight while it is ``Partial(sum)`` on the data axis (its reduction is
still pending) and ``Shard`` on the tensor axis. DTensor's norm strategy
(``common_reduction_strategy``) sees a Partial whose reduce op is not the norm's and
clears every pending sum *and every shard on the reduced dims*: the gradient is
all-gathered whole on the tensor axis, a parameter's worth of bytes per gradient where
a number per gradient is enough. The norm needs only the sum: this rule all-reduces the
Partial axes (``Partial -> Replicate``, the gradient's own reduction, which later readers
such as the optimizer reuse), keeps every Shard, and hands the rest to DTensor, which then
takes each rank's norm of its shard (``Partial(norm)``, combined by one small reduction).

Under FSDP the parameter is sharded on the data axis, and its gradient must end up there
too: all-reducing it whole and slicing it afterwards moves twice the bytes of a
reduce_scatter. When the input is a parameter's gradient (the trace tags it:
:mod:`spmd_compiler.trace.grad_links`, handed over as ``ctx.grad_of``), its pending sums
are reduced straight to the parameter's layout (``Partial -> Shard`` on an FSDP axis, a
reduce_scatter; ``Replicate`` where the parameter is replicated, as before), provided its
other axes already match the parameter; the norm is then taken shard-wise.

``clip_grad_value_`` clamps each gradient in place (``clamp_``, or ``_foreach_clamp_min_``
and ``_foreach_clamp_max_`` on GPU) while its sum is still pending. DTensor has no
in-place strategy for a Partial input and the replicate fallback all-reduced the whole
gradient; a clamp needs the sum only, so the same reduction applies: to the
parameter's layout (a reduce_scatter under FSDP), then a clamp of each rank's shard.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _private_torch as pt
from ..args import ExpandContext, TensorArg
from ..builder import OutTensor, SubgraphBuilder
from ..dispatch import _reduces_partial, generic_expand
from ..follow import laid_out_like
from ..redistribute import emit_redistribute
from ..registry import register_rule

aten = torch.ops.aten

__all__: list[str] = []

_NORMS = [aten.linalg_vector_norm.default, aten._foreach_norm.Scalar]


def _sums_reduced(ctx: ExpandContext, b: SubgraphBuilder, x: Any, name: str) -> Any:
    """``x`` with its Partial(sum/avg) axes reduced, its shards kept: to its parameter's
    layout when ``x`` is a gradient whose other axes match it, else to Replicate."""
    if not isinstance(x, TensorArg):
        return x
    placements = x.spec.placements
    if not any(p.is_partial() and p.reduce_op in ("sum", "avg") and not isinstance(p, (pt.NormPartial, pt.MaskPartial))
               for p in placements):
        return x
    kept = [pt.Replicate() if p.is_partial() else p for p in placements]
    reason = f"input of {name}: the pending sum only (shards kept)"
    param = (ctx.grad_of or {}).get(x.index)
    if param is not None and x.mask is None:
        like = laid_out_like(param, x.spec).placements
        if all(p.is_partial() or p == q for p, q in zip(placements, like)):
            kept = list(like)
            reason = f"input of {name}: the gradient's pending sum, reduced to its parameter's layout"
    meta = x.spec.tensor_meta
    dst = pt.make_spec(x.spec.mesh, kept, meta.shape, meta.stride, meta.dtype)
    node, mask = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=reason,
                                   input_index=x.index, value_label=x.label)
    if node is not x.node and x.index is not None and _reduces_partial(x.spec, dst):
        b.replacements[x.index] = OutTensor(b.slot(node), dst, b.slot(mask) if mask is not None else None)  # later readers take the reduced value
    return x.moved(node, dst, mask)


_CLAMPS = [aten.clamp_.default, aten.clamp_min_.default, aten.clamp_max_.default,
           aten._foreach_clamp_min_.Scalar, aten._foreach_clamp_max_.Scalar]


@register_rule(*_NORMS, *_CLAMPS)
def _sums_first(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """A norm, or an in-place clamp (``clip_grad_value_``), of values with a pending sum:
    the sum reduced first (to the parameter's layout for a gradient), then DTensor's
    strategy on each rank's part."""
    name = str(op).replace("aten.", "")
    first = args[0]
    if isinstance(first, (list, tuple)):
        first = type(first)(_sums_reduced(ctx, b, x, name) for x in first)
    else:
        first = _sums_reduced(ctx, b, first, name)
    return generic_expand(ctx, b, op, (first, *args[1:]), kwargs)


def _norm_partial_axes(x: Any) -> dict[int, Any]:
    return {a: p for a, p in enumerate(x.spec.placements) if isinstance(p, pt.NormPartial)} if isinstance(x, TensorArg) else {}


@register_rule(aten.stack.default)
def _stack(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``clip_grad_norm_`` stacks the per-gradient norms. Under 2-D each is ``Partial(norm)``
    on the axes its gradient is sharded on and replicated on the others; a replicated norm
    is a valid ``Partial(norm)`` share once scaled (``x / n**(1/p)``, local), so every norm
    is lifted to the axes any of them is pending on: one reduction of the stack instead of
    one per norm and axis."""
    tensors = args[0]
    pending = [_norm_partial_axes(x) for x in tensors]
    lift: dict[int, Any] = {}
    for d in pending:
        for a, p in d.items():
            lift.setdefault(a, p)
    ok = (
        lift and all(isinstance(x, TensorArg) and x.mask is None for x in tensors)
        and all(p == lift[a] for d in pending for a, p in d.items())  # one norm type per axis
        and all(x.spec.placements[a].is_replicate() or a in d for x, d in zip(tensors, pending) for a in lift)
        and all(not p.is_partial() or a in lift for x in tensors for a, p in enumerate(x.spec.placements))
        and all(getattr(p, "norm_type", 0) not in (0, 0.0) for p in lift.values())
    )
    if not ok:
        return generic_expand(ctx, b, op, args, kwargs)
    lifted = []
    for x in tensors:
        placements = [lift[a] if a in lift else p for a, p in enumerate(x.spec.placements)]
        if list(placements) == list(x.spec.placements):
            lifted.append(x)
            continue
        meta = x.spec.tensor_meta
        dst = pt.make_spec(x.spec.mesh, placements, meta.shape, meta.stride, meta.dtype)
        node, mask = emit_redistribute(b, x.node, x.spec, dst, mask=None, reason="a replicated norm as a share of a pending norm",
                                       input_index=x.index, value_label=x.label)
        lifted.append(x.moved(node, dst, mask))
    return generic_expand(ctx, b, op, (type(tensors)(lifted), *args[1:]), kwargs)
