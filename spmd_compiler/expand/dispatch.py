"""Expanding one aten op through DTensor's sharding propagation.

For a traced op with distributed inputs, :func:`generic_expand` asks DTensor which input
placements the op needs and which output placement results, emits the redistributions
(:mod:`.redistribute`) and the local op into the recipe builder, and returns the result
with its DTensorSpec. :func:`expand_op` picks the op's rule (:mod:`.registry`) or
:func:`generic_expand`, and answers the guards' signals (:mod:`.guards`) with a retry on
adjusted inputs or :func:`~.fallback.replicate_fallback`, the way out for ops DTensor has
no strategy for.

Terms: *propagation* is DTensor's per-op strategy choice (``pt.propagate_sharding``); the
*activation sharding* filter (:func:`follow_inputs`) is the plan's rule for choosing among
its strategies. The argument types live in :mod:`.args`, the layout-following helpers in
:mod:`.follow`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..errors import UnsupportedOpError
from .args import (
    ExpandContext, NoStrategy, ScalarArg, TensorArg, _global_leaf, _input_specs, _is_sharded, _is_tensor_arg,
    _op_name, _out_tensor, _schema_leaf, input_placements_text,
)
from .builder import OutTensor, SubgraphBuilder
from .fallback import reduce_partial_axes, replicate_axes, replicate_fallback
from .follow import follow_strided, inplace_follow_self
from .guards import (
    _AvoidPartition, _UnevenAvg, _dst_specs, _guard_empty_shards, _guard_head_tail, _guard_partition, _guard_rounding_cast,
    _guard_uneven_avg, _guard_view_sizes,
)
from .redistribute import emit_redistribute, logical_shape
from . import orders
from .registry import get_rule
from .values import placements_text

aten = torch.ops.aten

__all__ = [
    "expand_op", "TensorArg", "ScalarArg", "ExpandContext", "generic_expand", "replicate_fallback", "NoStrategy",
    "wrap_result", "follow_inputs", "ACTIVATION_SHARDING", "dtensor_keeps_inputs",
]


def _uneven_axes(b: SubgraphBuilder, spec: Any) -> set[int]:
    """Mesh axes over which ``spec`` splits a dim unevenly (or may: a symbolic size
    counts as uneven, without the guard ``size % n`` would record and that would make
    one program serve even sizes only)."""
    out = set()
    for axis, p in enumerate(spec.placements):
        if isinstance(p, pt.Shard):
            size = logical_shape(b, tuple(spec.shape), list(spec.placements), axis)[p.dim]
            if pt.is_symbolic(size) or size % b.mctx.shape[axis]:  # a symbolic size may be uneven (no guard)
                out.add(axis)
    return out


def _placement_choice(out: Any) -> Any:
    """What a strategy decided, without sizes: output and required input placements."""
    specs = out.output_spec if isinstance(out.output_spec, (tuple, list)) else [out.output_spec]
    choice = [tuple(s.placements) if isinstance(s, pt.DTensorSpec) else None for s in specs]
    if out.redistribute_schema is not None:
        leaves = pytree.tree_leaves((tuple(out.redistribute_schema.args_schema), dict(out.redistribute_schema.kwargs_schema)))
        choice += [tuple(s.placements) for s in leaves if isinstance(s, pt.DTensorSpec)]
    return choice


def follow_inputs(c: pt.StrategyCandidate) -> bool:
    """Keep strategies whose outputs are sharded on a mesh axis only where some input
    already is: new shards come from the plan, never from an op's local cost.

    DTensor picks each op's cheapest strategy on its own. In a 2-D backward that means
    splitting a gradient that is Partial on ``tp`` with a reduce_scatter (cheaper than
    the all_reduce Megatron does), after which every later op gathers weights and
    activations to match: 5x the bytes of the plan. Following the inputs gives the
    hand-written program. Where DTensor offers nothing else, its choice stands.
    """
    ndim = len(c.inputs_now[0]) if c.inputs_now else 0
    for axis in range(ndim):
        if any(out is not None and _is_sharded(out[axis]) for out in c.outputs):
            if not any(_is_sharded(now[axis]) for now in c.inputs_now):
                return False
    return True


_STRATEGY_FILTERS = {"follow": follow_inputs, "greedy": None}
ACTIVATION_SHARDING = tuple(_STRATEGY_FILTERS)


def _propagate(b: SubgraphBuilder, op: Any, args: Any, kwargs: Any, activation_sharding: str = "follow") -> Any:
    """DTensor's strategy for this op, chosen the same way on every rank.

    DTensor's cost model reads this rank's local shard sizes, so with uneven shards two
    ranks could pick different strategies (and issue different collectives). The choice
    is made for coordinate 0; only when the strategy localizes size arguments (view ops)
    is it recomputed for this rank's coordinate, and it must pick the same placements.
    """
    s_args, s_kwargs = pytree.tree_map(_schema_leaf, (args, kwargs), is_leaf=_is_tensor_arg)
    canonical = (0,) * b.mctx.ndim
    keep = _STRATEGY_FILTERS[activation_sharding]
    try:
        out = pt.propagate_sharding(op, tuple(s_args), dict(s_kwargs), coordinate=canonical, keep=keep)
        if out.use_val_from_redistribute_schema and tuple(b.mctx.coordinate) != canonical:
            mine = pt.propagate_sharding(op, tuple(s_args), dict(s_kwargs), coordinate=b.mctx.coordinate, keep=keep)
            if _placement_choice(mine) != _placement_choice(out):
                raise RuntimeError(f"DTensor chose different placements on rank {b.mctx.coordinate} than on rank {canonical}")
            out = mine
        return out
    except Exception as e:  # DTensor signals "cannot shard this" with several exception types
        raise NoStrategy(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def dtensor_keeps_inputs(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> bool:
    """True when DTensor has a strategy for the op that runs on every tensor input as it
    is laid out (no redistribution); a rule asks before doing better than a gather."""
    try:
        out = _propagate(b, op, args, kwargs, ctx.activation_sharding)
    except NoStrategy:
        return False
    dsts = _dst_specs(out, len(_input_specs(args, kwargs)))
    if dsts is None:
        return not (out.needs_redistribute and out.redistribute_schema is not None)
    return all(tuple(s.placements) == tuple(d.placements) for s, d in zip(_input_specs(args, kwargs), dsts))


def generic_expand(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """Expand ``op(*args, **kwargs)`` with DTensor's strategy; returns the result pytree."""
    out = _propagate(b, op, args, kwargs, ctx.activation_sharding)
    _guard_view_sizes(b, op, args, kwargs, out)
    _check_symbolic_localized(b, op, out)
    _guard_empty_shards(b, op, args, kwargs, out)
    _guard_partition(args, kwargs, out, op)
    _guard_rounding_cast(op, args, kwargs, out)
    _guard_head_tail(b, op, out)
    if out.use_val_from_redistribute_schema and any(
        _uneven_axes(b, t.spec) for t in pytree.tree_leaves((args, kwargs), is_leaf=_is_tensor_arg) if isinstance(t, TensorArg)
    ):
        b.coord_dependent = True  # DTensor localized size arguments for this rank
    out = _guard_uneven_avg(b, op, args, kwargs, out)
    flat, tree = pytree.tree_flatten((args, kwargs), is_leaf=_is_tensor_arg)
    tensors = [x for x in flat if isinstance(x, TensorArg)]
    target_op = op
    if out.needs_redistribute and out.redistribute_schema is not None:
        rs = out.redistribute_schema
        rs_flat, rs_tree = pytree.tree_flatten((tuple(rs.args_schema), dict(rs.kwargs_schema)))
        dst_specs = [x for x in rs_flat if isinstance(x, pt.DTensorSpec)]
        if len(dst_specs) != len(tensors):
            raise UnsupportedOpError(op, input_placements_text(args, kwargs), ctx.node, "DTensor rewrote the op's tensor arguments")
        target_op = rs.op
    else:
        dst_specs = [t.spec for t in tensors]
        rs_flat = rs_tree = None
    locals_: list[fx.Node] = []
    masks_by_buffer: dict[int, fx.Node] = {}
    mutated = pt.writes_first_arg(op)
    for i, (t, dst) in enumerate(zip(tensors, dst_specs)):
        reason = f"input {i} of {_op_name(op)}"  # i counts this op's tensor arguments
        node, mask = emit_redistribute(b, t.node, t.spec, dst, mask=t.mask, reason=reason, input_index=t.index, value_label=t.label)
        locals_.append(node)
        # a rank's own counts (a restricted Partial, expand/orders.py) stay for their other
        # users: offsets of the rank's own rows need them unreduced
        if _reduces_partial(t.spec, dst) and not (mutated and i == 0) and t.index is not None and not orders.restricted_axes(t):
            b.replacements[t.index] = OutTensor(b.slot(node), dst, b.slot(mask) if mask is not None else None)
        if mask is not None:
            for p in dst.placements:
                if isinstance(p, pt.MaskPartial):
                    masks_by_buffer[id(p.mask_buffer)] = mask
    it = iter(locals_)
    if rs_flat is not None and out.use_val_from_redistribute_schema:
        leaves = [next(it) if isinstance(x, pt.DTensorSpec) else x for x in rs_flat]
        if len(leaves) == len(flat):  # keep run-time scalars as graph values
            leaves = [f.node if isinstance(f, ScalarArg) else l for f, l in zip(flat, leaves)]
        l_args, l_kwargs = pytree.tree_unflatten(leaves, rs_tree)
        l_args = _symbolic_local_sizes(b, op, l_args, out)
    else:
        leaves = [next(it) if isinstance(x, TensorArg) else _global_leaf(x) for x in flat]
        l_args, l_kwargs = pytree.tree_unflatten(leaves, tree)
    result = b.call(target_op, *l_args, **l_kwargs)
    _write_back(b, op, args, kwargs, tensors, locals_, dst_specs)
    return wrap_result(b, result, out.output_spec, masks_by_buffer, ctx, op)


