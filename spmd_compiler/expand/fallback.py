"""Fallbacks: running an op (or preparing its inputs) on replicated values.

Terms: to *replicate* a tensor on a mesh axis is to redistribute it to Replicate there
(an all-gather for a Shard, an all-reduce for a Partial). :func:`replicate_fallback` is
the way out for ops DTensor has no strategy for: gather every input to Replicate and run
the op unsharded; its results are *replicated results* laid out like the traced values.
:func:`replicate_axes` and :func:`reduce_partial_axes` are the partial remedies the
guards of :mod:`.guards` ask for before the op is retried.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from .args import ExpandContext, TensorArg, _global_leaf, _is_tensor_arg, _op_name, _out_tensor
from .builder import OutTensor, SubgraphBuilder
from .layout import restride_like
from .redistribute import emit_redistribute

__all__ = ["replicate_fallback", "replicate_axes", "reduce_partial_axes"]


def replicate_fallback(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict, why: str = "") -> Any:
    """Gather every tensor input to Replicate and run ``op`` on whole tensors."""
    flat, tree = pytree.tree_flatten((args, kwargs), is_leaf=_is_tensor_arg)
    leaves = []
    i = 0
    for x in flat:
        if isinstance(x, TensorArg):
            dst = pt.make_spec(ctx.mctx.mesh, [pt.Replicate()] * ctx.mctx.ndim, x.spec.shape, x.spec.stride, x.spec.tensor_meta.dtype)
            reason = f"input {i} of {_op_name(op)} (replicate fallback{': ' + why if why else ''})"
            node, _ = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=reason, input_index=x.index, value_label=x.label)
            # a gathered value is contiguous; the op may pass its layout on (see .layout).
            # Only gathered copies: a value used as is may be one the op writes in place
            leaves.append(restride_like(b, node, x.spec.shape, x.spec.stride) if node is not x.node else node)
            i += 1
        else:
            leaves.append(_global_leaf(x))
    l_args, l_kwargs = pytree.tree_unflatten(leaves, tree)
    result = b.call(op, *l_args, **l_kwargs)
    result.meta["spmd_fallback"] = why or "no sharding strategy"
    # results that alias an input (views, in-place ops) keep their layout: a copy would cut the alias
    aliases = pt.is_view_op(op) or bool(pt.written_args(op))
    traced = ctx.node.meta.get("val") if ctx.node is not None and ctx.node.target is op and not aliases else None
    return _replicated_result(ctx, b, result, traced)


def _replicated_result(ctx: ExpandContext, b: SubgraphBuilder, node: fx.Node, traced: Any = None) -> Any:
    """The result of an op run on whole tensors, each tensor laid out as ``traced`` (the
    traced node's value, when known) was, so later ops see the traced layouts."""

    def out(n: fx.Node, t: Any) -> OutTensor:
        if isinstance(t, torch.Tensor) and _same_shape(t.shape, n.meta["val"].shape):
            n = restride_like(b, n, t.shape, t.stride())
        v = n.meta["val"]
        return _out_tensor(b, n, pt.make_spec(ctx.mctx.mesh, [pt.Replicate()] * ctx.mctx.ndim, v.shape, v.stride(), v.dtype), {})

    val = node.meta["val"]
    if isinstance(val, torch.Tensor):
        return out(node, traced)
    if isinstance(val, (tuple, list)):
        res = []
        traced_items = list(traced) if isinstance(traced, (tuple, list)) and len(traced) == len(val) else [None] * len(val)
        for item, t in zip(b.getitems(node), traced_items):
            v = item.meta["val"]
            res.append(out(item, t) if isinstance(v, torch.Tensor) else v)
        return type(val)(res) if isinstance(val, tuple) else res
    return val


def _same_shape(a: Any, b: Any) -> bool:
    """Whether two shapes are the same, without a guard on symbolic sizes: comparing a
    size's example value with a SymInt (``10 == 2*s3``) records ``Eq(2*s3, 10)``, which
    pins the batch size (dynamic=True); the sizes must be the same expressions."""
    if len(a) != len(b):
        return False
    def same(x: Any, y: Any) -> bool:
        if pt.is_symbolic(x) and pt.is_symbolic(y):
            return bool(pt.sym_expr(x) == pt.sym_expr(y))
        return not pt.is_symbolic(x) and not pt.is_symbolic(y) and int(x) == int(y)

    return all(same(x, y) for x, y in zip(a, b))


def replicate_axes(ctx: ExpandContext, b: SubgraphBuilder, args: Any, kwargs: Any, axes: set[int], why: str) -> tuple[Any, Any]:
    """Return args/kwargs with every tensor redistributed to Replicate on ``axes``."""

    def fix(x: Any) -> Any:
        if not isinstance(x, TensorArg):
            return x
        pl = [pt.Replicate() if i in axes else p for i, p in enumerate(x.spec.placements)]
        if tuple(pl) == tuple(x.spec.placements):
            return x
        dst = pt.DTensorSpec(x.spec.mesh, tuple(pl), tensor_meta=x.spec.tensor_meta)
        node, mask = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=why, input_index=x.index, value_label=x.label)
        return x.moved(node, dst, mask)

    return pytree.tree_map(fix, (args, kwargs), is_leaf=_is_tensor_arg)


def reduce_partial_axes(ctx: ExpandContext, b: SubgraphBuilder, args: Any, kwargs: Any, axes: set[int], why: str) -> tuple[Any, Any]:
    """Return args/kwargs with every Partial tensor reduced to Replicate on ``axes``."""

    def fix(x: Any) -> Any:
        if not isinstance(x, TensorArg):
            return x
        pl = [pt.Replicate() if (i in axes and p.is_partial()) else p for i, p in enumerate(x.spec.placements)]
        if tuple(pl) == tuple(x.spec.placements):
            return x
        dst = pt.DTensorSpec(x.spec.mesh, tuple(pl), tensor_meta=x.spec.tensor_meta)
        node, mask = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=why, input_index=x.index, value_label=x.label)
        return x.moved(node, dst, mask)  # a MaskPartial left on another axis keeps its mask

    return pytree.tree_map(fix, (args, kwargs), is_leaf=_is_tensor_arg)
