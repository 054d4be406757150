"""Size-taking ops whose input DTensor cannot say how to split the result.

``x.expand(batch, k)`` on a replicated ``x`` of size 1 in the batch dim: DTensor would
build the global ``[batch, k]`` tensor replicated on every rank. When ``batch`` is a
:class:`DSymInt` split over a mesh axis, we expand straight to the local size and mark the
result ``Shard`` on that dim: broadcasting a replicated value makes every shard equal to
the local expand. A ``Partial`` sum broadcast that way is reduced first (a few numbers,
where the broadcast result would be reduced at its full size later).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import SubgraphBuilder
from ..args import ExpandContext, _out_tensor
from ..dispatch import generic_expand
from ..fallback import reduce_partial_axes
from ..registry import register_rule
from ..values import DSymInt

aten = torch.ops.aten


@register_rule(aten.expand.default)
def _expand(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    x, sizes = args[0], list(args[1])
    in_shape = list(x.spec.shape)
    new_dims = len(sizes) - len(in_shape)
    targets, partial = [], set()
    for d, s in enumerate(sizes):
        if isinstance(s, DSymInt) and s.is_sharded:
            src = d - new_dims
            # a symbolic size (dynamic=True) broadcasts only when provably 1: else DTensor's expand
            broadcast = src < 0 or pt.false_unless_proven_true(in_shape[src] == 1)
            if broadcast and all(x.spec.placements[a].is_replicate() for a in s.axes):
                targets.append((d, s))
            elif broadcast and all(x.spec.placements[a].is_replicate() or x.spec.placements[a].is_partial() for a in s.axes):
                partial |= {a for a in s.axes if x.spec.placements[a].is_partial()}
    if partial and all(getattr(x.spec.placements[a], "reduce_op", None) == "sum" for a in partial):
        # a Partial sum broadcast over split rows (the backward of a mean over a batch-split
        # dim): reduce the small value first; its broadcast is then each rank's own rows,
        # where a Partial broadcast would be reduce-scattered at full size later
        args, kwargs = reduce_partial_axes(ctx, b, args, kwargs, sorted(partial),
                                           "a Partial sum reduced before it is broadcast over split rows")
        return _expand(ctx, b, op, args, kwargs)
    if not targets:
        return generic_expand(ctx, b, op, args, kwargs)
    placements = [pt.Shard(p.dim + new_dims) if isinstance(p, pt.Shard) else p for p in x.spec.placements]
    for d, s in targets:
        if all(placements[a].is_replicate() for a in s.axes):
            for a in s.axes:
                placements[a] = pt.Shard(d)
    global_sizes = []
    for d, s in enumerate(sizes):
        g = s.global_value if isinstance(s, DSymInt) else int(s)
        global_sizes.append(in_shape[d - new_dims] if g == -1 else g)
    local = list(b.local_shape(global_sizes, placements))
    if any(local[d] != s.local_value for d, s in targets if isinstance(placements[s.axes[0]], pt.Shard)):
        return generic_expand(ctx, b, op, args, kwargs)
    node = b.call(aten.expand.default, x.node, local)
    symbolic = any(pt.is_symbolic(v) for v in (*in_shape, *global_sizes, *x.spec.stride))
    with b.fake_mode if symbolic else contextlib.nullcontext():  # dynamic=True: sizes of the trace's ShapeEnv
        stride = torch.empty_strided(in_shape, tuple(x.spec.stride), device="meta").expand(global_sizes).stride()
    spec = pt.make_spec(ctx.mctx.mesh, placements, global_sizes, stride, x.spec.tensor_meta.dtype)
    return _out_tensor(b, node, spec, {})


@register_rule(aten.slice_backward.default)
def _slice_backward(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """The backward of ``x[:, a:b]`` scatters the gradient into zeros of the input size.

    A full-range slice (``x[:]``, ``start=0, end>=size, step=1``) along a sharded dim is
    the identity, so the gradient keeps its placement and the input size is taken
    locally; DTensor would gather the gradient instead.
    """
    grad, sizes, dim, start, end, step = (list(args) + [None] * 6)[:6]
    global_sizes = [s.global_value if isinstance(s, DSymInt) else int(s) for s in sizes]
    dim = dim % len(global_sizes)
    # start/end/step may be DSymInts (``x[:, : t - 1]`` with ``t = x.shape[1]``): global values
    g_start, g_end, g_step = (v.global_value if isinstance(v, DSymInt) else v for v in (start, end, step))
    full = g_start in (0, None) and (g_end is None or g_end >= global_sizes[dim]) and g_step in (1, None)
    sharded_here = any(getattr(p, "dim", None) == dim and p.is_shard() for p in grad.spec.placements)
    if not (full and sharded_here):
        return generic_expand(ctx, b, op, args, kwargs)
    local = list(b.local_shape(global_sizes, grad.spec.placements))
    # the whole local dim (an end read from a split size, ``x[:t]`` with ``t = ids.shape[1]``, is a DSymInt)
    node = b.call(op, grad.node, local, dim, 0, local[dim], 1)
    stride = torch.empty(global_sizes, device="meta").stride()
    spec = pt.make_spec(ctx.mctx.mesh, grad.spec.placements, global_sizes, stride, grad.spec.tensor_meta.dtype)
    return _out_tensor(b, node, spec, {})
