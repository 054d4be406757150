"""Views that merge a sharded dim behind another one, kept split as ``_StridedShard``.

nn.MultiheadAttention reshapes its activations between ``(seq, batch, heads * head_dim)``
and ``(seq, batch * heads, head_dim)`` / ``(seq * batch, dim)``. With the batch split
(data parallel) or the heads split (tensor parallel), such a view merges the split dim
with a dim before it (or merges and re-splits the group). DTensor's view strategy keeps
a shard only where it stays the leading dim of its group (or for a plain flatten), and
otherwise gathers the input; yet no data moves between ranks: each rank's elements are
the same, in the same order, and only the way they are described changes.

Terms. A view pairs input and output dims in **groups**: runs of dims with the same
product (``(8, 4, 16) -> (32, 4, 4)`` has groups ``[8, 4] -> [32]`` and ``[16] -> [4,
4]``). Inside a group, read the elements as one flat row-major run. A placement
``Shard(d)`` (or ``_StridedShard(d, sf)``) of a dim of size ``s`` with ``C`` elements
behind it in its group gives rank ``r`` block ``r`` of ``n`` equal blocks in every
**period** of ``s * C / sf`` flat elements. The output dim ``e`` with ``C'`` elements
behind it describes that same pattern exactly when ``C'`` divides the block and the
period divides ``t_e * C'``: the output is ``_StridedShard(e, t_e * C' / period)``
(``Shard(e)`` when that factor is 1). The local tensor lists the rank's elements in
global order on both sides, so the local op is the same view to the local sizes.

Mesh axes apply left to right, each on the local tensor the earlier ones left (as
DTensor's ``_StridedShard`` does), so the rule walks the axes with local shapes. It
needs every split it touches to be even (a dim of 3 over 2 ranks has no period); where
one is not, or DTensor keeps the shards by itself, DTensor's strategy is used.
"""

from __future__ import annotations

import math
from typing import Any

import sympy
import torch

from ... import _private_torch as pt
from ..builder import SubgraphBuilder
from ..args import ExpandContext, TensorArg, _out_tensor
from ..dispatch import dtensor_keeps_inputs, generic_expand
from ..registry import register_rule
from ..values import DSymInt

aten = torch.ops.aten

__all__ = ["view_groups", "strided_view_placements"]


def view_groups(in_shape: list[int], out_shape: list[int]) -> list[tuple[list[int], list[int]]] | None:
    """Input and output dims paired in runs of equal product; None for an empty tensor
    or shapes of different numel. Trailing size-1 dims join the last group."""
    if 0 in in_shape or 0 in out_shape or math.prod(in_shape) != math.prod(out_shape):
        return None
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        gi, go, pi, po = [i], [j], in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            else:
                go.append(j)
                po *= out_shape[j]
                j += 1
        groups.append((gi, go))
    if not groups:
        return None
    groups[-1][0].extend(range(i, len(in_shape)))
    groups[-1][1].extend(range(j, len(out_shape)))
    return groups


def _placement_on(p: Any) -> tuple[int, int] | None:
    """(dim, split factor) of a Shard or _StridedShard placement."""
    if isinstance(p, pt.StridedShard):
        return p.dim, int(p.split_factor)
    if isinstance(p, pt.Shard):
        return p.dim, 1
    return None


