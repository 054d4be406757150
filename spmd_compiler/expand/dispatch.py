"""Expanding one aten op through DTensor's sharding propagation.

For a traced op with distributed inputs, :func:`generic_expand` asks DTensor which input
placements the op needs and which output placement results, emits the redistributions
(:mod:`.redistribute`) and the local op into the recipe builder, and returns the result
with its DTensorSpec. :func:`replicate_fallback` is the way out for ops DTensor has no
strategy for: gather every input to Replicate and run the op unsharded.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..errors import SpmdError, UnsupportedOpError
from .builder import OutTensor, SubgraphBuilder
from .layout import restride_like
from .redistribute import emit_redistribute, logical_shape
from .symbolic import partial_needs_replicate
from .registry import get_rule
from .values import DSymInt, MeshContext, placements_text

aten = torch.ops.aten

__all__ = [
    "expand_op", "TensorArg", "ScalarArg", "ExpandContext", "generic_expand", "replicate_fallback", "NoStrategy",
    "wrap_result", "follow_inputs", "ACTIVATION_SHARDING", "dtensor_keeps_inputs",
]

log = logging.getLogger(__name__)


class NoStrategy(Exception):
    """DTensor has no sharding strategy for an op with these inputs."""


@dataclass
class TensorArg:
    """A tensor argument inside a recipe: its recipe node, spec and optional mask node.

    ``index`` is its position among the traced node's tensor arguments (None for values
    a rule derives inside the recipe, which ``label`` describes instead). ``positions``:
    the dim along which the value holds its own global positions (:mod:`.positions`).
    """

    node: fx.Node
    spec: Any
    mask: fx.Node | None = None
    index: int | None = None
    label: str | None = None
    positions: int | None = None

    def moved(self, node: fx.Node, spec: Any, mask: fx.Node | None) -> "TensorArg":
        """The same argument after a redistribution (same global values)."""
        return TensorArg(node, spec, mask, self.index, self.label, self.positions)

    @property
    def local(self) -> torch.Tensor:
        return self.node.meta["val"]


@dataclass
class ScalarArg:
    """A run-time Python number inside a recipe (see :class:`~.values.RScalar`)."""

    node: fx.Node
    hint: Any


@dataclass
class ExpandContext:
    """What a rule may use while building a recipe.

    ``activation_sharding`` is the plan's rule for choosing among DTensor's strategies
    (see :func:`follow_inputs`): ``"follow"`` or ``"greedy"``. ``rng`` is how random ops
    draw (:mod:`.rules.random`): ``"exact"`` or ``"fast"``.
    """

    mctx: MeshContext
    fake_mode: Any
    fallback: str = "replicate"
    node: fx.Node | None = None
    warned: set | None = None
    activation_sharding: str = "follow"
    rng: str = "exact"

    def warn_once(self, key: Any, msg: str, *args: Any) -> None:
        if self.warned is None:
            self.warned = set()
        if key not in self.warned:
            self.warned.add(key)
            log.warning(msg, *args)


def _is_tensor_arg(x: Any) -> bool:
    return isinstance(x, TensorArg)


def _schema_leaf(x: Any) -> Any:
    if isinstance(x, TensorArg):
        return x.spec
    if isinstance(x, DSymInt):
        return x.global_value
    if isinstance(x, ScalarArg):
        return x.hint
    return x


def _global_leaf(x: Any) -> Any:
    """The value a local op gets for a non-tensor argument."""
    if isinstance(x, DSymInt):
        return x.global_value
    if isinstance(x, ScalarArg):
        return x.node
    return x


def input_placements_text(args: Any, kwargs: Any) -> list[str]:
    leaves = pytree.tree_leaves((args, kwargs))
    return [f"{placements_text(a.spec.placements)} {list(a.spec.shape)}" for a in leaves if isinstance(a, TensorArg)]


def _uneven_axes(b: SubgraphBuilder, spec: Any) -> set[int]:
    """Mesh axes over which ``spec`` splits a dim unevenly."""
    out = set()
    for axis, p in enumerate(spec.placements):
        if isinstance(p, pt.Shard):
            size = logical_shape(b, tuple(spec.shape), list(spec.placements), axis)[p.dim]
            if size % b.mctx.shape[axis]:
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


def _is_sharded(p: Any) -> bool:
    return isinstance(p, (pt.Shard, pt.StridedShard))


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


def _input_specs(args: Any, kwargs: Any) -> list[Any]:
    return [t.spec for t in pytree.tree_leaves((args, kwargs), is_leaf=_is_tensor_arg) if isinstance(t, TensorArg)]


def _nested_uneven(spec: Any, mesh_shape: Any) -> str | None:
    """A tensor dim split over several mesh axes whose size the product of those axes
    does not divide (e.g. size 2 over a 2x2 mesh: shards of 1, 1, 0, 0), described."""
    if not isinstance(spec, pt.DTensorSpec):
        return None
    ways: dict[int, int] = {}
    for axis, p in enumerate(spec.placements):
        if isinstance(p, pt.Shard):
            ways[p.dim] = ways.get(p.dim, 1) * mesh_shape[axis]
    for dim, n in ways.items():
        nested = sum(1 for p in spec.placements if isinstance(p, pt.Shard) and p.dim == dim) > 1
        if nested and spec.shape[dim] % n:
            return f"dim {dim} of size {spec.shape[dim]} is split {n} ways over several mesh axes"
    return None


def _guard_view_sizes(b: SubgraphBuilder, op: Any, args: Any, kwargs: Any, out: Any) -> None:
    """DTensor's view strategies check divisibility one mesh axis at a time, so a dim split
    unevenly over several axes gets local sizes that do not match the local data."""
    if not out.use_val_from_redistribute_schema:
        return
    specs = _input_specs(args, kwargs)
    specs += list(out.output_spec) if isinstance(out.output_spec, (tuple, list)) else [out.output_spec]
    for spec in specs:
        why = _nested_uneven(spec, b.mctx.shape)
        if why:
            raise NoStrategy(f"{_op_name(op)} cannot take local sizes when {why}")


# reductions with no identity element: on an empty local shard they raise (amax) or
# give a value that is not neutral (argmax), so no rank may hold an empty shard
_NO_IDENTITY = {
    "amax", "amin", "max", "min", "argmax", "argmin", "aminmax", "max_pool2d_with_indices", "cummax", "cummin",
}


def _guard_empty_shards(b: SubgraphBuilder, op: Any, args: Any, kwargs: Any, out: Any) -> None:
    """Refuse DTensor's strategy for an identity-less reduction when some rank's local
    input would be empty (a dim of 7 over 5 ranks: 2, 2, 2, 1, 0), so the op falls back."""
    if op.__name__.split(".")[0] not in _NO_IDENTITY:
        return
    schema = out.redistribute_schema
    if schema is not None:
        specs = pytree.tree_leaves((tuple(schema.args_schema), dict(schema.kwargs_schema)))
    else:
        specs = _input_specs(args, kwargs)
    for spec in specs:
        if not isinstance(spec, pt.DTensorSpec) or not any(_is_sharded(p) for p in spec.placements):
            continue
        if any(s == 0 for s in spec.shape):
            continue
        for coord in itertools.product(*(range(n) for n in b.mctx.shape)):  # the same verdict on every rank
            local, _ = pt.local_shape_and_offset(tuple(spec.shape), b.mctx.shape, coord, spec.placements)
            if 0 in local:
                raise NoStrategy(f"{_op_name(op)} has no identity element and rank {coord} would hold an empty shard "
                                 f"of its input {list(spec.shape)} ({placements_text(spec.placements)})")


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
    _guard_empty_shards(b, op, args, kwargs, out)
    _guard_partition(args, kwargs, out)
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
        if _reduces_partial(t.spec, dst) and not (mutated and i == 0) and t.index is not None:
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
    else:
        leaves = [next(it) if isinstance(x, TensorArg) else _global_leaf(x) for x in flat]
        l_args, l_kwargs = pytree.tree_unflatten(leaves, tree)
    result = b.call(target_op, *l_args, **l_kwargs)
    _write_back(b, op, args, kwargs, tensors, locals_, dst_specs)
    return wrap_result(b, result, out.output_spec, masks_by_buffer, ctx, op)


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


def _op_name(op: Any) -> str:
    return str(op).replace("aten.", "")


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


def _out_tensor(b: SubgraphBuilder, node: fx.Node, spec: Any, masks: dict[int, fx.Node]) -> OutTensor:
    mask_index = None
    for p in spec.placements:
        if isinstance(p, pt.MaskPartial):
            mask = masks.get(id(p.mask_buffer))
            if mask is None:
                # every MaskPartial is made by redistribute with its mask (or a zero mask
                # once applied), so no plan reaches this
                raise SpmdError(f"a {placements_text(spec.placements)} output has no mask among its inputs' masks; this is a bug in spmd-compiler")
            mask_index = b.slot(mask)
    node.meta["spmd_spec"] = spec
    return OutTensor(b.slot(node), spec, mask_index)


def _guard_uneven_avg(b: SubgraphBuilder, op: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """Reductions that go wrong on uneven shards, whatever DTensor's rule says:

    * Partial(avg) over an unevenly split dim averages unequal chunks as if they were
      equal (a silently wrong mean);
    * Partial(max/min) over a dim some rank holds zero elements of fails on that rank
      only (max of nothing), while the others wait for it in the reduction.

    Where that would happen the uneven inputs are replicated on that axis first
    (decided from global sizes, so every rank decides the same).
    """
    specs = out.output_spec if isinstance(out.output_spec, (tuple, list)) else [out.output_spec]
    partial_ops: dict[int, set[str]] = {}
    for s in specs:
        if isinstance(s, pt.DTensorSpec):
            for axis, p in enumerate(s.placements):
                if p.is_partial():
                    partial_ops.setdefault(axis, set()).add(getattr(p, "reduce_op", "sum"))
    if not partial_ops:
        return out
    tensors = [x for x in pytree.tree_leaves((args, kwargs), is_leaf=_is_tensor_arg) if isinstance(x, TensorArg)]
    bad = set()
    for axis, ops in partial_ops.items():
        for t in tensors:
            p = t.spec.placements[axis]
            if not (p.is_shard() or isinstance(p, pt.StridedShard)):
                continue
            size = t.spec.shape[p.dim]
            ways = _ways(t.spec.placements, axis, p.dim, b.mctx.shape)
            if partial_needs_replicate(size, ways, ops):
                bad.add(axis)
    if bad:
        raise _UnevenAvg(bad)
    return out


def _ways(placements: Any, axis: int, dim: int, mesh_shape: Any) -> int:
    """Into how many pieces mesh axes up to ``axis`` split tensor ``dim``."""
    ways = 1
    for j in range(axis + 1):
        p = placements[j]
        if getattr(p, "dim", None) == dim and (p.is_shard() or isinstance(p, pt.StridedShard)):
            ways *= mesh_shape[j]
    return ways


class _AvoidPartition(Exception):
    """The strategy splits a replicated input into Partial pieces (x / n per rank) to
    add it to a Partial one. Reducing the Partial input first is exact and usually what
    a hand-written program does (Megatron reduces right after the row-parallel matmul)."""

    def __init__(self, axes: set[int]) -> None:
        super().__init__(axes)
        self.axes = axes


def _dst_specs(out: Any, n: int) -> list[Any] | None:
    if not (out.needs_redistribute and out.redistribute_schema is not None):
        return None
    rs = out.redistribute_schema
    specs = [x for x in pytree.tree_leaves((tuple(rs.args_schema), dict(rs.kwargs_schema))) if isinstance(x, pt.DTensorSpec)]
    return specs if len(specs) == n else None


def partition_axes(args: Any, kwargs: Any, out: Any) -> set[int]:
    """Mesh axes on which the strategy turns some Replicate input into Partial."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs), is_leaf=_is_tensor_arg) if isinstance(x, TensorArg)]
    dsts = _dst_specs(out, len(tensors))
    if dsts is None:
        return set()
    return {
        a
        for t, d in zip(tensors, dsts)
        for a, (sp, dp) in enumerate(zip(t.spec.placements, d.placements))
        if sp.is_replicate() and dp.is_partial()
    }


