"""Random ops: every rank draws what the single-device program draws.

The RNG contract (``docs/randomness.md``): a compiled step's random numbers are those of
the same step on one device, whatever the placements.

``rng="exact"`` (the default). On one device ``dropout(x)`` draws one number per
element of the *global* ``x``, in order, from the generator. A rank holding a shard of
``x`` draws the same global tensor (from a generator every rank agrees on, see
:mod:`spmd_compiler.driver.guard`) and keeps its slice: a Replicate value gets the same
numbers on every rank, a shard gets the numbers the single-device program drew for its
elements, and the generator advances by exactly what one device's does, so the next
step matches too. The cost is drawing the global tensor on every rank (O(global
elements) per random op, no communication); on CPU, whose generator (Mersenne Twister)
cannot skip ahead, it is the only exact way.

``rng="fast"``. A rank draws only its local elements, from a generator seeded per shard
(one seed drawn from the agreed generator, the same on every rank, combined with the
shard's index): Replicate values still get the same numbers on every rank and shards
different ones, but the numbers are not the single-device ones. Costs O(local elements).

Random ops with no rule here run on gathered inputs (the replicate fallback), which is
exact too: the op sees the global tensors on every rank.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from ... import _private_torch as pt
from ..builder import SubgraphBuilder
from .factory import _sharded_sizes, _size, contiguous_stride as _contiguous_stride
from ..args import ExpandContext, NoStrategy, TensorArg, _out_tensor
from ..redistribute import emit_redistribute
from ..registry import register_rule
from ..values import DSymInt

aten = torch.ops.aten
log = logging.getLogger(__name__)

__all__ = ["RNG_MODES", "is_random", "shard_generator_draw"]

RNG_MODES = ("exact", "fast")

_LIKE = [aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype]
_FILL_INPLACE = [aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.exponential_.default,
                 aten.cauchy_.default, aten.log_normal_.default, aten.geometric_.default]
_FACTORY = [aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low]


def is_random(node: fx.Node) -> bool:
    """``node`` draws from a random generator (an aten random op or a fast-mode draw)."""
    if node.op != "call_function":
        return False
    t = node.target
    if t is shard_generator_draw:
        return True
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


# ---------------------------------------------------------------------- helpers
def _slice_spec(ctx: ExpandContext, placements: Any, shape: Any, stride: Any, dtype: torch.dtype) -> Any:
    """Where each rank's slice of a fresh global draw goes: the value's shards, Replicate
    on axes where the value is Partial (a draw is never a partial sum)."""
    kept = [p if p.is_shard() else pt.Replicate() for p in placements]
    return pt.make_spec(ctx.mctx.mesh, kept, shape, stride, dtype)


def _replicated(ctx: ExpandContext, shape: Any, stride: Any, dtype: torch.dtype) -> Any:
    return pt.make_spec(ctx.mctx.mesh, [pt.Replicate()] * ctx.mctx.ndim, shape, stride, dtype)


def _local_slice(ctx: ExpandContext, b: SubgraphBuilder, whole: fx.Node, dst: Any, why: str) -> fx.Node:
    """This rank's slice of a global tensor every rank holds (a local op, no collective)."""
    v = whole.meta["val"]
    node, _ = emit_redistribute(b, whole, _replicated(ctx, v.shape, v.stride(), v.dtype), dst, reason=why)
    return node


def _check_tensor(x: Any, op: Any) -> TensorArg:
    if not isinstance(x, TensorArg) or any(isinstance(p, pt.MaskPartial) for p in x.spec.placements):
        raise NoStrategy(f"{op}: a masked partial input")  # the replicate fallback is exact
    return x