def strided_view_placements(in_shape: list[int], out_shape: list[int], placements: Any, mesh_shape: Any) -> list[Any] | None:
    """Output placements of ``view(in_shape -> out_shape)`` that keep every shard of
    ``placements`` exactly (see the module docstring), or None where some shard has no
    exact description (an uneven split, a group cut through a block). Symbolic sizes
    (``dynamic=True``) also give None: any size may split unevenly, and asking would
    add a guard that pins the batch size."""
    if any(pt.is_symbolic(s) for s in (*in_shape, *out_shape)):
        return None
    in_local, out_local = list(in_shape), list(out_shape)
    out: list[Any] = []
    for axis, p in enumerate(placements):
        on = _placement_on(p)
        if on is None:
            out.append(p)
            continue
        d, sf, n = on[0], on[1], mesh_shape[axis]
        groups = view_groups(in_local, out_local)
        if groups is None or in_local[d] % (sf * n):
            return None
        gi, go = next(g for g in groups if d in g[0])
        behind = math.prod(in_local[k] for k in gi if k > d)
        period = in_local[d] * behind // sf
        block = period // n
        for e in go:
            behind_out = math.prod(out_local[k] for k in go if k > e)
            if block % behind_out == 0 and (out_local[e] * behind_out) % period == 0:
                factor = out_local[e] * behind_out // period
                out.append(pt.Shard(e) if factor == 1 else pt.StridedShard(e, split_factor=factor))
                in_local[d] //= n
                out_local[e] //= n
                break
        else:
            return None
    return out


def _sizes(x: TensorArg, sizes: Any) -> list[int] | None:
    """The global output sizes, -1 inferred; None when they do not fit the input."""
    out = [s.global_value if isinstance(s, DSymInt) else int(s) for s in sizes]
    numel = math.prod(x.spec.shape)
    if out.count(-1) == 1:
        rest = math.prod(s for s in out if s != -1)
        if rest == 0 or numel % rest:
            return None
        out[out.index(-1)] = numel // rest
    return out if math.prod(out) == numel and all(s >= 0 for s in out) else None


def _same(a: Any, c: Any) -> bool:
    """Whether two sizes are the same, read from their expressions (never a guard)."""
    if pt.is_symbolic(a) or pt.is_symbolic(c):
        if not (pt.is_symbolic(a) and pt.is_symbolic(c)):
            return False
        return sympy.expand(pt.sym_expr(a) - pt.sym_expr(c)) == 0
    return int(a) == int(c)


def _static_prod(sizes: list[Any]) -> int | None:
    return math.prod(int(s) for s in sizes) if not any(pt.is_symbolic(s) for s in sizes) else None


def symbolic_view_placements(in_shape: list[Any], out_shape: list[Any], placements: Any) -> list[Any] | None:
    """Output placements of a view of a tensor whose sharded dim ``d`` has a symbolic size
    (``dynamic=True``) that keeps every rank's elements where they are, or None.

    Three forms, read from the sizes' expressions (no guard): dim ``d`` kept (the dims
    before it unchanged), ``d`` flattened with static dims behind it (``(B, T, D) ->
    (B*T, D)``), or ``d`` split into a dim and static dims behind it (``(B*T, D) ->
    (B, T, D)``). Each rank's rows of ``d`` are a contiguous run of whole groups of the
    static dims behind, so the result is ``Shard(d)`` split in units
    (:func:`..symbolic.size_unit`): exact for every size, even or uneven. Other mesh axes
    may split static dims the view leaves alone (``S(0)S(1)`` on a DP x TP mesh)."""
    from ..symbolic import size_unit

    sharded = [(axis, p) for axis, p in enumerate(placements) if isinstance(p, (pt.Shard, pt.StridedShard))]
    if any(type(p) is not pt.Shard and pt.is_symbolic(in_shape[p.dim]) for _, p in sharded):
        return None  # a strided split of the symbolic dim (a strided one of a static dim moves like a Shard)
    symbolic = [p.dim for _, p in sharded if pt.is_symbolic(in_shape[p.dim])]
    if not symbolic and sharded:  # a replicated symbolic batch (tensor parallel): views in front of the split dims
        return _view_in_front(in_shape, out_shape, placements, min(p.dim for _, p in sharded))
    if len(symbolic) != 1:
        return None  # one mesh axis splits the symbolic dim: nested splits have no unit layout
    d = symbolic[0]
    if len(out_shape) <= d or not all(_same(a, c) for a, c in zip(in_shape[:d], out_shape[:d])):
        return None
    a, c = in_shape[d], out_shape[d]
    run = None  # (end of the run in in_shape, end in out_shape)
    if _same(a, c):
        run = (d + 1, d + 1)
    for i in range(d + 2, len(in_shape) + 1):  # flatten: out[d] = in[d] * static dims behind
        behind = _static_prod(in_shape[d + 1:i])
        if run is None and behind is not None and _same(c, a * behind) and size_unit(c) == size_unit(a) * behind:
            run = (i, d + 1)
    for j in range(d + 2, len(out_shape) + 1):  # split: in[d] = out[d] * static dims behind
        behind = _static_prod(out_shape[d + 1:j])
        if run is None and behind is not None and _same(a, c * behind) and size_unit(a) == size_unit(c) * behind:
            run = (d + 1, j)
    if run is None:
        return None
    i, j = run
    out = []
    for p in placements:
        if not isinstance(p, (pt.Shard, pt.StridedShard)) or p.dim <= d:
            out.append(p)  # the symbolic dim, a dim before it (unchanged), Replicate, Partial
            continue
        # another axis splits a dim behind the run: the dims behind must be the same
        if p.dim < i or len(in_shape) - i != len(out_shape) - j or not all(_same(x, y) for x, y in zip(in_shape[i:], out_shape[j:])):
            return None
        moved = p.dim - i + j
        out.append(pt.Shard(moved) if type(p) is pt.Shard else pt.StridedShard(moved, split_factor=p.split_factor))
    return out


