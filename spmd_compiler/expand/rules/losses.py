"""Losses whose DTensor rule is wrong on sharded targets.

``nll_loss_forward`` (cross-entropy's loss op) with ``reduction="mean"`` and a sharded
target: DTensor's rule returns each rank's own mean as ``Partial(avg)``. The average of
per-rank means is the global mean only when every rank counts the same number of
targets; with ``ignore_index`` (padding) spread unevenly it is wrong, and a rank whose
targets are all ignored contributes 0/0 = NaN. Gradients were right all along (the
backward divides by the all-reduced count), only the loss value was not.

Here the per-rank *sums* and target counts are computed (both ``Partial(sum)``), the
count is all-reduced, and the loss is ``local sum / global count``: a ``Partial(sum)``
whose shares add up to the exact mean. The count is returned replicated, so the
backward (which reads it) needs no collective of its own. Without class weights the
count is ``(target != ignore_index).sum()``, read from the target alone and marked as
input preparation of its all_reduce, so :mod:`spmd_compiler.optimize.overlap` issues
that all_reduce at the start of the step instead of between forward and backward.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import OutTensor, SubgraphBuilder
from ..args import ExpandContext, TensorArg
from ..dispatch import expand_op, generic_expand
from ..fallback import replicate_axes
from ..registry import register_rule
from .loss_parallel import class_split_axes, vocab_nll_loss_forward

aten = torch.ops.aten

MEAN, SUM = 1, 2


def _arg(b: SubgraphBuilder, out: OutTensor, label: str) -> TensorArg:
    return TensorArg(b._outputs[out.index], out.spec, label=label)


@register_rule(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss_forward(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    names = ("self", "target", "weight", "reduction", "ignore_index")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x, target = bound["self"], bound["target"]
    weight, ignore = bound.get("weight"), bound.get("ignore_index", -100)
    classes_split = op is aten.nll_loss_forward.default and bool(class_split_axes(x, 1)) and len(x.spec.shape) == 2
    if classes_split and bound.get("reduction") != MEAN:  # loss parallel (.loss_parallel)
        out = vocab_nll_loss_forward(ctx, b, op, x, target, weight, bound.get("reduction"), ignore)
        if out is not None:
            return out
    sharded = isinstance(target, TensorArg) and any(isinstance(p, (pt.Shard, pt.StridedShard)) for p in target.spec.placements)
    if bound.get("reduction") != MEAN or not (sharded or classes_split):
        return generic_expand(ctx, b, op, args, kwargs)
    summed = expand_op(ctx, b, op, (x, target, weight, SUM, ignore), {})
    loss_sum = _arg(b, summed[0], "per-rank sum of the loss")
    count = _arg(b, summed[1], "per-rank target count")
    if weight is None:
        # the count depends on the target alone: computed from it, its all_reduce can be
        # issued at the start of the step and overlap the whole forward
        kept = expand_op(ctx, b, aten.ne.Scalar, (target, ignore), {})
        total = expand_op(ctx, b, aten.sum.default, (_arg(b, kept, "targets kept"),), {"dtype": x.spec.tensor_meta.dtype})
        for out in (kept, total):
            b._outputs[out.index].meta["spmd_prep"] = "target count: moves with its all_reduce"
        count = _arg(b, total, "per-rank target count")
    axes = {a for a, p in enumerate(count.spec.placements) if p.is_partial()}
    (count_all,), _ = replicate_axes(ctx, b, (count,), {}, axes, "target count of a mean loss (all ranks' targets)")
    loss = expand_op(ctx, b, aten.div.Tensor, (loss_sum, count_all), {})
    total = OutTensor(b.slot(count_all.node), count_all.spec)
    return (loss, total)