class _Layout(NamedTuple):
    """A global tensor's concrete layout (traced values may have symbolic sizes)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: Any


def _like(x: TensorArg, dtype: torch.dtype | None = None) -> _Layout:
    """The layout of a tensor made like global ``x`` (same sizes and strides)."""
    return _Layout(tuple(x.spec.shape), tuple(x.spec.stride), dtype or x.spec.tensor_meta.dtype, x.local.device)


def _traced_dtype(ctx: ExpandContext, index: int | None = None) -> torch.dtype:
    val = ctx.node.meta["val"]
    return (val[index] if index is not None else val).dtype


def _traced_device(ctx: ExpandContext) -> Any:
    val = ctx.node.meta["val"]
    return (val[0] if isinstance(val, (tuple, list)) else val).device


def _shard_index(ctx: ExpandContext, b: SubgraphBuilder, placements: Any) -> Any:
    """A run-time int that tells apart the shards of a value with ``placements`` (0 on
    every rank for a replicated value): the linear index over the axes it is sharded on."""
    index: Any = 0
    for axis, p in enumerate(placements):
        if p.is_shard():
            index = b.call(operator.add, b.call(operator.mul, index, ctx.mctx.shape[axis]), b.coords[axis])
    return index


def shard_generator_draw(fill: Any, like: torch.Tensor, shard: int, args: tuple) -> torch.Tensor:
    """``rng="fast"``: ``fill`` (an in-place random op) on a fresh tensor laid out like the
    local ``like``, from a generator seeded by one draw of the CPU default generator (the
    same draw on every rank, so the generators stay in step) and the ``shard`` index."""
    seed = int(torch.randint(0, 2**62, ()).item())
    gen = torch.Generator(device=like.device).manual_seed((seed + 0x9E3779B97F4A7C15 * (shard + 1)) % 2**63)
    return fill(torch.empty_like(like), *args, generator=gen)


# the in-place fill a random op amounts to, for rng="fast" (which needs a generator argument)
_AS_FILL = {
    aten.rand_like.default: (aten.uniform_.default, 0),
    aten.randn_like.default: (aten.normal_.default, 0),
    aten.randint_like.default: (aten.random_.to, 1),
    aten.randint_like.low_dtype: (getattr(aten.random_, "from"), 2),
    aten.rand.default: (aten.uniform_.default, 0),
    aten.randn.default: (aten.normal_.default, 0),
    aten.randint.default: (aten.random_.to, 1),
    aten.randint.low: (getattr(aten.random_, "from"), 2),
}


def _draw(ctx: ExpandContext, b: SubgraphBuilder, op: Any, op_args: tuple, op_kwargs: dict, val: Any, dst: Any) -> fx.Node:
    """This rank's part, laid out as ``dst``, of random ``op`` applied to a fresh tensor
    laid out like the global traced value ``val`` (``op(empty_strided(...), *op_args)``):
    the global draw sliced (exact), or a per-shard draw of the local part (fast)."""
    if ctx.rng == "fast":
        fill, nargs = _AS_FILL.get(op, (op, len(op_args)))
        local = b.local_shape(val.shape, dst.placements)
        like = b.call(aten.empty.memory_format, list(local), dtype=val.dtype, device=val.device)
        shard = _shard_index(ctx, b, dst.placements)
        with ctx.fake_mode:
            fake = fill(torch.empty_like(like.meta["val"]), *op_args[:nargs])
        return b.call(shard_generator_draw, fill, like, shard, tuple(op_args[:nargs]), _val=fake)
    whole = b.call(aten.empty_strided.default, list(val.shape), list(val.stride), dtype=val.dtype, device=val.device)
    whole = b.call(op, whole, *op_args, **op_kwargs)
    return _local_slice(ctx, b, whole, dst, f"slice of a global random draw ({op})")


def _g(x: Any) -> Any:
    return x.global_value if isinstance(x, DSymInt) else x


# ---------------------------------------------------------------------- rules
@register_rule(aten.native_dropout.default)
def _native_dropout(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``native_dropout(x, p, train)`` = ``x * (mask * 1/(1-p))``: the scaled mask is the
    dropout of a global tensor of ones, sliced; ``x * 1 * s`` rounds as ``x * s``, so the
    product is bit-identical to the single-device kernel's ``x.mul(mask).mul_(s)``."""
    x = _check_tensor(args[0], op)
    p = args[1] if len(args) > 1 else kwargs["p"]
    train = args[2] if len(args) > 2 else kwargs.get("train")
    out_val = _like(x)
    shape, contiguous = out_val.shape, _contiguous_stride(out_val.shape)
    mask_dtype = _traced_dtype(ctx, 1)
    dst = _slice_spec(ctx, x.spec.placements, shape, contiguous, out_val.dtype)
    mask_dst = pt.make_spec(ctx.mctx.mesh, dst.placements, shape, contiguous, mask_dtype)
    if train is False:  # no draw: the identity and an all-true mask
        pair = b.call(op, x.node, p, False)
        out, mask = b.getitems(pair)
    else:
        if ctx.rng == "fast":
            keep = _draw(ctx, b, aten.bernoulli_.float, (1.0 - p,), {}, out_val._replace(stride=contiguous), dst)
            scaled = b.call(aten.mul.Tensor, keep, 0.0 if p == 1 else 1.0 / (1.0 - p))
            mask = b.call(aten._to_copy.default, keep, dtype=mask_dtype)
        else:
            ones = b.call(aten.ones.default, list(shape), dtype=out_val.dtype, device=out_val.device)
            scaled_g, mask_g = b.getitems(b.call(op, ones, p, True))
            scaled = _local_slice(ctx, b, scaled_g, dst, "slice of the global dropout mask")
            mask = _local_slice(ctx, b, mask_g, mask_dst, "slice of the global dropout mask")
        out = b.call(aten.mul.Tensor, x.node, scaled)
    return (_out_tensor(b, out, x.spec, {}), _out_tensor(b, mask, mask_dst, {}))