def _guard_partition(args: Any, kwargs: Any, out: Any) -> None:
    axes = partition_axes(args, kwargs, out)
    if not axes:
        return
    tensors = [x for x in pytree.tree_leaves((args, kwargs), is_leaf=_is_tensor_arg) if isinstance(x, TensorArg)]
    partial = {a for t in tensors for a, p in enumerate(t.spec.placements) if p.is_partial()} & axes
    if partial:
        raise _AvoidPartition(partial)


def reduce_partial_axes(ctx: ExpandContext, b: SubgraphBuilder, args: Any, kwargs: Any, axes: set[int], why: str) -> tuple[Any, Any]:
    """Return args/kwargs with every Partial tensor reduced to Replicate on ``axes``."""

    counter = iter(range(1 << 30))

    def fix(x: Any) -> Any:
        if not isinstance(x, TensorArg):
            return x
        index = next(counter)
        pl = [pt.Replicate() if (i in axes and p.is_partial()) else p for i, p in enumerate(x.spec.placements)]
        if tuple(pl) == tuple(x.spec.placements):
            return x
        dst = pt.DTensorSpec(x.spec.mesh, tuple(pl), tensor_meta=x.spec.tensor_meta)
        node, mask = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=why, input_index=x.index, value_label=x.label)
        return x.moved(node, dst, mask)  # a MaskPartial left on another axis keeps its mask

    return pytree.tree_map(fix, (args, kwargs), is_leaf=_is_tensor_arg)


