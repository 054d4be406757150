"""Placement changes on a mesh axis with the head-tail (load-balanced) layout.

With ``ContextParallel(load_balance=True)`` (:mod:`spmd_compiler.plan.context`) a dim of
size ``L`` split over the context-parallel axis of ``n`` ranks is cut into ``2 n`` chunks
of ``c = L / (2 n)`` and rank ``r`` holds chunks ``r`` and ``2 n - 1 - r``, in that order;
``_StridedShard(d, sf)`` does the same within each of its ``sf`` blocks. A replicated
value is whole and in order. So:

* Replicate -> split: the rank's two chunks, two ``narrow`` at run-time offsets
  (``coord * c`` and ``(2 n - 1 - coord) * c``) and a ``cat``;
* split -> Replicate: all_gather (rank-major: every rank's head, tail), then the heads in
  rank order followed by the tails in reverse rank order;
* Partial -> split: the whole partial value put in rank-major head-tail order, then
  reduce_scatter.

Other changes go through Replicate. Uneven sizes have no head-tail layout: a dim that
``2 n`` (``2 n sf``) does not divide is an :class:`~spmd_compiler.errors.UnsupportedPlacementError`
naming the size and the fix.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..errors import UnsupportedPlacementError
from .builder import SubgraphBuilder
from .collectives import _all_gather, _contiguous, _reduce_scatter

__all__ = ["split_of", "to_head_tail", "from_head_tail", "reduce_scatter_head_tail"]

aten = torch.ops.aten


def split_of(p: Any) -> tuple[int, int] | None:
    """``(dim, split factor)`` of a Shard / _StridedShard placement, else None."""
    if isinstance(p, pt.StridedShard):
        if pt.split_period(p) is not None:
            raise UnsupportedPlacementError(
                f"{p} (a split in blocks of a symbolic batch, dynamic=True) on a context-parallel axis with the load-balanced "
                f"layout: expected Shard or _StridedShard of static sizes. fix: compile without dynamic=True, or "
                f"ContextParallel(load_balance=False)"
            )
        return p.dim, int(p.split_factor)
    if isinstance(p, pt.Shard):
        return p.dim, 1
    return None


def _chunk(b: SubgraphBuilder, axis: int, size: Any, sf: int, why: str) -> int:
    n = b.mctx.shape[axis]
    if pt.is_symbolic(size) or size % (2 * n * sf):
        raise UnsupportedPlacementError(
            f"{why}: a dim of size {size} split over context-parallel axis '{b.mctx.axis_names[axis]}' ({n} ranks) in the "
            f"load-balanced layout needs a multiple of 2 x {n}{f' x {sf} blocks' if sf > 1 else ''} = {2 * n * sf}. "
            f"fix: pad the sequence to a multiple of {2 * n * sf}, or ContextParallel(load_balance=False)"
        )
    return size // (2 * n * sf)


def _reshaped(b: SubgraphBuilder, x: fx.Node, d: int, parts: list[int]) -> fx.Node:
    shape = list(x.meta["val"].shape)
    return b.call(aten.reshape.default, x, shape[:d] + parts + shape[d + 1:])


def _merged(b: SubgraphBuilder, x: fx.Node, d: int, count: int) -> fx.Node:
    """Merge dims ``d .. d + count - 1`` of ``x`` into one."""
    shape = list(x.meta["val"].shape)
    size = 1
    for s in shape[d:d + count]:
        size *= s
    return b.call(aten.reshape.default, _contiguous(b, x), shape[:d] + [size] + shape[d + count:])


def to_head_tail(b: SubgraphBuilder, x: fx.Node, axis: int, d: int, sf: int, size: int, why: str) -> fx.Node:
    """Replicate -> this rank's head and tail chunk of dim ``d`` (of each of ``sf`` blocks)."""
    n = b.mctx.shape[axis]
    c = _chunk(b, axis, size, sf, why)
    y = _reshaped(b, x, d, [sf, 2 * n, c])
    coord = b.coords[axis]
    head = b.call(aten.narrow.default, y, d + 1, coord, 1)
    tail = b.call(aten.narrow.default, y, d + 1, b.call(operator.sub, 2 * n - 1, coord), 1)
    both = b.call(aten.cat.default, [head, tail], d + 1)  # [.., sf, 2, c, ..]
    return _merged(b, both, d, 3)


def from_head_tail(b: SubgraphBuilder, x: fx.Node, axis: int, d: int, sf: int, size: int, why: str) -> fx.Node:
    """This rank's chunks of dim ``d`` -> the whole dim in order (an all_gather)."""
    n = b.mctx.shape[axis]
    c = _chunk(b, axis, size, sf, why)
    g = _all_gather(b, x, axis, d, size, why)  # [.., n * sf * 2 * c, ..] rank-major
    g = _reshaped(b, g, d, [n, sf, 2, c])
    head = b.call(aten.select.int, g, d + 2, 0)  # [.., n, sf, c, ..]: chunks 0 .. n-1
    tail = b.call(aten.flip.default, b.call(aten.select.int, g, d + 2, 1), [d])  # chunks n .. 2n-1
    whole = b.call(aten.cat.default, [head, tail], d)  # [.., 2n, sf, c, ..]
    whole = b.call(aten.transpose.int, whole, d, d + 1)  # [.., sf, 2n, c, ..]
    return _merged(b, whole, d, 3)


def reduce_scatter_head_tail(b: SubgraphBuilder, x: fx.Node, axis: int, d: int, size: int, op: str, why: str) -> fx.Node:
    """A whole Partial value -> the sum of this rank's head and tail chunks of dim ``d``."""
    n = b.mctx.shape[axis]
    c = _chunk(b, axis, size, 1, why)
    y = _reshaped(b, x, d, [2 * n, c])
    head = b.call(aten.narrow.default, y, d, 0, n)
    tail = b.call(aten.flip.default, b.call(aten.narrow.default, y, d, n, n), [d])
    ordered = b.call(aten.stack.default, [head, tail], d + 1)  # [.., n, 2, c, ..]: rank-major
    return _reduce_scatter(b, _merged(b, ordered, d, 3), axis, d, size, op, why)
