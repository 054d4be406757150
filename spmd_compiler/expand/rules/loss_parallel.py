"""Loss parallel: log-softmax and the negative log-likelihood on logits split by class.

A vocab-parallel output layer (its weight ``Shard(0)`` over ``tp``, torchtitan's
``loss_parallel``, Megatron's vocab-parallel cross entropy) leaves the logits split along
the class dim. DTensor has no strategy for ``_log_softmax`` over a split dim, so it
gathered the logits (4 GiB of float32 per rank for Llama 3's 128256 classes at sequence
8192), and the backward then gathered weights too. Here nothing of that size moves:

* ``_log_softmax(x, dim)`` with ``dim`` split: each rank takes the max of its classes, an
  all_reduce(max) of one value per row, ``x - max``; the sum of ``exp`` of its classes, an
  all_reduce(sum) of one value per row; ``(x - max) - log(sum)`` stays split. These are
  the kernel's own steps, so the result equals one device's to rounding of the sum order.
* ``_log_softmax_backward_data(g, out, dim)`` with ``dim`` split: ``g - exp(out) * sum(g)``,
  the row sum an all_reduce of one value per row.
* ``nll_loss_forward`` / ``nll_loss_backward`` with the class dim split on one mesh axis:
  each rank picks the target's log-probability where it owns the target's class
  (``target - offset`` in ``[0, local classes)``, not ``ignore_index``) and the kernel runs
  on its own classes with every other target ignored: the loss is ``Partial(sum)`` on that
  axis, the input gradient split like the input, and the total weight (the count of kept
  targets, or their summed class weights) is computed from the whole target, so a mean
  divides by the global count (reduced with :mod:`.losses`' mean rule when the batch is
  split too). Class weights are narrowed to the rank's classes.

Label smoothing, ``reduction="sum"``/``"none"`` and Hugging Face's float32 upcast are the
same ops (``.float()`` and the smoothing term's sum over classes are local and Partial).

Terms: the *vocab axis* is the mesh axis splitting the class dim; *offset* is the first
class this rank holds there (``coord * chunk``, clamped for an uneven split).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _private_torch as pt
from ..args import RESULT, ExpandContext, TensorArg, _out_tensor
from ..builder import OutTensor, SubgraphBuilder
from ..dispatch import expand_op, generic_expand
from ..fallback import replicate_axes
from ..redistribute import emit_redistribute
from ..registry import register_rule
from ..values import DSymInt

__all__ = ["class_split_axes", "vocab_nll_loss_forward"]

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2


def class_split_axes(x: Any, dim: int) -> list[int]:
    """Mesh axes on which ``x`` (a TensorArg or a DTensorSpec) is ``Shard(dim)``."""
    spec = x.spec if isinstance(x, TensorArg) else x
    if not isinstance(spec, pt.DTensorSpec):
        return []
    dim = dim % max(1, len(spec.shape))
    return [a for a, p in enumerate(spec.placements) if type(p) is pt.Shard and p.dim == dim]


def _arg(b: SubgraphBuilder, out: OutTensor, label: str) -> TensorArg:
    return TensorArg(b._outputs[out.index], out.spec, label=label)


def _reduced(ctx: ExpandContext, b: SubgraphBuilder, out: OutTensor, label: str, axes: list[int]) -> TensorArg:
    (arg,), _ = replicate_axes(ctx, b, (_arg(b, out, label),), {}, set(axes), label)
    return arg


@register_rule(aten._log_softmax.default)
def _log_softmax(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    x, dim = args[0], args[1]
    half_to_float = args[2] if len(args) > 2 else kwargs.get("half_to_float", False)
    axes = class_split_axes(x, dim)
    if not axes or half_to_float or kwargs:
        return generic_expand(ctx, b, op, args, kwargs)
    dim = dim % len(x.spec.shape)
    top = expand_op(ctx, b, aten.amax.default, (x, [dim], True), {})
    top = _reduced(ctx, b, top, "row max of log_softmax over split classes", axes)
    shifted = _arg(b, expand_op(ctx, b, aten.sub.Tensor, (x, top), {}), "logits minus their row max")
    exps = _arg(b, expand_op(ctx, b, aten.exp.default, (shifted,), {}), "exp of the shifted logits")
    total = expand_op(ctx, b, aten.sum.dim_IntList, (exps, [dim], True), {})
    total = _reduced(ctx, b, total, "row sum of exp of log_softmax over split classes", axes)
    logs = _arg(b, expand_op(ctx, b, aten.log.default, (total,), {}), "log of the row sum")
    return expand_op(ctx, b, aten.sub.Tensor, (shifted, logs), {})


@register_rule(aten._log_softmax_backward_data.default)
def _log_softmax_backward(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    grad, out, dim, dtype = (list(args) + [kwargs.get(k) for k in ("grad_output", "output", "dim", "input_dtype")][len(args):])[:4]
    axes = sorted(set(class_split_axes(out, dim)) | set(class_split_axes(grad, dim)))
    if not axes or not isinstance(grad, TensorArg) or not isinstance(out, TensorArg) or grad.spec.tensor_meta.dtype != dtype:
        return generic_expand(ctx, b, op, args, kwargs)
    dim = dim % len(out.spec.shape)
    total = expand_op(ctx, b, aten.sum.dim_IntList, (grad, [dim], True), {})
    total = _reduced(ctx, b, total, "row sum of the log_softmax gradient over split classes", axes)
    probs = _arg(b, expand_op(ctx, b, aten.exp.default, (out,), {}), "softmax of the split classes")
    scaled = _arg(b, expand_op(ctx, b, aten.mul.Tensor, (probs, total), {}), "softmax times the row sum")
    return expand_op(ctx, b, aten.sub.Tensor, (grad, scaled), {})


def _layout(ctx: ExpandContext, x: TensorArg, target: TensorArg, axis: int) -> list[Any] | None:
    """Where the target must be for the rank-local kernel: whole on the vocab axis, split
    along its rows as the input's rows elsewhere; None when the input's layout on another
    axis is not one of its rows' (or whole)."""
    want = []
    for a, p in enumerate(x.spec.placements):
        if a == axis:
            want.append(pt.Replicate())
        elif p.is_replicate():
            want.append(pt.Replicate())
        elif isinstance(p, (pt.Shard, pt.StridedShard)) and p.dim == 0:
            want.append(p)
        else:
            return None
    return want


