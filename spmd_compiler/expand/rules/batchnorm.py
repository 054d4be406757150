"""BatchNorm in training on a batch-sharded input: global statistics from per-channel sums.

One device normalizes with the statistics of the whole batch. DTensor has no strategy for
``_native_batch_norm_legit`` on a batch-sharded input, so the fallback gathered the whole
activation to every rank (forward and backward). Here, as ``SyncBatchNorm`` does, each
rank sums its part per channel and the sums are all-reduced: the mean, then the centred
sum of squares (two passes, as the kernel computes the variance, so no cancellation in
float32), then the backward's two per-channel sums in one all_reduce. The results are the
global batch's statistics, with ``C`` numbers moved per collective instead of the activation.

Applies when the input is split over batch or spatial dims only (never channels) and the
running statistics are replicated; anything else goes to DTensor (and its fallback).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import OutTensor, SubgraphBuilder
from ..args import ExpandContext, TensorArg
from ..dispatch import expand_op, generic_expand
from ..fallback import replicate_axes
from ..registry import register_rule

aten = torch.ops.aten


def _arg(b: SubgraphBuilder, out: Any, label: str) -> TensorArg:
    return TensorArg(b._outputs[out.index], out.spec, label=label)


def _split_axes(x: TensorArg) -> set[int] | None:
    """Mesh axes over which ``x`` is split along a non-channel dim; None if the channel
    dim is split or ``x`` is partial/strided (not this rule's case)."""
    axes = set()
    for a, p in enumerate(x.spec.placements):
        if p.is_partial() or isinstance(p, pt.StridedShard) or (p.is_shard() and p.dim == 1):
            return None
        if p.is_shard():
            axes.add(a)
    return axes


def _replicated(x: Any) -> bool:
    return x is None or (isinstance(x, TensorArg) and all(p.is_replicate() for p in x.spec.placements))


class _Ops:
    """Shorthands emitting ops into the recipe through their own expansion."""

    def __init__(self, ctx: ExpandContext, b: SubgraphBuilder, x: TensorArg) -> None:
        self.ctx, self.b = ctx, b
        self.dims = [0, *range(2, len(x.spec.shape))]
        self.count = x.spec.shape[0] * math.prod(x.spec.shape[2:])  # elements per channel, globally
        self.channel_shape = [1, x.spec.shape[1], *[1] * (len(x.spec.shape) - 2)]

    def __call__(self, op: Any, *args: Any, label: str = "") -> TensorArg:
        return _arg(self.b, expand_op(self.ctx, self.b, op, args, {}), label or str(op))

    def channels(self, t: TensorArg) -> TensorArg:
        """A per-channel vector as (1, C, 1, ...) for broadcasting."""
        return self(aten.view.default, t, self.channel_shape)

    def global_sum(self, t: TensorArg, axes: set[int], why: str) -> TensorArg:
        """Sum over batch and spatial dims on every rank, all-reduced over ``axes``."""
        s = self(aten.sum.dim_IntList, t, self.dims)
        (total,), _ = replicate_axes(self.ctx, self.b, (s,), {}, axes, why)
        return total


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


@register_rule(aten._native_batch_norm_legit.default)
def _batch_norm(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    a = _bind(("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"), args, kwargs)
    x = a["input"]
    axes = _split_axes(x) if isinstance(x, TensorArg) else None
    stats_ok = all(_replicated(a[k]) for k in ("running_mean", "running_var"))
    if not a["training"] or not axes or not stats_ok:
        return generic_expand(ctx, b, op, args, kwargs)
    o = _Ops(ctx, b, x)
    n, m, eps = o.count, a["momentum"], a["eps"]
    (w, bias), _ = replicate_axes(ctx, b, (a["weight"], a["bias"]), {}, set(range(ctx.mctx.ndim)), "BatchNorm affine parameters")
    mean = o(aten.div.Tensor, o.global_sum(x, axes, "BatchNorm per-channel sum (global batch mean)"), n, label="batch mean")
    centred = o(aten.sub.Tensor, x, o.channels(mean))
    sq_sum = o.global_sum(o(aten.mul.Tensor, centred, centred), axes, "BatchNorm per-channel centred sum of squares (global variance)")
    rstd = o(aten.rsqrt.default, o(aten.add.Tensor, o(aten.div.Tensor, sq_sum, n), eps), label="batch rstd")
    out = o(aten.mul.Tensor, centred, o.channels(rstd))
    if w is not None:
        out = o(aten.mul.Tensor, out, o.channels(w))
    if bias is not None:
        out = o(aten.add.Tensor, out, o.channels(bias))
    # the running statistics, as the kernel updates them: m * batch + (1 - m) * running
    for key, batch_stat in (("running_mean", mean), ("running_var", o(aten.div.Tensor, sq_sum, max(n - 1, 1)))):
        running = a[key]
        if running is not None:
            new = o(aten.add.Tensor, o(aten.mul.Tensor, batch_stat, m), o(aten.mul.Tensor, running, 1 - m))
            o(aten.copy_.default, running, new)
    return tuple(OutTensor(b.slot(t.node), t.spec) for t in (out, mean, rstd))


@register_rule(aten.native_batch_norm_backward.default)
def _batch_norm_backward(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    names = ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean", "save_invstd", "train", "eps", "output_mask")
    a = _bind(names, args, kwargs)
    x, dy = a["input"], a["grad_out"]
    axes = _split_axes(x) if isinstance(x, TensorArg) else None
    same = isinstance(dy, TensorArg) and tuple(dy.spec.placements) == tuple(x.spec.placements)
    if not a["train"] or not axes or not same or not all(_replicated(a[k]) for k in ("save_mean", "save_invstd")):
        return generic_expand(ctx, b, op, args, kwargs)
    o = _Ops(ctx, b, x)
    n = o.count
    (w,), _ = replicate_axes(ctx, b, (a["weight"],), {}, set(range(ctx.mctx.ndim)), "BatchNorm weight")
    centred = o(aten.sub.Tensor, x, o.channels(a["save_mean"]))
    # both per-channel sums in one all_reduce: sum(dy) and sum(dy * (x - mean))
    local = o(aten.stack.default, [o(aten.sum.dim_IntList, dy, o.dims), o(aten.sum.dim_IntList, o(aten.mul.Tensor, dy, centred), o.dims)])
    (sums,), _ = replicate_axes(ctx, b, (local,), {}, axes, "BatchNorm backward per-channel sums (global batch)")
    sum_dy, dot = o(aten.select.int, sums, 0, 0), o(aten.select.int, sums, 0, 1)
    invstd = a["save_invstd"]
    mask = a["output_mask"]
    results: list[Any] = [None, None, None]
    if mask[0]:
        k = o(aten.div.Tensor, o(aten.mul.Tensor, o(aten.mul.Tensor, dot, invstd), invstd), n)
        scale = invstd if w is None else o(aten.mul.Tensor, invstd, w)
        dx = o(aten.sub.Tensor, o(aten.sub.Tensor, dy, o.channels(o(aten.div.Tensor, sum_dy, n))), o(aten.mul.Tensor, centred, o.channels(k)))
        results[0] = o(aten.mul.Tensor, dx, o.channels(scale), label="grad_input")
    if mask[1]:
        results[1] = o(aten.mul.Tensor, dot, invstd, label="grad_weight")
    if mask[2]:
        results[2] = o(aten.clone.default, sum_dy, label="grad_bias")
    return tuple(None if t is None else OutTensor(b.slot(t.node), t.spec) for t in results)
