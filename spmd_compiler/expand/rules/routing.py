"""Token routing on each rank's own tokens: sort, count, gather and scatter back.

The rules of :mod:`..orders` (read its docstring first): a sort of tokens split over mesh
axes sorts each rank's own tokens; indexing and scattering by the sort's row numbers
stay on the rank; counts of a rank's own rows are its term of a ``Partial`` sum. Each
rule checks that every argument is laid out as the restricted program needs it and hands
the op back (to DTensor, or to the next rule) otherwise; a rank-local value that reaches
anything else stops the expansion (:class:`..orders.OrderEscape`), which restarts with
the sort done on gathered tokens.

Ops: ``sort``/``argsort`` (the entry), ``histc`` and ``sum`` of an integer or boolean map
over the token rows (counts), ``cumsum`` of a ``Partial``
sum (offsets), ``index`` / ``gather`` by row numbers, ``index_put`` / ``scatter_add`` /
``index_add`` (and torchtitan's ``deterministic_scatter_add``) into rows or into a count,
``floor_divide`` of row numbers (``perm // top_k``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ... import _private_torch as pt
from ..args import ExpandContext, TensorArg
from ..builder import OutTensor, SubgraphBuilder
from ..dispatch import generic_expand
from ..orders import ENTRY_OPS, Order, Rows, merge_origins
from ..registry import register_rule
from .accumulate import partial_index_add, partial_scatter_add

__all__ = ["index_by_rows", "put_by_rows", "token_axes"]

aten = torch.ops.aten

_INDEX_DTYPES = (torch.int64, torch.int32)


def token_axes(spec: Any, dim: int) -> tuple[int, ...]:
    """The mesh axes that split ``dim`` of ``spec`` as plain shards (no other axis may
    split that dim in another way); () if none or any does."""
    axes = tuple(a for a, p in enumerate(spec.placements) if type(p) is pt.Shard and p.dim == dim)
    if any(p.is_shard() and getattr(p, "dim", None) == dim and a not in axes for a, p in enumerate(spec.placements)):
        return ()
    return axes


def _contiguous(shape: Any) -> tuple:
    stride, acc = [], 1
    for s in reversed(list(shape)):
        stride.append(acc)
        acc = acc * s
    return tuple(reversed(stride))


def _spec(ctx: ExpandContext, placements: Any, shape: Any, dtype: torch.dtype) -> Any:
    return pt.make_spec(ctx.mctx.mesh, list(placements), tuple(shape), _contiguous(shape), dtype)


def _out(b: SubgraphBuilder, node: Any, spec: Any, rows: Rows | None) -> OutTensor:
    """A result whose facts this module states (the dispatcher adds none)."""
    b.routing_done = True
    node.meta["spmd_spec"] = spec
    return OutTensor(b.slot(node), spec, None, rows if rows is not None and rows != Rows() else None)


def _order_of(t: TensorArg, axes: tuple[int, ...]) -> Order | str:
    """The row order of ``t`` on ``axes``: an Order (canonical: key "") or "any" (a fill)."""
    r = t.rows
    if r is not None and r.order is None and (r.fresh or r.identity):
        return "any"
    if r is not None and r.order is not None:
        return r.order
    return Order(axes)


def _fits(t: TensorArg, order: Order) -> bool:
    o = _order_of(t, order.axes)
    return o == "any" or o == order


def _rows_order(t: TensorArg) -> Order | None:
    """The row order of an index tensor's own rows (None: canonical)."""
    r = t.rows
    return r.order if r is not None and r.order is not None and not r.order.canonical else None