@register_rule(*_LIKE)
def _random_like(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``rand_like(x)`` and friends: the draw fills a tensor laid out like the global ``x``."""
    x = _check_tensor(args[0], op)
    val = _like(x, _traced_dtype(ctx))
    dst = _slice_spec(ctx, x.spec.placements, val.shape, val.stride, val.dtype)
    kw = {k: v for k, v in kwargs.items() if k not in ("layout", "device", "pin_memory", "memory_format")}
    node = _draw(ctx, b, op, tuple(_g(a) for a in args[1:]), kw, val, dst)
    return _out_tensor(b, node, dst, {})


@register_rule(*_FILL_INPLACE)
def _random_fill(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``x.uniform_()`` and friends overwrite ``x``: its local part is copied from the draw."""
    x = _check_tensor(args[0], op)
    if any(p.is_partial() for p in x.spec.placements):
        raise NoStrategy(f"{op} on a Partial value")  # the replicate fallback is exact
    val = _like(x)
    dst = _slice_spec(ctx, x.spec.placements, val.shape, val.stride, val.dtype)
    node = _draw(ctx, b, op, tuple(_g(a) for a in args[1:]), dict(kwargs), val, dst)
    written = b.call(aten.copy_.default, x.node, node)
    return _out_tensor(b, written, x.spec, {})


@register_rule(*_FACTORY)
def _random_factory(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.rand(n, k)`` inside the step: drawn whole and sliced, sharded like a sized
    factory when a size is a sharded batch size."""
    randint = op in (aten.randint.default, aten.randint.low)
    sizes = list(args[-1] if randint else args[0])
    bounds = tuple(_g(a) for a in args[:-1]) if randint else ()
    _, placements = _sharded_sizes(ctx, b, sizes)
    shape = tuple(_size(s) for s in sizes)  # SymInts under dynamic=True: int() would pin them
    val = _Layout(shape, _contiguous_stride(shape), _traced_dtype(ctx), _traced_device(ctx))
    dst = _slice_spec(ctx, placements, val.shape, val.stride, val.dtype)
    if ctx.rng == "fast":
        node = _draw(ctx, b, op, bounds, {}, val, dst)
    else:
        whole = b.call(op, *bounds, list(shape), **kwargs)
        node = _local_slice(ctx, b, whole, dst, f"slice of a global random draw ({op})")
    return _out_tensor(b, node, dst, {})


@register_rule(aten.bernoulli.p)
def _bernoulli_p(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.bernoulli(x, p)`` with a scalar ``p`` draws like ``bernoulli_(p)`` on a
    tensor laid out like ``x`` (whose values are not read)."""
    x = _check_tensor(args[0], op)
    val = _like(x, _traced_dtype(ctx))
    dst = _slice_spec(ctx, x.spec.placements, val.shape, val.stride, val.dtype)
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    node = _draw(ctx, b, aten.bernoulli_.float, (p,), {}, val, dst)
    return _out_tensor(b, node, dst, {})