def _move(ctx: ExpandContext, b: SubgraphBuilder, x: TensorArg, placements: list[Any], why: str) -> TensorArg:
    dst = pt.make_spec(ctx.mctx.mesh, placements, x.spec.shape, x.spec.stride, x.spec.tensor_meta.dtype)
    node, mask = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=why, input_index=x.index, value_label=x.label)
    return x.moved(node, dst, mask)


def _local_targets(b: SubgraphBuilder, x: TensorArg, target: TensorArg, axis: int, ignore: int) -> Any:
    """This rank's class numbers of the targets it owns, -1 for every other target."""
    classes = x.spec.shape[1]
    b.local_chunk(classes, axis)  # marks the recipe per-rank when the split is uneven
    offset = b.shard_offset(classes, axis)
    held = x.local.shape[1]
    shifted = b.call(aten.sub.Tensor, target.node, offset)
    owned = b.call(aten.bitwise_and.Tensor, b.call(aten.ge.Scalar, shifted, 0), b.call(aten.lt.Scalar, shifted, held))
    owned = b.call(aten.bitwise_and.Tensor, owned, b.call(aten.ne.Scalar, target.node, ignore))
    return b.call(aten.where.ScalarOther, owned, shifted, -1)


def _total_weight(ctx: ExpandContext, b: SubgraphBuilder, target: TensorArg, weight: Any, ignore: int, dtype: torch.dtype) -> TensorArg:
    """The kernel's total weight of the whole target: the count of kept targets, or the sum
    of their class weights."""
    kept = _arg(b, expand_op(ctx, b, aten.ne.Scalar, (target, ignore), {}), "targets kept")
    if weight is None:
        return _arg(b, expand_op(ctx, b, aten.sum.default, (kept,), {"dtype": dtype}), "count of kept targets")
    dropped = _arg(b, expand_op(ctx, b, aten.eq.Scalar, (target, ignore), {}), "targets ignored")
    safe = _arg(b, expand_op(ctx, b, aten.masked_fill.Scalar, (target, dropped, 0), {}), "targets, ignored ones at class 0")
    per = _arg(b, expand_op(ctx, b, aten.index_select.default, (weight, 0, safe), {}), "class weight of each target")
    per = _arg(b, expand_op(ctx, b, aten.mul.Tensor, (per, kept), {}), "class weight of each kept target")
    return _arg(b, expand_op(ctx, b, aten.sum.default, (per,), {}), "summed class weights of kept targets")