class _UnevenAvg(Exception):
    def __init__(self, axes: set[int]) -> None:
        super().__init__(axes)
        self.axes = axes


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
        if isinstance(t, torch.Tensor) and [pt.size_hint(s) for s in t.shape] == list(n.meta["val"].shape):
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


def replicate_axes(ctx: ExpandContext, b: SubgraphBuilder, args: Any, kwargs: Any, axes: set[int], why: str) -> tuple[Any, Any]:
    """Return args/kwargs with every tensor redistributed to Replicate on ``axes``."""

    counter = iter(range(1 << 30))

    def fix(x: Any) -> Any:
        if not isinstance(x, TensorArg):
            return x
        index = next(counter)
        pl = [pt.Replicate() if i in axes else p for i, p in enumerate(x.spec.placements)]
        if tuple(pl) == tuple(x.spec.placements):
            return x
        dst = pt.DTensorSpec(x.spec.mesh, tuple(pl), tensor_meta=x.spec.tensor_meta)
        node, mask = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=why, input_index=x.index, value_label=x.label)
        return x.moved(node, dst, mask)

    return pytree.tree_map(fix, (args, kwargs), is_leaf=_is_tensor_arg)


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


def expand_op(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """Emit the local program of ``op`` into ``b``; returns the result pytree."""
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
            args, kwargs = reduce_partial_axes(
                ctx, b, args, kwargs, e.axes, f"input of {op} (Partial reduced before combining with a replicated input)"
            )
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