# ops whose argument 1 is the result's shape: the local sizes are the result's local shape
_SHAPE_ARG_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default}


def _check_symbolic_localized(b: SubgraphBuilder, op: Any, out: Any) -> None:
    """Before anything is emitted: refuse (gather instead) an op whose size arguments
    DTensor localized and :func:`_symbolic_local_sizes` cannot recompute."""
    rs = out.redistribute_schema
    if b.sizes is None or not out.use_val_from_redistribute_schema or rs is None:
        return
    leaves = pytree.tree_leaves((tuple(rs.args_schema), dict(rs.kwargs_schema)))
    if not any(isinstance(s, torch.SymInt) and pt.is_symbolic(s) for s in leaves):
        return
    spec = out.output_spec
    if _shape_arg(op) is None or not isinstance(spec, pt.DTensorSpec) or any(isinstance(p, pt.StridedShard) for p in spec.placements):
        raise NoStrategy(f"{_op_name(op)}: DTensor localized its size arguments for one rank, which has no symbolic form")


def _symbolic_local_sizes(b: SubgraphBuilder, op: Any, l_args: Any, out: Any) -> Any:
    """dynamic=True: DTensor localizes size arguments for one concrete coordinate (a
    different expression on every rank, and torch.chunk's layout only); the local sizes
    are instead the result's local shape (:meth:`SubgraphBuilder.local_shape`, one
    expression of the coordinate for every rank). An op with other localized arguments
    has no symbolic form here: its inputs are gathered (:class:`NoStrategy`)."""
    if b.sizes is None or not any(pt.is_symbolic(s) for s in pytree.tree_leaves(l_args) if isinstance(s, torch.SymInt)):
        return l_args
    spec = out.output_spec
    if _shape_arg(op) is None or not isinstance(spec, pt.DTensorSpec) or any(isinstance(p, pt.StridedShard) for p in spec.placements):
        raise NoStrategy(f"{_op_name(op)}: DTensor localized its size arguments for one rank, which has no symbolic form")
    l_args = list(l_args)
    idx = _shape_arg(op)
    if idx >= len(l_args):
        raise NoStrategy(f"{_op_name(op)}: its size argument is a keyword, which has no symbolic form here")
    l_args[idx] = list(b.local_shape(tuple(spec.shape), spec.placements))
    return tuple(l_args)