def _view_in_front(in_shape: list[Any], out_shape: list[Any], placements: Any, first: int) -> list[Any] | None:
    """Placements of a view that reshapes only dims in front of ``first``, the first split
    dim (``(B*T, 3D) -> (B, T, 3D)`` with the features split over tp), or None: the split
    dims and those behind them move by the change in rank, unchanged."""
    tail = len(in_shape) - first
    if len(out_shape) < tail or not all(_same(x, y) for x, y in zip(in_shape[first:], out_shape[len(out_shape) - tail:])):
        return None
    shift = len(out_shape) - len(in_shape)
    out = []
    for p in placements:
        if isinstance(p, pt.StridedShard):
            p = pt.StridedShard(p.dim + shift, split_factor=p.split_factor)
        elif isinstance(p, pt.Shard):
            p = pt.Shard(p.dim + shift)
        out.append(p)
    return out


def _symbolic_view(ctx: ExpandContext, b: SubgraphBuilder, op: Any, x: TensorArg, sizes: Any) -> Any:
    """The view of a symbolic sharded dim kept sharded (:func:`symbolic_view_placements`),
    or None (then DTensor's strategy)."""
    out = [s.global_value if isinstance(s, DSymInt) else s for s in sizes]
    in_shape = list(x.spec.shape)
    inferred = [i for i, s in enumerate(out) if not pt.is_symbolic(s) and int(s) == -1]
    if inferred:  # ``x.view(-1, x.size(-1))`` (GPT-2's Conv1D): the size the others leave
        known = [s for i, s in enumerate(out) if i != inferred[0]]
        if len(inferred) > 1 or any(not pt.is_symbolic(s) and int(s) == 0 for s in known):
            return None
        out[inferred[0]] = math.prod(in_shape) // math.prod(known)
    numel_in = sympy.Mul(*[pt.sym_expr(s) if pt.is_symbolic(s) else sympy.Integer(int(s)) for s in in_shape])
    numel_out = sympy.Mul(*[pt.sym_expr(s) if pt.is_symbolic(s) else sympy.Integer(int(s)) for s in out])
    if sympy.expand(numel_in - numel_out) != 0:
        return None
    placements = symbolic_view_placements(in_shape, out, x.spec.placements)
    if placements is None:
        return None
    # the placements follow the elements' logical order, whatever the memory layout (a
    # transposed key viewed for bmm); the global strides are the view's of the global layout
    try:
        with b.fake_mode:
            stride = torch.empty_strided(tuple(in_shape), tuple(x.spec.stride), device="meta").view(out).stride()
    except RuntimeError:  # the global layout does not allow this view (reshape copies): DTensor decides
        return None
    local = list(b.local_shape(out, placements))
    try:
        node = b.call(op, x.node, local)
    except RuntimeError:  # the local tensor's strides do not allow this view
        return None
    spec = pt.make_spec(ctx.mctx.mesh, placements, out, tuple(stride), x.spec.tensor_meta.dtype)
    return _out_tensor(b, node, spec, {})


