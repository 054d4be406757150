"""``torch._grouped_mm``: every expert's matmul on its contiguous group of routed rows.

Layouts (:mod:`spmd_compiler._private_torch.grouped_mm`): the experts' forward multiplies
routed rows ``a`` (rows, k) by stacked expert weights ``b`` (experts, k, n), row group
``e`` (ending at ``offs[e]``) by ``b[e]``; the weight gradient contracts the groups of
``a`` (m, rows) and ``b`` (rows, n) into (experts, m, n).

On the token axes (:mod:`..orders`) the rows are a rank's own routed rows in its sorted
order and ``offs`` its own cumulative counts (a ``Partial(sum)`` whose local term is the
rank's, ``restricted``): each rank runs the experts on its rows, rows stay rows, and the
weight gradient is a ``Partial`` sum over ranks. On the other axes it is a matmul: the
experts' hidden dim split (``b`` sharded on ``n``, or both on ``k``) as in Megatron. A
split fused dim (gate|up stored as one weight, split by ``chunk``) keeps its pieces'
strided layout through the matmuls that do not contract it; where one does (the
gradient of the routed rows, ``k`` strided in ``a``, a plain ``Shard`` in the weight),
``a`` moves to the weight's layout on that axis alone (one all_to_all), so the rows stay
where the token axes have them (expert parallelism x tensor parallelism). A weight stored
by ``fused_shard`` has the pieces' layout already: two operands contracting the same
strided layout give a Partial sum, and nothing moves.
Expert parallelism (``b`` split over the experts on a token axis) sends the rows to their
experts' ranks first (:mod:`..experts`). Anything else goes to DTensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ... import _private_torch as pt
from ..args import ExpandContext, TensorArg
from ..builder import SubgraphBuilder
from ..dispatch import generic_expand
from ..orders import Order, Rows, merge_origins
from ..redistribute import emit_redistribute
from ..registry import register_rule
from .routing import _out, _spec

__all__ = ["grouped_mm_placements", "contracted_like_weight"]


def _order(t: TensorArg) -> Order | None:
    r = t.rows
    return r.order if r is not None and r.order is not None and not r.order.canonical else None


def _offsets_ok(offs: Any, axes: tuple[int, ...]) -> bool:
    """``offs`` is each rank's own cumulative counts on the token ``axes``, the same
    everywhere else."""
    if not isinstance(offs, TensorArg) or offs.rows is None:
        return False
    return (set(axes) <= set(offs.rows.restricted)
            and all(p.is_partial() if a in axes else p.is_replicate() for a, p in enumerate(offs.spec.placements)))


def grouped_mm_placements(a: Any, b: Any, axes: tuple[int, ...], ndim: int, expert_axes: tuple[int, ...] = ()) -> list[Any] | None:
    """The result's placements of ``_grouped_mm(a, b, offs)`` with the rows split on token
    ``axes`` (and ``b``'s experts on ``expert_axes``, rows already at their experts), or
    None when some axis has no local form."""
    two_d = len(b.spec.shape) == 2
    out = []
    for axis in range(ndim):
        pa, pb = a.spec.placements[axis], b.spec.placements[axis]
        if axis in axes:
            if two_d:  # weight gradient: a (m, rows), b (rows, n)
                if not (pa == pt.Shard(1) and pb == pt.Shard(0)):
                    return None
                out.append(pt.Shard(0) if axis in expert_axes else pt.Partial("sum"))
            else:
                if pa != pt.Shard(0) or not (pb.is_replicate() or (axis in expert_axes and pb == pt.Shard(0))):
                    return None
                out.append(pt.Shard(0))
            continue
        strided = _strided_out(pa, pb, two_d)
        if strided is not None:  # a split fused dim (gate|up stored as one weight): its rows keep their layout
            out.append(strided)
        elif pa.is_partial() and pb.is_replicate() or pa.is_replicate() and pb.is_partial():
            out.append(pt.Partial("sum"))
        elif pa.is_replicate() and pb.is_replicate():
            out.append(pt.Replicate())
        elif two_d and pa == pt.Shard(0) and pb.is_replicate():
            out.append(pt.Shard(1))
        elif two_d and pa.is_replicate() and pb == pt.Shard(1):
            out.append(pt.Shard(2))
        elif not two_d and pa.is_replicate() and pb == pt.Shard(2):
            out.append(pt.Shard(1))
        elif not two_d and (pa == pt.Shard(1) and pb == pt.Shard(1) or _same_strided(pa, pb, 1)):
            out.append(pt.Partial("sum"))
        else:
            return None
    return out


def _same_strided(pa: Any, pb: Any, dim: int) -> bool:
    """Both operands split their contracted dim (``a``'s 1, ``b``'s ``dim``) in the same
    strided layout (a fused weight stored as its pieces' blocks, :func:`spmd_compiler.fused_shard`):
    each rank holds the same indices of it in both, so its products are a Partial sum."""
    return (isinstance(pa, pt.StridedShard) and isinstance(pb, pt.StridedShard) and pa.dim == 1 and pb.dim == dim
            and pa.split_factor == pb.split_factor)


def _strided_out(pa: Any, pb: Any, two_d: bool) -> Any:
    """The result's ``_StridedShard`` when the split dim of ``a`` (weight gradient: its m
    rows) or ``b`` (forward: its n columns; weight gradient: its n columns) is one, the
    other operand whole; else None."""
    if two_d and isinstance(pa, pt.StridedShard) and pa.dim == 0 and pb.is_replicate():
        return pt.StridedShard(1, split_factor=pa.split_factor)
    if two_d and pa.is_replicate() and isinstance(pb, pt.StridedShard) and pb.dim == 1:
        return pt.StridedShard(2, split_factor=pb.split_factor)
    if not two_d and pa.is_replicate() and isinstance(pb, pt.StridedShard) and pb.dim == 2:
        return pt.StridedShard(1, split_factor=pb.split_factor)
    return None


def contracted_like_weight(a: Any, b: Any, axes: tuple[int, ...], ndim: int) -> list[Any] | None:
    """The placements ``a`` (rows, k) of a forward-shaped ``_grouped_mm`` needs so that
    its contracted ``k`` is split as the weight ``b`` (experts, k, n) splits it, where
    ``a`` has a fused dim's strided layout (``_StridedShard(1, sf)``) on a mesh axis off
    the token ``axes`` and ``b`` a plain ``Shard(1)``; None when no such axis."""
    if len(b.spec.shape) != 3:
        return None
    want = list(a.spec.placements)
    for axis in range(ndim):
        pa, pb = a.spec.placements[axis], b.spec.placements[axis]
        if axis not in axes and isinstance(pa, pt.StridedShard) and pa.dim == 1 and pb == pt.Shard(1):
            want[axis] = pt.Shard(1)
    return want if want != list(a.spec.placements) else None


def _align_contracted(ctx: ExpandContext, b: SubgraphBuilder, a: TensorArg, w: TensorArg, axes: tuple[int, ...]) -> TensorArg:
    """``a`` moved (off the token ``axes`` only) to :func:`contracted_like_weight`'s
    placements; its rows keep their order, which lives on the token axes."""
    want = contracted_like_weight(a, w, axes, ctx.mctx.ndim)
    if want is None:
        return a
    dst = pt.make_spec(ctx.mctx.mesh, want, a.spec.shape, a.spec.stride, a.spec.tensor_meta.dtype)
    node, mask = emit_redistribute(b, a.node, a.spec, dst, mask=a.mask, reason="input 0 of _grouped_mm.default, its contracted dim "
                                   "split as the weight's", input_index=a.index, value_label=a.label)
    return dataclasses.replace(a.moved(node, dst, mask), rows=a.rows)


@register_rule(pt.GROUPED_MM)
def _grouped_mm(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    bound = {"offs": None, "bias": None, "out_dtype": None}
    bound.update(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), args))
    bound.update(kwargs)
    a, w, offs = bound["mat_a"], bound["mat_b"], bound["offs"]
    if bound["bias"] is not None or not isinstance(a, TensorArg) or not isinstance(w, TensorArg) or len(a.spec.shape) != 2:
        return generic_expand(ctx, b, op, args, kwargs)
    if _strided_whole_rows(a, w, offs):  # rows whole on every rank, a fused dim split: keep its layout
        placements = grouped_mm_placements(a, w, (), ctx.mctx.ndim)
        if placements is not None:
            return _emit(ctx, b, op, a, w, offs, bound["out_dtype"], placements, (), None)
    order = _order(a) if len(w.spec.shape) == 3 else (_order(a), _order(w))
    if len(w.spec.shape) == 2:
        if order[0] is None or order[0] != order[1]:
            return generic_expand(ctx, b, op, args, kwargs)
        order = order[0]
    if order is None or not _offsets_ok(offs, order.axes):
        return generic_expand(ctx, b, op, args, kwargs)
    a = _align_contracted(ctx, b, a, w, order.axes)
    expert_axes = (order.dispatched,) if order.dispatched is not None else ()
    placements = grouped_mm_placements(a, w, order.axes, ctx.mctx.ndim, expert_axes)
    if placements is None:
        return generic_expand(ctx, b, op, args, kwargs)
    return _emit(ctx, b, op, a, w, offs, bound["out_dtype"], placements, expert_axes, order)


def _strided_whole_rows(a: Any, w: Any, offs: Any) -> bool:
    """No token split (``offs`` the same everywhere, no row order) and some operand a
    ``_StridedShard``: DTensor has no grouped_mm strategy for that layout (it gathers)."""
    if not isinstance(offs, TensorArg) or not all(p.is_replicate() for p in offs.spec.placements):
        return False
    if _order(a) is not None:
        return False
    return any(isinstance(p, pt.StridedShard) for t in (a, w) for p in t.spec.placements)


def _emit(ctx: ExpandContext, b: SubgraphBuilder, op: Any, a: Any, w: Any, offs: Any, out_dtype: Any, placements: list[Any],
          expert_axes: tuple[int, ...], order: Order | None) -> Any:
    node = b.call(op, a.node, w.node, offs.node, **({"out_dtype": out_dtype} if out_dtype is not None else {}))
    shape = list(pt.grouped_mm_out_shape(_Shape(a.spec.shape), _Shape(w.spec.shape), _Shape(offs.spec.shape)))
    if len(w.spec.shape) == 2:  # (experts, m, n): the local experts' offsets count this rank's experts only
        for axis in expert_axes:
            shape[0] = shape[0] * ctx.mctx.shape[axis]
    spec = _spec(ctx, placements, shape, node.meta["val"].dtype)
    rows = Rows(order=order, origins=merge_origins(a, w, offs)) if len(w.spec.shape) == 3 and order is not None else None
    return _out(b, node, spec, rows)


class _Shape:
    """A global shape with the ``dim``/``size`` a shape function asks of a tensor."""

    def __init__(self, shape: Any) -> None:
        self.shape = tuple(shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, d: int) -> Any:
        return self.shape[d]