def _shape_arg(op: Any) -> int | None:
    """Where the op takes its result's shape (``view``'s size, ``new_zeros``' size), or None."""
    return 1 if op in _SHAPE_ARG_OPS else pt.localized_shape_arg(op)


def _write_back(b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict, tensors: list, locals_: list, dst_specs: list) -> None:
    """An argument the op writes in place (BatchNorm's running statistics, ``add_``'s
    self) that was redistributed for it was written as a copy: the write goes back into
    the argument's own layout and storage, where later reads of it look."""
    for pos, name in pt.written_args(op):
        arg = args[pos] if pos < len(args) else kwargs.get(name)
        if not isinstance(arg, TensorArg):
            continue
        i = next(k for k, t in enumerate(tensors) if t is arg)
        if locals_[i] is arg.node or any(p.is_partial() for p in arg.spec.placements):
            continue
        why = f"{name} written by {_op_name(op)} as {placements_text(dst_specs[i].placements)}, back into its {placements_text(arg.spec.placements)} layout"
        back, _ = emit_redistribute(b, locals_[i], dst_specs[i], arg.spec, reason=why, input_index=arg.index, value_label=arg.label)
        b.call(aten.copy_.default, arg.node, back)


def _reduces_partial(src: Any, dst: Any) -> bool:
    """True when going ``src`` -> ``dst`` sums a Partial value (and adds no new Partial)."""
    reduced = any(s.is_partial() and not d.is_partial() for s, d in zip(src.placements, dst.placements))
    added = any(d.is_partial() and not s.is_partial() for s, d in zip(src.placements, dst.placements))
    return reduced and not added