def _prepare(ctx: ExpandContext, b: SubgraphBuilder, op: Any, x: Any, target: Any, weight: Any) -> tuple | None:
    """``(axis, target, weight)`` laid out for the rank-local kernel, or None (not ours)."""
    if not isinstance(x, TensorArg) or not isinstance(target, TensorArg) or len(x.spec.shape) != 2:
        return None
    axes = class_split_axes(x, 1)
    if len(axes) != 1 or any(isinstance(p, pt.Shard) and p.dim == 1 for a, p in enumerate(x.spec.placements) if a != axes[0]):
        return None
    if weight is not None and not isinstance(weight, TensorArg):
        return None
    axis = axes[0]
    want = _layout(ctx, x, target, axis)
    if want is None:
        return None
    target = _move(ctx, b, target, want, f"target of {op} (classes split over '{ctx.mctx.axis_names[axis]}')")
    if weight is not None:
        wl = [pt.Shard(0) if a == axis else pt.Replicate() for a in range(ctx.mctx.ndim)]
        weight = _move(ctx, b, weight, wl, f"class weight of {op} (narrowed to the rank's classes)")
    return axis, target, weight


def vocab_nll_loss_forward(ctx: ExpandContext, b: SubgraphBuilder, op: Any, x: Any, target: Any, weight: Any, reduction: int,
                           ignore: int) -> Any:
    """``nll_loss_forward`` with the class dim split on one mesh axis and reduction sum or
    none, or None (not ours). The loss is Partial(sum) on that axis; the total weight is
    the whole target's."""
    if reduction not in (SUM, NONE) or op is not aten.nll_loss_forward.default:
        return None
    prepared = _prepare(ctx, b, op, x, target, weight)
    if prepared is None:
        return None
    axis, target, whole_weight, weight = prepared[0], prepared[1], weight, prepared[2]
    local = _local_targets(b, x, target, axis, ignore)
    node = b.call(op, x.node, local, weight.node if weight is not None else None, reduction, -1)
    loss = b.getitems(node)[0]
    placements = []
    for a, p in enumerate(target.spec.placements):
        if a == axis or (reduction == SUM and not p.is_replicate()):
            placements.append(pt.Partial())
        else:
            placements.append(p)
    val = loss.meta["val"]
    shape = tuple(target.spec.shape) if reduction == NONE else ()
    stride = (1,) if reduction == NONE else ()
    spec = pt.make_spec(ctx.mctx.mesh, placements, shape, stride, val.dtype)
    total = _total_weight(ctx, b, target, whole_weight, ignore, x.spec.tensor_meta.dtype)
    return (_out_tensor(b, loss, spec, {}), OutTensor(b.slot(total.node), total.spec))


