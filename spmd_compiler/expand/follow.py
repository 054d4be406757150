"""Layout following: laying an op's other operands out like one of them, where
DTensor's strategy would gather instead.

Terms: ``target``'s layout *followed* by another tensor means each shard of ``target`` on
a dim that lines up with the other's (trailing dims, broadcast rules, equal size) shards
that dim too, every other mesh axis replicated (:func:`laid_out_like`). A *strided*
operand is one with a ``_StridedShard`` placement; a *dim split* (:func:`_dim_split`) is
how one placement splits one tensor dim. Exact for pointwise ops only.
"""

from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from .args import ExpandContext, NoStrategy, TensorArg, _global_leaf, _is_tensor_arg, _op_name, _out_tensor
from .builder import SubgraphBuilder
from .redistribute import emit_redistribute

__all__ = ["laid_out_like", "inplace_follow_self", "follow_strided"]


def laid_out_like(target: Any, spec: Any) -> Any:
    """``spec``'s tensor laid out like ``target``'s: each shard of ``target`` on a dim that
    lines up with one of ``spec``'s (trailing dims, broadcast rules, equal size) shards that
    dim; every other mesh axis is replicated."""
    t_shape, shape = list(target.shape), list(spec.shape)
    lead = len(t_shape) - len(shape)
    placements = []
    for p in target.placements:
        d = getattr(p, "dim", None)
        if d is not None and p.is_shard() and d - lead >= 0 and shape[d - lead] == t_shape[d]:
            placements.append(pt.Shard(d - lead))
        else:
            placements.append(pt.Replicate())
    return pt.DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def inplace_follow_self(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """An in-place pointwise op whose ``self`` must keep its placement.

    Every other tensor argument is laid out like ``self`` (broadcast dims replicated),
    which is exact for pointwise ops when ``self`` holds no Partial value. DTensor refuses
    such ops when the required redistribution of the others is uneven.
    """
    self_arg = args[0]
    if any(p.is_partial() for p in self_arg.spec.placements):
        raise NoStrategy(f"in-place {op} on a Partial value")
    counter = iter(range(1 << 30))

    def fix(x: Any) -> Any:
        if not isinstance(x, TensorArg):
            return x
        index = next(counter)
        if x is self_arg:
            return x
        dst = laid_out_like(self_arg.spec, x.spec)
        node, mask = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=f"input {index} of in-place {_op_name(op)} follows self", input_index=x.index, value_label=x.label)
        return x.moved(node, dst, mask)

    f_args, f_kwargs = pytree.tree_map(fix, (args, kwargs), is_leaf=_is_tensor_arg)
    l_args, l_kwargs = pytree.tree_map(lambda x: x.node if isinstance(x, TensorArg) else _global_leaf(x), (f_args, f_kwargs), is_leaf=_is_tensor_arg)
    node = b.call(op, *l_args, **l_kwargs)
    return _out_tensor(b, node, self_arg.spec, {})


def _dim_split(p: Any, dim: int) -> Any:
    """How ``p`` splits tensor ``dim``: None, or its kind and split factor."""
    if getattr(p, "dim", None) != dim or not (p.is_shard() or isinstance(p, pt.StridedShard)):
        return None
    return (type(p).__name__, int(getattr(p, "split_factor", 1)))


def follow_strided(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """Lay out the replicated operands of a pointwise op like its ``_StridedShard`` one.

    DTensor's pointwise strategy keeps a ``_StridedShard`` operand split only when the
    others match it (or broadcast); next to a Replicate operand of the same shape it
    gathers it (a head-split attention gradient added to the head-averaged weights'
    gradient). Taking this rank's elements of the replicated operand is a local slice.
    Only Replicate operands change, on axes where one operand is strided and no operand
    is Partial; a dim that broadcasts stays replicated.
    """
    tensors = [x for x in pytree.tree_leaves((args, kwargs), is_leaf=_is_tensor_arg) if isinstance(x, TensorArg)]
    strided = next((t for t in tensors if any(isinstance(p, pt.StridedShard) for p in t.spec.placements)), None)
    if strided is None or any(p.is_partial() for t in tensors for p in t.spec.placements):
        return args, kwargs
    shape = list(strided.spec.shape)
    counter = iter(range(1 << 30))

    def fix(x: Any) -> Any:
        if not isinstance(x, TensorArg):
            return x
        index = next(counter)
        lead = len(shape) - len(x.spec.shape)
        pl = list(x.spec.placements)
        for axis, p in enumerate(strided.spec.placements):
            d = p.dim - lead if isinstance(p, pt.StridedShard) else -1
            if d < 0 or not pl[axis].is_replicate() or x.spec.shape[d] != shape[p.dim]:
                continue
            # other axes must split this dim alike on both, or the layouts would differ
            if all(_dim_split(q, d) == _dim_split(r, p.dim) for j, (q, r) in enumerate(zip(pl, strided.spec.placements)) if j != axis):
                pl[axis] = pt.StridedShard(d, split_factor=p.split_factor)
        if pl == list(x.spec.placements):
            return x
        dst = pt.make_spec(x.spec.mesh, pl, x.spec.shape, x.spec.stride, x.spec.tensor_meta.dtype)
        why = f"input {index} of {_op_name(op)} follows its strided operand"
        node, mask = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=why, input_index=x.index, value_label=x.label)
        return x.moved(node, dst, mask)

    return pytree.tree_map(fix, (args, kwargs), is_leaf=_is_tensor_arg)
