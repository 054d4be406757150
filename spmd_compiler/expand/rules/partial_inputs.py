"""Ops whose meaning on a ``Partial`` input differs from what a pointwise rule gives.

A ``Partial(sum)`` tensor is the sum of the ranks' local tensors. Two kinds of ops must
not simply keep that placement:

* ``*_like`` ops read only the shape and dtype of their input. ``ones_like`` of a
  Partial(sum) value kept Partial would sum to ``n`` on ``n`` ranks. The input is read
  as Replicate (no data moves: the local tensor has the global shape on those axes), so
  the result is a replicated fresh tensor.
* ``fill_`` writes a value into a tensor that stays Partial (an in-place op keeps its
  placement): each rank stores ``value / n`` over the sum-partial axes, so the sum is
  ``value``. (Seen in ``cosine_embedding_loss``: ``empty_like(x).fill_(1) - x``.)

``fill_.Tensor`` (a 0-dim tensor value, as ``ids[..., 0] = start_id`` traces in T5's
``_shift_right``) has no DTensor strategy: on a tensor that is not Partial, the value is
made Replicate (it is 0-dim: at most an all_reduce of a Partial scalar) and every rank
fills its own shard, which keeps its placement; before, the filled tensor (the batch)
was gathered to Replicate by the fallback.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ... import _private_torch as pt
from ...errors import UnsupportedPlacementError
from ..builder import SubgraphBuilder
from ..args import ExpandContext, TensorArg, _out_tensor
from ..dispatch import generic_expand
from ..redistribute import emit_redistribute
from ..registry import register_rule

aten = torch.ops.aten

_LIKE = [
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
]  # the random *_like ops: rules/random.py (a Partial input gives a replicated draw there too)


def _partial_axes(spec: Any) -> list[int]:
    return [a for a, p in enumerate(spec.placements) if p.is_partial()]


def _as_replicate(spec: Any) -> Any:
    placements = [pt.Replicate() if p.is_partial() else p for p in spec.placements]
    meta = spec.tensor_meta
    return pt.make_spec(spec.mesh, placements, meta.shape, meta.stride, meta.dtype)


@register_rule(*_LIKE)
def _like(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    if isinstance(x, TensorArg) and _partial_axes(x.spec):
        args = (dataclasses.replace(x, spec=_as_replicate(x.spec)), *args[1:])
    return generic_expand(ctx, b, op, args, kwargs)


@register_rule(aten.fill_.Scalar, aten.fill.Scalar, aten.fill_.Tensor, aten.fill.Tensor)
def _fill(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    x, value = args[0], args[1]
    axes = _partial_axes(x.spec) if isinstance(x, TensorArg) else []
    if not axes and isinstance(value, TensorArg) and isinstance(x, TensorArg):
        return _fill_local(ctx, b, op, x, value)
    if not axes:
        return generic_expand(ctx, b, op, args, kwargs)
    ops = {x.spec.placements[a].reduce_op for a in axes}
    if ops <= {"avg", "max", "min"}:
        return generic_expand(ctx, b, op, args, kwargs)
    if ops != {"sum"} or isinstance(x.spec.placements[axes[0]], (pt.MaskPartial, pt.NormPartial)) or not isinstance(value, (int, float)):
        raise UnsupportedPlacementError(
            f"{op} on a value placed {[str(p) for p in x.spec.placements]} at node {ctx.node.name}: a fill of a "
            f"partial value is supported for Partial(sum/avg/max/min) with a Python number only. fix: give the "
            f"filled tensor a Replicate placement (e.g. build it with torch.full instead of empty_like(x).fill_)",
            ctx.node,
        )
    n = 1
    for a in axes:
        n *= ctx.mctx.shape[a]
    return generic_expand(ctx, b, op, (x, value / n, *args[2:]), kwargs)


def _fill_local(ctx: ExpandContext, b: SubgraphBuilder, op: Any, x: TensorArg, value: TensorArg) -> Any:
    """``fill(x, value)`` with a 0-dim tensor ``value`` on a non-Partial ``x``: the value
    replicated, each rank fills its local ``x``, which keeps its placement."""
    replicate = pt.make_spec(value.spec.mesh, [pt.Replicate()] * ctx.mctx.ndim, *_meta(value.spec))
    local, _ = emit_redistribute(b, value.node, value.spec, replicate, mask=value.mask, reason=f"value of {op}")
    node = b.call(op, x.node, local)
    return _out_tensor(b, node, x.spec, {})


def _meta(spec: Any) -> tuple:
    meta = spec.tensor_meta
    return meta.shape, meta.stride, meta.dtype