@register_rule(aten.nll_loss_backward.default)
def _nll_loss_backward(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    names = ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x, target, weight = bound["self"], bound["target"], bound.get("weight")
    grad, total = bound["grad_output"], bound["total_weight"]
    reduction, ignore = bound["reduction"], bound["ignore_index"]
    if not isinstance(grad, TensorArg) or not isinstance(total, TensorArg) or reduction not in (SUM, MEAN, NONE):
        return generic_expand(ctx, b, op, args, kwargs)
    prepared = _prepare(ctx, b, op, x, target, weight)
    if prepared is None:
        return generic_expand(ctx, b, op, args, kwargs)
    axis, target, weight = prepared
    # the seed: one value (sum, mean) or one per row laid out as the target's rows
    if reduction == NONE:
        grad = _move(ctx, b, grad, list(target.spec.placements), f"grad_output of {op} (as the target's rows)")
    else:
        grad = _move(ctx, b, grad, [pt.Replicate()] * ctx.mctx.ndim, f"grad_output of {op} (one value)")
    total = _move(ctx, b, total, [pt.Replicate()] * ctx.mctx.ndim, f"total_weight of {op}")
    local = _local_targets(b, x, target, axis, ignore)
    node = b.call(op, grad.node, x.node, local, weight.node if weight is not None else None, reduction, -1, total.node)
    return _out_tensor(b, node, x.spec, {})


@register_rule(aten.embedding_dense_backward.default)
def _embedding_backward(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """A vocab-parallel embedding's gradient, rows split like its weight: the gradient of
    the looked-up rows is reduced (one all_reduce of the activation's size where it is
    Partial) and each rank adds only the rows it owns; every other token (and the padding
    token) goes to one extra row that is dropped. DTensor computed the whole table's
    gradient on every rank and, where the incoming gradient was Partial, reduce-scattered
    the table (vocab x dim) instead."""
    names = ("grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    grad, indices = bound["grad_output"], bound["indices"]
    param = (ctx.grad_of or {}).get(RESULT)
    axes = class_split_axes(param, 0) if param is not None else []
    rows = bound["num_weights"]
    if (len(axes) != 1 or not isinstance(grad, TensorArg) or not isinstance(indices, TensorArg)
            or isinstance(rows, DSymInt) or tuple(param.shape) != (rows, grad.spec.shape[-1])):
        return generic_expand(ctx, b, op, args, kwargs)
    axis = axes[0]
    placements = []
    for a, (g, i) in enumerate(zip(grad.spec.placements, indices.spec.placements)):
        if a == axis:
            placements.append(pt.Shard(0))
        elif g.is_replicate() and i.is_replicate():
            placements.append(pt.Replicate())
        elif isinstance(g, (pt.Shard, pt.StridedShard)) and g == i and g.dim < len(indices.spec.shape):
            placements.append(pt.Partial())  # each rank's tokens: partial sums of the table
        elif g.is_partial() and not isinstance(g, pt.MaskPartial) and g.reduce_op == "sum" and i.is_replicate():
            placements.append(pt.Partial())
        else:
            return generic_expand(ctx, b, op, args, kwargs)
    gl = list(grad.spec.placements)
    gl[axis] = pt.Replicate()
    grad = _move(ctx, b, grad, gl, f"grad_output of {op} (the looked-up rows, for a vocab-parallel table)")
    il = list(indices.spec.placements)
    il[axis] = pt.Replicate()
    indices = _move(ctx, b, indices, il, f"indices of {op} (vocab-parallel table)")
    b.local_chunk(rows, axis)
    offset = b.shard_offset(rows, axis)
    held = param.shape[0] // ctx.mctx.shape[axis] if rows % ctx.mctx.shape[axis] == 0 else b.local_chunk(rows, axis)
    shifted = b.call(aten.sub.Tensor, indices.node, offset)
    owned = b.call(aten.bitwise_and.Tensor, b.call(aten.ge.Scalar, shifted, 0), b.call(aten.lt.Scalar, shifted, held))
    padding = bound.get("padding_idx", -1)
    if padding is not None and padding >= 0:
        owned = b.call(aten.bitwise_and.Tensor, owned, b.call(aten.ne.Scalar, indices.node, padding))
    local = b.call(aten.where.ScalarOther, owned, shifted, held)  # everything else: the extra row
    table = b.call(op, grad.node, local, held + 1, -1, bound.get("scale_grad_by_freq", False))
    node = b.call(aten.narrow.default, table, 0, 0, held)
    spec = pt.make_spec(ctx.mctx.mesh, placements, tuple(param.shape), (param.shape[1], 1), grad.spec.tensor_meta.dtype)
    return _out_tensor(b, node, spec, {})