def _bind(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    out = {a.name: a.default_value if a.has_default_value() else None for a in op._schema.arguments}
    out.update({a.name: v for a, v in zip(op._schema.arguments, args)})
    out.update(kwargs)
    return out


# ---------------------------------------------------------------- the entry: a sort
_SORTS = [aten.sort.default, aten.sort.stable]
_ARGSORTS = [getattr(aten.argsort, o) for o in ("default", "stable") if hasattr(aten.argsort, o)]


@register_rule(*_SORTS, *_ARGSORTS)
def _sort(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """Sort a rank's own tokens: values in a rank-local order, indices its local row numbers."""
    x = args[0]
    bound = _bind(op, args, kwargs)
    dim = (bound.get("dim") if bound.get("dim") is not None else -1) % max(len(x.spec.shape), 1)
    axes = token_axes(x.spec, dim)
    r = x.rows
    if (not axes or ctx.node is None or ctx.node.name in ctx.routing_global or any(p.is_partial() for p in x.spec.placements)
            or (r is not None and (r.into is not None or r.identity))):
        return generic_expand(ctx, b, op, args, kwargs)
    node = b.call(op, x.node, *args[1:], **kwargs)
    order = Order(axes, key=ctx.node.name)
    origins = merge_origins(x) | {ctx.node.name}
    into = r.order if r is not None and r.order is not None else Order(axes)
    shape = tuple(x.spec.shape)
    indices = Rows(order=order, into=into, size=shape[dim], origins=origins)
    idx_spec = _spec(ctx, x.spec.placements, shape, torch.int64)
    if op in _ARGSORTS:
        return _out(b, node, idx_spec, indices)
    values, idx = b.getitems(node)
    return (_out(b, values, _spec(ctx, x.spec.placements, shape, x.spec.tensor_meta.dtype), Rows(order=order, origins=origins)),
            _out(b, idx, idx_spec, indices))


ENTRY_OPS.update(_SORTS + _ARGSORTS)


# ---------------------------------------------------------------- counts and offsets
def _partial_sum(axes: tuple[int, ...], ndim: int) -> list[Any]:
    placements = [pt.Replicate()] * ndim
    for a in axes:
        placements[a] = pt.Partial("sum")
    return placements


@register_rule(aten.histc.default)
def _histc(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """A histogram of values split over mesh axes is the sum of each rank's histogram:
    ``Partial(sum)``, whose local term is the rank's own counts (``restricted``)."""
    x = args[0]
    axes = token_axes(x.spec, 0) if len(x.spec.shape) == 1 else ()
    r = x.rows
    others_replicated = all(p.is_replicate() for a, p in enumerate(x.spec.placements) if a not in axes)
    if not axes or not others_replicated or (r is not None and (r.into is not None or r.identity)):
        return generic_expand(ctx, b, op, args, kwargs)
    node = b.call(op, x.node, *args[1:], **kwargs)
    spec = _spec(ctx, _partial_sum(axes, ctx.mctx.ndim), tuple(node.meta["val"].shape), node.meta["val"].dtype)
    return _out(b, node, spec, Rows(restricted=axes, origins=merge_origins(x)))


@register_rule(aten.sum.dim_IntList)
def _sum_counts(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """Counts as a sum over the token rows of an integer or boolean tensor (torchtitan's
    ``routing_map.sum(dim=(0, 1))`` of a one-hot expert map): DTensor's ``Partial(sum)``,
    whose local term is the rank's own counts (``restricted`` on the summed token axes)."""
    out = generic_expand(ctx, b, op, args, kwargs)
    x = args[0]
    bound = _bind(op, args, kwargs)
    dims = bound.get("dim")
    if (not isinstance(x, TensorArg) or x.spec.tensor_meta.dtype.is_floating_point or x.spec.tensor_meta.dtype.is_complex
            or not dims or not hasattr(out, "spec")):
        return out
    r = x.rows
    if r is not None and (r.into is not None or r.identity or r.restricted):
        return out
    ndim = max(len(x.spec.shape), 1)
    summed = {d % ndim for d in dims}
    axes = tuple(a for d in sorted(summed) for a in token_axes(x.spec, d))
    axes = tuple(a for a in sorted(set(axes)) if out.spec.placements[a].is_partial())
    if not axes or any(p.is_partial() for p in x.spec.placements) or (r is not None and r.order is not None and not set(r.order.axes) <= set(axes)):
        return out
    b.routing_done = True
    return dataclasses.replace(out, rows=Rows(restricted=axes, origins=merge_origins(x)))


@register_rule(aten.cumsum.default)
def _cumsum(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """A running sum along an unsplit dim of a ``Partial(sum)`` value is the sum of each
    rank's running sums (offsets from counts): no reduction."""
    x = args[0]
    bound = _bind(op, args, kwargs)
    dim = bound["dim"] % max(len(x.spec.shape), 1)
    partial = [a for a, p in enumerate(x.spec.placements) if p.is_partial()]
    if (not partial or any(getattr(p, "reduce_op", None) != "sum" for a, p in enumerate(x.spec.placements) if a in partial)
            or any(p.is_shard() and getattr(p, "dim", None) == dim for p in x.spec.placements)):
        return generic_expand(ctx, b, op, args, kwargs)
    node = b.call(op, x.node, *args[1:], **kwargs)
    val = node.meta["val"]
    spec = _spec(ctx, x.spec.placements, tuple(x.spec.shape), val.dtype)
    r = x.rows
    keep = tuple(a for a in (r.restricted if r is not None else ()) if a in partial)
    return _out(b, node, spec, Rows(restricted=keep, origins=merge_origins(x)) if keep else None)



# ---------------------------------------------------------------- indexing by row numbers
def _others_ok(idx: TensorArg, axes: tuple[int, ...]) -> bool:
    return all(p.is_replicate() for a, p in enumerate(idx.spec.placements) if a not in axes)


def _check_target(x: TensorArg, idx: TensorArg) -> Order | None:
    """The order ``idx`` points into, when ``x`` (the indexed or written tensor) is laid
    out in it along dim 0 and has the rows the numbers count; None otherwise."""
    r = idx.rows
    if r is None or r.into is None or idx.spec.tensor_meta.dtype not in _INDEX_DTYPES:
        return None
    axes = r.into.axes
    if token_axes(x.spec, 0) != axes or not _fits(x, r.into) or not _others_ok(idx, axes):
        return None
    if r.size is not None and x.spec.shape[0] * r.div != r.size:
        return None
    return r.into


def _row_dim(idx: TensorArg, axes: tuple[int, ...]) -> int | None:
    dims = {idx.spec.placements[a].dim for a in axes if idx.spec.placements[a].is_shard()}
    if len(dims) != 1 or any(not idx.spec.placements[a].is_shard() for a in axes):
        return None
    return dims.pop()


def index_by_rows(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``x[idx]`` (dim 0) with ``idx`` a rank's row numbers into ``x``'s own rows: the
    local rows, in ``idx``'s row order; None when this is not that case."""
    x, indices = args[0], list(args[1])
    if kwargs or not indices or not isinstance(indices[0], TensorArg) or any(i is not None for i in indices[1:]):
        return None
    idx = indices[0]
    target = _check_target(x, idx)
    if target is None:
        return None
    axes = target.axes
    k = _row_dim(idx, axes)
    if k is None or any(p.is_shard() and p.dim == 0 for a, p in enumerate(x.spec.placements) if a not in axes):
        return None
    node = b.call(op, x.node, [idx.node])
    shift = len(idx.spec.shape) - 1
    placements = []
    for a, p in enumerate(x.spec.placements):
        if a in axes:
            placements.append(pt.Shard(k))
        elif p.is_shard():
            placements.append(pt.Shard(p.dim + shift))
        else:
            placements.append(p)
    shape = tuple(idx.spec.shape) + tuple(x.spec.shape[1:])
    spec = _spec(ctx, placements, shape, x.spec.tensor_meta.dtype)
    xr = x.rows
    rows = Rows(order=_rows_order(idx), into=xr.into if xr is not None else None, size=xr.size if xr is not None else None,
                div=xr.div if xr is not None else 1, origins=merge_origins(x, idx))
    return _out(b, node, spec, rows)


@register_rule(aten.gather.default)
def _gather(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``x.gather(0, idx)`` (the backward of a scatter back to the tokens) with ``idx``
    row numbers into ``x``'s rows: local, in ``idx``'s row order."""
    x, dim, idx = args[0], args[1], args[2]
    if dim != 0 or kwargs.get("sparse_grad") or (len(args) > 3 and args[3]) or not isinstance(idx, TensorArg):
        return generic_expand(ctx, b, op, args, kwargs)
    target = _check_target(x, idx)
    k = _row_dim(idx, target.axes) if target is not None else None
    if target is None or k != 0 or any(not p.is_replicate() for a, p in enumerate(x.spec.placements) if a not in target.axes):
        return generic_expand(ctx, b, op, args, kwargs)
    node = b.call(op, x.node, 0, idx.node)
    spec = _spec(ctx, idx.spec.placements, tuple(idx.spec.shape), x.spec.tensor_meta.dtype)
    return _out(b, node, spec, Rows(order=_rows_order(idx), origins=merge_origins(x, idx)))



def _identity_values(ctx: ExpandContext, b: SubgraphBuilder, values: TensorArg, axes: tuple[int, ...]) -> Any:
    """A canonical ``arange`` over the split rows (global numbers ``offset + j``) as the
    restricted program has it (``j``); None if ``values`` is not one."""
    if values.positions != 0 or len(values.spec.shape) != 1 or token_axes(values.spec, 0) != axes or len(axes) != 1:
        return None
    size = values.spec.shape[0]
    b.local_chunk(size, axes[0])
    return b.call(aten.sub.Tensor, values.node, b.shard_offset(size, axes[0]))


def put_by_rows(ctx: ExpandContext, b: SubgraphBuilder, op: Any, self_: TensorArg, idx: TensorArg, values: Any,
                accumulate: bool, emit: Any) -> Any:
    """Write (or add) ``values`` into the rows of ``self_`` that ``idx`` numbers (a rank's
    own rows): ``emit(self_node, idx_node, values_node)`` emits the local op. None when
    this is not that case. ``values`` rows must be aligned with ``idx``'s rows (or the
    same for every row); an ``arange`` written by a permutation makes its inverse."""
    target = _check_target(self_, idx)
    if target is None or not isinstance(values, TensorArg):
        return None
    axes = target.axes
    k = _row_dim(idx, axes)
    if k != 0:
        return None
    identity = _identity_values(ctx, b, values, axes)
    partial_out = []
    for a, (ps, pv) in enumerate(zip(self_.spec.placements, values.spec.placements)):
        if a in axes:
            continue
        if ps == pv:
            continue
        if accumulate and pv.is_partial() and ps.is_replicate() and self_.rows is not None and self_.rows.zero:
            partial_out.append(a)
            continue
        return None
    if identity is None:
        vr = values.rows
        if token_axes(values.spec, 0) == axes:
            if not (vr is not None and vr.order is None and vr.fresh) and _order_of(values, axes) != (_rows_order(idx) or Order(axes)):
                return None
        elif any(not values.spec.placements[a].is_replicate() for a in axes):
            return None
        if vr is not None and (vr.into is not None or vr.identity):
            return None
    node = emit(self_.node, idx.node, identity if identity is not None else values.node)
    placements = list(self_.spec.placements)
    for a in partial_out:
        placements[a] = pt.Partial("sum")
    spec = _spec(ctx, placements, tuple(self_.spec.shape), self_.spec.tensor_meta.dtype)
    order = target if not target.canonical else None
    if identity is not None:
        into = _rows_order(idx) or Order(axes)
        rows = Rows(order=order, into=into, size=idx.spec.shape[0], origins=merge_origins(self_, idx, values))
    else:
        rows = Rows(order=order, origins=merge_origins(self_, idx, values))
    return _out(b, node, spec, rows)


def _counts(ctx: ExpandContext, b: SubgraphBuilder, self_: TensorArg, idx: TensorArg, src: TensorArg, emit: Any) -> Any:
    """Adding token rows into a fill by their *values* (``zeros(E).scatter_add(0, ids,
    ones)``, counts per expert): the sum over every rank's rows, ``Partial(sum)``, whose
    local term is the rank's own (``restricted``). None when this is not that case."""
    if self_.rows is None or not self_.rows.zero or not isinstance(src, TensorArg):
        return None
    axes = token_axes(idx.spec, 0)
    if not axes or token_axes(src.spec, 0) != axes or any(not self_.spec.placements[a].is_replicate() for a in axes):
        return None
    if idx.rows is not None and (idx.rows.into is not None or idx.rows.identity):
        return None
    if _order_of(idx, axes) != _order_of(src, axes) and "any" not in (_order_of(idx, axes), _order_of(src, axes)):
        return None
    others = [a for a in range(ctx.mctx.ndim) if a not in axes]
    if any(not t.spec.placements[a].is_replicate() for t in (self_, idx, src) for a in others):
        return None
    node = emit(self_.node, idx.node, src.node)
    spec = _spec(ctx, _partial_sum(axes, ctx.mctx.ndim), tuple(self_.spec.shape), self_.spec.tensor_meta.dtype)
    return _out(b, node, spec, Rows(restricted=axes, origins=merge_origins(self_, idx, src)))


@register_rule(aten.scatter_add.default, aten.scatter_add_.default)
def _scatter_add(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    self_, dim, idx, src = args[0], args[1], args[2], args[3]
    if dim == 0 and isinstance(idx, TensorArg) and not kwargs:
        def emit(s: Any, i: Any, v: Any) -> Any:
            return b.call(op, s, 0, i, v)

        out = put_by_rows(ctx, b, op, self_, idx, src, True, emit) if idx.rows is not None and idx.rows.into is not None else \
            _counts(ctx, b, self_, idx, src, emit)
        if out is not None:
            return out
    summed = partial_scatter_add(ctx, b, op, args, kwargs) if op is aten.scatter_add.default else None
    return summed if summed is not None else generic_expand(ctx, b, op, args, kwargs)


@register_rule("torchtitan::deterministic_scatter_add")
def _deterministic_scatter_add(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """torchtitan's ``deterministic_scatter_add(out, index, src)``: ``out.scatter_add(0,
    index, src)`` (every torchtitan MoE combines its experts' rows with it)."""
    bound = _bind(op, args, kwargs)
    self_, idx, src = bound["out"], bound["index"], bound["src"]
    if isinstance(idx, TensorArg):
        def emit(s: Any, i: Any, v: Any) -> Any:
            return b.call(op, s, i, v)

        out = put_by_rows(ctx, b, op, self_, idx, src, True, emit) if idx.rows is not None and idx.rows.into is not None else \
            _counts(ctx, b, self_, idx, src, emit)
        if out is not None:
            return out
    return generic_expand(ctx, b, op, args, kwargs)


@register_rule(aten.index_add.default, aten.index_add_.default)
def _index_add(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    bound = _bind(op, args, kwargs)
    self_, dim, idx, src = bound["self"], bound["dim"], bound["index"], bound["source"]
    if dim == 0 and isinstance(idx, TensorArg):
        alpha = bound.get("alpha", 1)

        def emit(s: Any, i: Any, v: Any) -> Any:
            return b.call(op, s, 0, i, v, alpha=alpha) if alpha != 1 else b.call(op, s, 0, i, v)

        out = put_by_rows(ctx, b, op, self_, idx, src, True, emit) if idx.rows is not None and idx.rows.into is not None else \
            _counts(ctx, b, self_, idx, src, emit)
        if out is not None:
            return out
    summed = partial_index_add(ctx, b, op, args, kwargs) if op is aten.index_add.default else None
    return summed if summed is not None else generic_expand(ctx, b, op, args, kwargs)


# ---------------------------------------------------------------- row numbers of fewer rows
_FLOOR = [aten.floor_divide.default, aten.floor_divide.Scalar] if hasattr(aten.floor_divide, "Scalar") else [aten.floor_divide.default]


@register_rule(*_FLOOR, aten.div.Tensor_mode, aten.div.Scalar_mode)
def _floor_divide(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``perm // top_k``: the row numbers of the tokens the routed rows came from."""
    x, other = args[0], args[1]
    r = x.rows if isinstance(x, TensorArg) else None
    mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
    floor = op in _FLOOR or mode == "floor"
    if r is None or r.into is None or not floor or not isinstance(other, int) or isinstance(other, bool) or other <= 0:
        return generic_expand(ctx, b, op, args, kwargs)
    node = b.call(op, x.node, other, **kwargs)
    return _out(b, node, _spec(ctx, x.spec.placements, tuple(x.spec.shape), x.spec.tensor_meta.dtype),
                r.replace(div=r.div * other))