def _strided_flatten_placements(in_shape: list[Any], out: list[Any], placements: Any, mesh_shape: Any, merge: bool) -> tuple[int, list[Any]] | None:
    """(dim, output placements) of ``(..., A, H, ...) <-> (..., A*H, ...)`` (``merge``: the
    flatten; else its inverse) with A symbolic and H static split by one mesh axis ``t``
    (attention's ``(B, heads)``), or None. Flattened, each rank holds its piece of every
    block of H rows: ``_StridedShard`` with a symbolic block count, carried as its static
    period H (``pt.symbolic_split``); an axis splitting A (before ``t``) keeps ``Shard`` in
    units of H. Needs H even over ``t``'s ranks."""
    long, short = (in_shape, out) if merge else (out, in_shape)
    if len(long) != len(short) + 1:
        return None
    d = next((i for i, (a, c) in enumerate(zip(long, short)) if not _same(a, c)), len(short))
    if d >= len(short):
        return None
    # the dims behind: each rank views whole rows of them, so they need only be unsharded
    # where their expressions differ (``Min(4, T)`` against ``T``: equal whenever the traced
    # view is valid)
    loose = {i for i, (x, y) in enumerate(zip(long[d + 2:], short[d + 1:])) if not _same(x, y)}
    behind = {k - (d + 2 if merge else d + 1) for k in (p.dim for p in placements if isinstance(p, pt.Shard))}
    if loose & behind:
        return None
    a, h = long[d], long[d + 1]
    if not pt.is_symbolic(a) or pt.is_symbolic(h) or not _same(short[d], a * int(h)):
        return None
    from ..symbolic import size_unit

    h = int(h)
    new, split_axis, a_axes = [], None, []
    for axis, p in enumerate(placements):
        period = pt.split_period(p)
        if merge and type(p) is pt.Shard and p.dim == d + 1:
            split_axis, p = axis, pt.symbolic_split(d, h)
        elif not merge and period is not None and p.dim == d:
            if period != h:
                return None
            split_axis, p = axis, pt.Shard(d + 1)
        elif isinstance(p, pt.StridedShard):
            return None
        elif isinstance(p, pt.Shard) and p.dim == d:
            a_axes.append(axis)
        elif isinstance(p, pt.Shard) and p.dim > d:
            p = pt.Shard(p.dim - 1 if merge else p.dim + 1)
        new.append(p)
    if split_axis is None or any(ax > split_axis for ax in a_axes) or h % mesh_shape[split_axis]:
        return None
    if a_axes and size_unit(short[d]) != size_unit(a) * h:
        return None
    return d, new


def _symbolic_strided_view(ctx: ExpandContext, b: SubgraphBuilder, op: Any, x: TensorArg, sizes: Any) -> Any:
    """A flatten of a symbolic dim with a split static dim behind it, or its inverse, kept
    sharded (:func:`_strided_flatten_placements`), or None."""
    out = [s.global_value if isinstance(s, DSymInt) else s for s in sizes]
    if any(not pt.is_symbolic(s) and int(s) == -1 for s in out):
        return None
    in_shape = list(x.spec.shape)
    merge = len(in_shape) == len(out) + 1
    found = _strided_flatten_placements(in_shape, out, x.spec.placements, b.mctx.shape, merge)
    if found is None:
        return None
    d, placements = found
    contiguous = _contiguous_strides(in_shape)
    if not all(_same(s, c) for s, c, n in zip(x.spec.stride, contiguous, in_shape) if not (not pt.is_symbolic(n) and int(n) == 1)):
        return None
    loc = list(x.node.meta["val"].shape)
    if merge:  # this rank's rows: its A rows times its piece of H
        local = loc[:d] + [loc[d] * loc[d + 1]] + loc[d + 2:]
    else:
        local = list(b.local_shape(out, placements))
    try:
        node = b.call(op, x.node, local)
    except RuntimeError:
        return None
    spec = pt.make_spec(ctx.mctx.mesh, placements, out, _contiguous_strides(out), x.spec.tensor_meta.dtype)
    return _out_tensor(b, node, spec, {})


