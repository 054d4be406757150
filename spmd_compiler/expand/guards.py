"""Guards: reasons to refuse DTensor's chosen strategy for an op, decided before any
collective is emitted.

Terms: a *strategy* (``out``) is what :func:`~.dispatch._propagate` returns, DTensor's
``OutputSharding``: output specs and, when inputs must move, a *redistribute schema* with
the placements each tensor argument needs (:func:`_dst_specs`). *Uneven* shards: a dim
whose size the number of ranks splitting it does not divide; *ways*: into how many pieces
mesh axes split a tensor dim. A *partition* is a strategy turning a Replicate input into
Partial (x / n per rank).

Each guard either returns, raises :class:`~.args.NoStrategy` (the op falls back), or
raises one of the retry signals :class:`_UnevenAvg` (replicate these mesh axes first) and
:class:`_AvoidPartition` (reduce the Partial inputs on these axes first; also raised as
:class:`_RoundsPartial` before a cast that would round each rank's term), which
:func:`~.dispatch.expand_op` answers with :mod:`.fallback`'s helpers and a retry. Every
verdict is made from global sizes, so all ranks decide the same.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from .args import NoStrategy, TensorArg, _input_specs, _is_sharded, _is_tensor_arg, _op_name
from .builder import SubgraphBuilder
from .symbolic import partial_needs_replicate
from .values import placements_text

_TO_COPY = torch.ops.aten._to_copy.default


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
        # a pt.symbolic_split leaves every rank H/n rows of each block: never empties a shard
        placements = [pt.Replicate() if pt.split_period(p) is not None else p for p in spec.placements]
        for coord in itertools.product(*(range(n) for n in b.mctx.shape)):  # the same verdict on every rank
            local, _ = pt.local_shape_and_offset(tuple(spec.shape), b.mctx.shape, coord, placements)
            if 0 in local:
                raise NoStrategy(f"{_op_name(op)} has no identity element and rank {coord} would hold an empty shard "
                                 f"of its input {list(spec.shape)} ({placements_text(spec.placements)})")


class _UnevenAvg(Exception):
    def __init__(self, axes: set[int]) -> None:
        super().__init__(axes)
        self.axes = axes


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


class _RoundsPartial(_AvoidPartition):
    """A cast of a ``Partial(sum)`` value to a dtype that cannot hold it exactly (float64
    to float32 or bfloat16, a float to an integer) would round each rank's term: the sum
    of rounded terms is not the rounded sum (up to one unit in the last place of the
    narrow dtype per term, where one device rounds once). Reducing first is exact."""

    why = "Partial reduced before a cast that rounds it"


def _rounds(src: Any, dst: Any) -> bool:
    """Whether casting ``src`` values to ``dst`` can round them (not linear in a sum)."""
    if not (src.is_floating_point or src.is_complex) or dst is None or dst == src:
        return False
    if src.is_complex:
        return not dst.is_complex or torch.finfo(dst).eps > torch.finfo(src).eps
    if not dst.is_floating_point:
        return not dst.is_complex
    a, b = torch.finfo(src), torch.finfo(dst)
    return b.eps > a.eps or b.max < a.max


def _guard_rounding_cast(op: Any, args: Any, kwargs: Any, out: Any) -> None:
    """Refuse a strategy that casts a ``Partial(sum)``/``Partial(avg)`` input term by
    term to a narrower dtype (DTensor keeps ``Partial`` through ``_to_copy``, as if a
    cast were linear): :class:`_RoundsPartial` reduces the input first. A
    ``MaskPartial`` (one rank's term is the value, the others' zero) rounds exactly."""
    if op is not _TO_COPY or not args or not isinstance(args[0], TensorArg):
        return
    x = args[0]
    if not _rounds(x.spec.tensor_meta.dtype, kwargs.get("dtype")):
        return
    dsts = _dst_specs(out, 1)
    placements = dsts[0].placements if dsts else x.spec.placements
    axes = {a for a, p in enumerate(placements) if p.is_partial() and not isinstance(p, pt.MaskPartial)
            and getattr(p, "reduce_op", "sum") in ("sum", "avg")}
    if axes:
        raise _RoundsPartial(axes)


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


def _guard_partition(args: Any, kwargs: Any, out: Any, op: Any = None) -> None:
    axes = partition_axes(args, kwargs, out)
    tensors = [x for x in pytree.tree_leaves((args, kwargs), is_leaf=_is_tensor_arg) if isinstance(x, TensorArg)]
    partial = {a for t in tensors for a, p in enumerate(t.spec.placements) if p.is_partial()}
    if partial & axes:
        raise _AvoidPartition(partial & axes)
    if op in _MATMULS and partial:
        gathered = _gathered_beside_partial(tensors, out, partial, _MATMULS[op])
        if gathered:
            raise _AvoidPartition(gathered)


# matmul -> the contracted dim of each tensor argument (None: the added input)
_MATMULS = {torch.ops.aten.mm.default: (1, 0), torch.ops.aten.bmm.default: (2, 1), torch.ops.aten.addmm.default: (None, 1, 0),
            torch.ops.aten.baddbmm.default: (None, 2, 1)}


def _gathered_beside_partial(tensors: list[Any], out: Any, partial: set[int], contracted: tuple) -> set[int]:
    """Mesh axes on which a matmul's strategy gathers an operand split along a dim it keeps
    (not the contracted one) while another operand stays Partial (the result stays Partial
    too). A vocab-parallel output layer's backward gives the hidden state's gradient Partial
    over ``tp``; DTensor's cheapest next matmul then gathered the feed-forward's activations
    and weights (8 all_gathers, 4 reduce_scatters in a 2-layer Llama) where Megatron
    all_reduces that gradient once per layer and keeps them split: the Partial operand is
    reduced first instead. (An operand split along the contracted dim beside a Partial one,
    a data-parallel weight gradient, is left to DTensor.)"""
    dsts = _dst_specs(out, len(tensors))
    if dsts is None or len(contracted) != len(tensors):
        return set()
    axes = set()
    for a in partial:
        keeps = any(t.spec.placements[a].is_partial() and d.placements[a].is_partial() for t, d in zip(tensors, dsts))
        gathers = any(_is_sharded(t.spec.placements[a]) and d.placements[a].is_replicate() and t.spec.placements[a].dim != k
                      for t, d, k in zip(tensors, dsts, contracted))
        if keeps and gathers:
            axes.add(a)
    return axes


def _guard_head_tail(b: SubgraphBuilder, op: Any, out: Any) -> None:
    """A result split over a context-parallel axis with the head-tail layout
    (:mod:`.head_tail`) must split a dim that ``2 n`` (times its blocks) divides: a view
    that splits the sequence into (outer, inner) keeps the layout only when the outer dim's
    chunks are the sequence's. Otherwise the op runs on gathered inputs (NoStrategy)."""
    if b.mctx.cp is None or not b.mctx.cp.load_balance:
        return
    from .redistribute import logical_shape

    specs = out.output_spec if isinstance(out.output_spec, (tuple, list)) else [out.output_spec]
    for spec in specs:
        if not isinstance(spec, pt.DTensorSpec):
            continue
        for axis, p in enumerate(spec.placements):
            if not b.mctx.head_tail(axis) or not (p.is_shard() or isinstance(p, pt.StridedShard)):
                continue
            sf = int(p.split_factor) if isinstance(p, pt.StridedShard) and pt.split_period(p) is None else 1
            size = logical_shape(b, tuple(spec.shape), list(spec.placements), axis)[p.dim]
            if pt.split_period(p) is not None or pt.is_symbolic(size) or size % (2 * b.mctx.shape[axis] * sf):
                raise NoStrategy(f"{_op_name(op)}: its result's dim {p.dim} of size {size} has no head-tail layout over "
                                 f"'{b.mctx.axis_names[axis]}' ({b.mctx.shape[axis]} ranks, {sf} blocks)")