def wrap_result(b: SubgraphBuilder, node: fx.Node, spec: Any, masks: dict[int, fx.Node], ctx: ExpandContext, op: Any) -> Any:
    """Turn the local result node into the recipe's result pytree."""
    val = node.meta["val"]
    if val is None and op._schema.is_mutable and not op._schema.returns:
        return None  # a list op that only writes its arguments (_foreach_add_, _fused_adamw_)
    if isinstance(val, torch.Tensor):
        if not isinstance(spec, pt.DTensorSpec):
            raise UnsupportedOpError(op, [], ctx.node, f"DTensor gave no output placement (got {spec!r})")
        return _out_tensor(b, node, spec, masks)
    if isinstance(val, (tuple, list)):
        items = b.getitems(node)
        specs = spec if isinstance(spec, (tuple, list)) else [spec] * len(items)
        res = []
        for item, s in zip(items, specs):
            v = item.meta["val"]
            if isinstance(v, torch.Tensor) and isinstance(s, pt.DTensorSpec):
                res.append(_out_tensor(b, item, s, masks))
            elif v is None or s is None:
                res.append(None)
            else:
                raise UnsupportedOpError(op, [], ctx.node, f"unexpected output {type(v).__name__} with spec {s!r}")
        return type(val)(res) if isinstance(val, tuple) else res
    raise UnsupportedOpError(op, [], ctx.node, f"the op returns a {type(val).__name__}, which depends on data on every rank")


def expand_op(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """Emit the local program of ``op`` into ``b``; returns the result pytree.

    With a restricted value of token routing among the arguments (:mod:`.orders`), nothing
    may be redistributed on its token axes, and the result's facts follow from the
    arguments' (unless the op's rule is a routing rule, which states them itself)."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs), is_leaf=_is_tensor_arg) if isinstance(x, TensorArg)]
    if not any(t.rows is not None for t in tensors):
        return _expand_op(ctx, b, op, args, kwargs)
    b.routing = orders.guard_axes(tensors)
    b.routing_done = False
    result = _expand_op(ctx, b, op, args, kwargs)
    return result if b.routing_done else orders.transfer(op, tensors, result)


def _expand_op(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    rule = get_rule(op)
    if rule is None and op in pt.custom_handled_ops():
        return _custom_handled(ctx, b, op, args, kwargs)
    expand = rule if rule is not None else generic_expand
    if rule is None and torch.Tag.pointwise in getattr(op, "tags", ()) and not pt.writes_first_arg(op):
        args, kwargs = follow_strided(ctx, b, op, args, kwargs)
    # a rule that hands the op to DTensor (generic_expand) meets the same guards: it is
    # retried on the adjusted inputs, or the op falls back, with the op's own inputs
    for _ in range(ctx.mctx.ndim + 1):
        try:
            return expand(ctx, b, op, args, kwargs)
        except _UnevenAvg as e:
            args, kwargs = replicate_axes(
                ctx, b, args, kwargs, e.axes, f"uneven shards under a mean in {op}: replicated first"
            )
        except _AvoidPartition as e:
            why = getattr(e, "why", "Partial reduced before combining with a replicated input")
            args, kwargs = reduce_partial_axes(ctx, b, args, kwargs, e.axes, f"input of {op} ({why})")
        except NoStrategy as e:
            if pt.writes_first_arg(op) and torch.Tag.pointwise in op.tags:
                try:
                    return inplace_follow_self(ctx, b, op, args, kwargs)
                except NoStrategy:
                    pass
            placements = input_placements_text(args, kwargs)
            if ctx.fallback == "error":
                raise UnsupportedOpError(op, placements, ctx.node, f"DTensor has no sharding strategy ({e})") from e
            ctx.warn_once(
                op,
                "spmd_compiler: %s has no sharding strategy for inputs %s (%s); gathering its inputs to Replicate and running it unsharded",
                op, placements, e,
            )
            return replicate_fallback(ctx, b, op, args, kwargs, why=f"no sharding strategy: {e}")
    raise AssertionError("uneven-average guard did not converge")


def _custom_handled(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """Ops DTensor runs through a Python handler: convolution is safe when only the batch
    dim is sharded; everything else runs on replicated inputs."""
    if op in (aten.convolution.default, aten.convolution_backward.default):
        tensors = [x for x in pytree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, TensorArg)) if isinstance(x, TensorArg)]
        spatial = any(isinstance(p, pt.Shard) and p.dim >= 2 for t in tensors[:1] for p in t.spec.placements)
        if not spatial:
            try:
                return generic_expand(ctx, b, op, args, kwargs)
            except NoStrategy:
                pass
    if ctx.fallback == "error":
        raise UnsupportedOpError(op, input_placements_text(args, kwargs), ctx.node, "DTensor needs a custom handler for this op")
    ctx.warn_once(op, "spmd_compiler: running %s on replicated inputs (DTensor handles it with a custom handler)", op)
    return replicate_fallback(ctx, b, op, args, kwargs, why="custom DTensor handler")