def _contiguous_strides(shape: list[Any]) -> tuple[Any, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc = acc * s
    return tuple(reversed(stride))


def _blocked(x: TensorArg) -> bool:
    """A sharded dim split in units (a flattened symbolic batch): DTensor's view strategy
    would localize its sizes with torch.chunk's layout, which is not this one."""
    from ..symbolic import size_unit

    return any(isinstance(p, pt.Shard) and size_unit(x.spec.shape[p.dim]) > 1 for p in x.spec.placements)


@register_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    x, sizes = args[0], (args[1] if len(args) > 1 else kwargs.get("size"))
    if isinstance(x, TensorArg) and sizes is not None and any(pt.is_symbolic(s) for s in x.spec.shape) and b.sizes is not None:
        done = _symbolic_strided_view(ctx, b, op, x, sizes)
        if done is not None:
            return done
        strided = any(isinstance(p, pt.StridedShard) and pt.split_period(p) is None for p in x.spec.placements)
        if _blocked(x) or strided or not dtensor_keeps_inputs(ctx, b, op, args, kwargs):  # strided: DTensor localizes sizes
            done = _symbolic_view(ctx, b, op, x, sizes)
            if done is not None:
                return done
        return generic_expand(ctx, b, op, args, kwargs)
    if not isinstance(x, TensorArg) or sizes is None or dtensor_keeps_inputs(ctx, b, op, args, kwargs):
        return generic_expand(ctx, b, op, args, kwargs)
    global_out = _sizes(x, sizes)
    placements = strided_view_placements(list(x.spec.shape), global_out, x.spec.placements, b.mctx.shape) if global_out else None
    if placements is None:
        return generic_expand(ctx, b, op, args, kwargs)
    # the local sizes follow from the placements (a size read from the batch, a DSymInt,
    # says how the batch was split, not how this result is)
    local = list(b.local_shape(global_out, placements))
    try:
        node = b.call(op, x.node, local)
    except RuntimeError:  # the local tensor's strides do not allow this view
        return generic_expand(ctx, b, op, args, kwargs)
    meta = torch.empty_strided(tuple(x.spec.shape), tuple(x.spec.stride), device="meta")
    stride = meta.reshape(global_out).stride()
    spec = pt.make_spec(ctx.mctx.mesh, placements, global_out, stride, x.spec.tensor_meta.dtype)
    return _out_tensor(b, node, spec, {})


@register_rule(aten.slice.Tensor)
def _slice(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    """``x[:, ...]`` over a sharded symbolic dim (Hugging Face's ``logits_to_keep=0`` slices
    the hidden states ``[:, slice(0, None), :]``): the whole dim, each rank keeps its rows.
    DTensor's strategy cannot tell a full slice of a symbolic size and gathers; any other
    slice goes to it."""
    x = args[0]
    rest = list(args[1:])
    dim, start, end, step = rest + [kwargs.get(k, d) for k, d in (("dim", 0), ("start", None), ("end", None), ("step", 1))][len(rest):]
    if isinstance(x, TensorArg) and b.sizes is not None and isinstance(dim, int):
        dim %= len(x.spec.shape)
        size = x.spec.shape[dim]
        split = any(isinstance(p, (pt.Shard, pt.StridedShard)) and p.dim == dim for p in x.spec.placements)
        static = [v for v in (start, end, step) if v is not None]
        if split and pt.is_symbolic(size) and not any(pt.is_symbolic(v) or isinstance(v, DSymInt) for v in static):
            if start in (0, None) and step in (1, None) and (end is None or int(end) >= 2**62):
                node = b.call(op, x.node, dim, 0, end if end is not None else 2**63 - 1)
                return _out_tensor(b, node, x.spec, {})
    return generic_expand(ctx, b, op, args, kwargs)
