"""Factory ops: tensors built from sizes (zeros, ones, full, empty, arange, new_*).

They have no distributed input, so DTensor cannot place them. When a size argument is a
:class:`DSymInt` split over mesh axes (``torch.zeros(x.size(0), k)`` with a sharded
batch), the result is built sharded along that dim with local sizes: no global tensor is
ever materialized. Constant fills are correct under any placement; ``arange`` gets this
rank's offset from the runtime coordinate.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import SubgraphBuilder
from ..args import ExpandContext, ScalarArg, _out_tensor
from ..registry import register_rule
from ..values import DSymInt

aten = torch.ops.aten

_FILLS = [
    aten.zeros.default,
    aten.ones.default,
    aten.empty.memory_format,
    aten.full.default,
]
_NEW = [aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default]


def _g(x: Any) -> Any:
    if isinstance(x, ScalarArg):  # a run-time number (torch.as_tensor(step.item() * 2))
        return x.node
    return x.global_value if isinstance(x, DSymInt) else x


def _choose_placements(ctx: ExpandContext, sizes: list[Any]) -> list[Any]:
    """Shard dim d on the axes its DSymInt is split over (first come, first served)."""
    placements: list[Any] = [pt.Replicate()] * ctx.mctx.ndim
    for d, s in enumerate(sizes):
        if isinstance(s, DSymInt) and s.is_sharded:
            free = all(isinstance(placements[a], pt.Replicate) for a in s.axes)
            if free:
                for a in s.axes:
                    placements[a] = pt.Shard(d)
    return placements


def contiguous_stride(shape: Any) -> tuple[Any, ...]:
    """torch's contiguous strides for ``shape`` (an empty dim counts as 1). Sizes may be
    SymInts (dynamic=True): computed with sym_max, as the fake kernels do, since ``int()``
    of a size symbol records a guard that fixes it to the example's value."""
    out, step = [], 1
    for s in reversed(tuple(shape)):
        out.append(step)
        step = step * (torch.sym_max(s, 1) if isinstance(s, torch.SymInt) else max(int(s), 1))
    return tuple(reversed(out))


def _size(s: Any) -> Any:
    """A global size argument: an int, or a SymInt under dynamic=True (kept symbolic)."""
    g = _g(s)
    return g if pt.is_symbolic(g) else int(g)


def _differs(a: Any, b: Any) -> bool:
    """Whether two local sizes may differ; symbolic ones compare as expressions (no
    guard): different expressions count as different, the safe answer (replicate)."""
    if pt.is_symbolic(a) and pt.is_symbolic(b):
        return pt.sym_expr(a) != pt.sym_expr(b)
    if pt.is_symbolic(a) or pt.is_symbolic(b):
        return True
    return int(a) != int(b)


def _sharded_sizes(ctx: ExpandContext, b: SubgraphBuilder, sizes: list[Any]) -> tuple[list[int], list[Any]]:
    global_sizes = [_size(s) for s in sizes]
    placements = _choose_placements(ctx, sizes)
    local = list(b.local_shape(global_sizes, placements))
    # a DSymInt's own local value must agree with the layout we chose; else replicate it
    for d, s in enumerate(sizes):
        if isinstance(s, DSymInt) and s.is_sharded and any(isinstance(placements[a], pt.Shard) and placements[a].dim == d for a in s.axes):
            if _differs(local[d], s.local_value):
                placements = [pt.Replicate() if (isinstance(p, pt.Shard) and p.dim == d) else p for p in placements]
                local = list(b.local_shape(global_sizes, placements))
    return local, placements


def _result(ctx: ExpandContext, b: SubgraphBuilder, node: Any, global_sizes: list[int], placements: list[Any]) -> Any:
    val = node.meta["val"]
    stride = contiguous_stride(global_sizes)
    spec = pt.make_spec(ctx.mctx.mesh, placements, global_sizes, stride, val.dtype)
    return _out_tensor(b, node, spec, {})


@register_rule(*_FILLS)
def _fill(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    sizes = list(args[0])
    local, placements = _sharded_sizes(ctx, b, sizes)
    rest = tuple(_g(a) for a in args[1:])
    node = b.call(op, local, *rest, **kwargs)
    return _result(ctx, b, node, [_size(s) for s in sizes], placements)


@register_rule(*_NEW)
def _new(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    self_arg, sizes = args[0], list(args[1])
    local, placements = _sharded_sizes(ctx, b, sizes)
    rest = tuple(_g(a) for a in args[2:])
    node = b.call(op, self_arg.node, local, *rest, **kwargs)
    return _result(ctx, b, node, [_size(s) for s in sizes], placements)


@register_rule(aten.scalar_tensor.default)
def _scalar_tensor(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    node = b.call(op, *[_g(a) for a in args], **kwargs)
    return _result(ctx, b, node, [], [pt.Replicate()] * ctx.mctx.ndim)


@register_rule(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    if op is aten.arange.default:
        start, end, step = 0, args[0], 1
    elif op is aten.arange.start:
        start, end, step = args[0], args[1], 1
    else:
        start, end, step = args
    plain = [_g(start), _g(end), _g(step)]
    sharded = isinstance(end, DSymInt) and len(end.axes) == 1 and _g(start) == 0 and _g(step) == 1 and not isinstance(start, DSymInt)
    sharded = sharded and not ctx.mctx.head_tail(end.axes[0])  # head-tail positions: whole (split where it meets a split value)
    if not sharded:
        node = b.call(aten.arange.start_step, *plain, **kwargs)
        n = node.meta["val"].shape[0]
        return _result(ctx, b, node, [n], [pt.Replicate()] * ctx.mctx.ndim)
    axis = end.axes[0]
    total = end.global_value
    local = b.local_chunk(total, axis)
    offset = b.shard_offset(total, axis)  # uneven or symbolic: clamped (no guard)
    stop = b.call(operator.add, offset, local)
    node = b.call(aten.arange.start_step, offset, stop, 1, **kwargs)
    placements = [pt.Replicate()] * ctx.mctx.ndim
    placements[axis] = pt.Shard(0)
    return _result(ctx, b, node, [total], placements)
