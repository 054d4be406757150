"""Rank-independent redistribution: local ops and functional collectives.

DTensor's own ``redistribute_local_tensor`` bakes the tracing rank's coordinate into the
graph (``split(...)[rank]``). Here the coordinate is a runtime value (a placeholder of the
recipe), so the same graph runs on every rank of an evenly sharded program, and every
collective node records why it exists.

Per-axis transitions (``n`` = mesh axis size, ``d`` = tensor dim):

=====================  ==============================================================
Partial -> Replicate   all_reduce (MaskPartial: zero masked rows first; p-norm partial:
                       x^p before, ^(1/p) after)
Partial -> Shard(d)    reduce_scatter along d (padded to a multiple of n if uneven)
Shard(d) -> Replicate  all_gather along d (pad before, drop padding after if uneven)
Shard(a) -> Shard(b)   all_to_all when both dims divide evenly, else gather + narrow
Replicate -> Shard(d)  narrow at ``coord * chunk`` (no communication)
Replicate -> Partial   sum: divide by n; avg/max/min: identity; MaskPartial: mask ids
=====================  ==============================================================
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..errors import UnsupportedPlacementError
from .builder import SubgraphBuilder
from .symbolic import size_hint, size_unit
from .chunks import chunk_sizes, strided_layout
from .values import placements_text

__all__ = ["emit_redistribute", "logical_shape", "COLLECTIVE_OPS"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

COLLECTIVE_OPS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
}


def logical_shape(b: SubgraphBuilder, global_shape: tuple[int, ...], placements: list, axis: int) -> list[int]:
    """The tensor shape that mesh ``axis`` splits: global shape with the shards of the
    axes before ``axis`` applied (DTensor shards left to right)."""
    shape = list(global_shape)
    for i in range(axis):
        p = placements[i]
        if isinstance(p, pt.StridedShard):
            shape[p.dim] = b.local_strided(shape[p.dim], int(p.split_factor), i)
        elif isinstance(p, pt.Shard):
            shape[p.dim] = b.local_chunk(shape[p.dim], i)
    return shape


def _nbytes(val: torch.Tensor) -> int:
    """Bytes of a value, for the collectives' metadata (dumps, summaries); a symbolic
    size (dynamic=True) counts with its example value, never guarding on it."""
    return size_hint(val.numel()) * val.element_size()


def _wire_bytes(kind: str, buffer_bytes: int, n: int) -> int:
    """Bytes one rank sends in a ring implementation of the collective."""
    if kind == "all_reduce":
        return 2 * (n - 1) * buffer_bytes // n
    return (n - 1) * buffer_bytes // n


def _collective(b: SubgraphBuilder, op: Any, kind: str, x: fx.Node, axis: int, args: tuple, reason: str, buffer: torch.Tensor | None = None) -> fx.Node:
    n = b.mctx.shape[axis]
    group = b.mctx.group_names[axis]
    val = x.meta["val"]
    if kind == "all_gather":
        buffer_bytes = _nbytes(val) * n
    else:
        buffer_bytes = _nbytes(val)
    meta = {
        "spmd_comm": {
            "kind": kind,
            "axis": axis,
            "axis_name": b.mctx.axis_names[axis],
            "group_size": n,
            "reason": reason,
            "bytes": buffer_bytes,
            "wire_bytes": _wire_bytes(kind, buffer_bytes, n),
            "dtype": str(val.dtype).replace("torch.", ""),
            **getattr(b, "comm_context", {}),
        }
    }
    started = b.call(op, x, *args, group, meta=meta)
    return b.call(c10d.wait_tensor.default, started, meta={"spmd_wait": True})


def _contiguous(b: SubgraphBuilder, x: fx.Node) -> fx.Node:
    """``x.contiguous()``: a no-op at run time when it already is. Always emitted, so the
    graph has the same nodes on every rank (contiguity of size-0/1 dims varies)."""
    return b.call(aten.contiguous.default, x)


def _reduce_op(p: Any) -> str:
    op = p.reduce_op
    if op not in ("sum", "avg", "max", "min", "product"):
        raise UnsupportedPlacementError(
            f"Partial reduce op {op!r} is not supported; expected one of sum, avg, max, min, product. "
            f"fix: give this value a Partial('sum') or a Shard/Replicate placement"
        )
    return op


def _apply_mask(b: SubgraphBuilder, x: fx.Node, mask: fx.Node | None) -> fx.Node:
    if mask is None:
        raise UnsupportedPlacementError("a MaskPartial value lost its mask; this is a bug in spmd-compiler")
    m = mask
    if x.meta["val"].dim() > mask.meta["val"].dim():
        m = b.call(aten.unsqueeze.default, mask, -1)
    return b.call(aten.masked_fill.Scalar, x, m, 0)


def emit_redistribute(
    b: SubgraphBuilder,
    x: fx.Node,
    src: Any,
    dst: Any,
    *,
    mask: fx.Node | None = None,
    reason: str = "",
    input_index: int | None = None,
    value_label: str | None = None,
) -> tuple[fx.Node, fx.Node | None]:
    """Emit the ops that turn local tensor ``x`` laid out as ``src`` into ``dst``.

    ``reason`` and ``input_index`` (which tensor argument of the op is redistributed)
    are recorded on every collective emitted, for provenance.
    Returns the new local node and, when ``dst`` has a MaskPartial placement created here,
    its mask node (else the incoming ``mask``).
    """
    if tuple(src.placements) == tuple(dst.placements):
        return x, mask
    mctx = b.mctx
    current = list(src.placements)
    global_shape = tuple(src.shape)
    steps = _conservative_steps(src, dst) if _needs_conservative(src, dst) else pt.transform_steps(src, dst)
    applied = None  # the mask once a MaskPartial reduction has zeroed the masked rows
    for step in steps:
        axis, s, t = step.axis, step.src, step.dst
        n = mctx.shape[axis]
        if s == t:
            continue
        if n == 1:
            current[axis] = t
            continue
        if isinstance(s, pt.MaskPartial) and applied is not None:
            # an index split over several axes has one mask for all of them (the OR of
            # each axis's); once applied, the other axes' terms are plain sums
            s = pt.Partial(s.reduce_op)
        logical = logical_shape(b, global_shape, current, axis)
        b.uneven = {d: _globally_uneven(global_shape, current, axis, d, mctx.shape) for d in range(len(global_shape))}
        transition = f"{placements_text([s])}->{placements_text([t])}"
        why = f"{reason}: {transition} on '{mctx.axis_names[axis]}'"
        b.comm_context = {
            "input_index": input_index,
            "transition": transition,
            "from": placements_text(src.placements),
            "to": placements_text(dst.placements),
            "why": reason,
            **({"value_label": value_label} if value_label else {}),
        }
        if s.is_replicate() and isinstance(t, pt.MaskPartial):
            x, mask = _mask_ids(b, x, axis, *_mask_size(b, t, current, axis), mask)
        else:
            before = mask
            x, mask = _emit_step(b, x, axis, s, t, logical, mask, why)
            if before is not None and mask is None and isinstance(s, pt.MaskPartial):
                applied = before
        current[axis] = t
    if applied is not None and mask is None and any(isinstance(p, pt.MaskPartial) for p in dst.placements):
        mask = b.call(aten.zeros_like.default, applied)  # nothing left to mask on the remaining axes
    return x, mask


def _mask_size(b: SubgraphBuilder, t: Any, current: list, axis: int) -> tuple[int, bool]:
    """The size of the embedding dim that mesh ``axis`` splits for MaskPartial ``t``: the
    full dim, or this rank's chunk of it when earlier axes already split it (a weight
    ``[Shard(0), Shard(0)]`` gives indices ``MaskPartial`` on both axes); and whether
    some rank's split is uneven (from the global size, so every rank emits the same ops)."""
    size = global_size = int(t.offset_shape[t.offset_dim])
    ways = b.mctx.shape[axis]
    for i in range(axis):
        p = current[i]
        if isinstance(p, pt.MaskPartial) and p.offset_dim == t.offset_dim and p.offset_shape == t.offset_shape:
            size = b.local_chunk(size, i)
            ways *= b.mctx.shape[i]
    return size, global_size % ways != 0


def _needs_conservative(src: Any, dst: Any) -> bool:
    """Strided shards, or one tensor dim split by several axes: the order of the per-axis
    steps decides which shape each step sees, so we use a fixed, always-valid order."""
    for spec in (src, dst):
        dims = [getattr(p, "dim", None) for p in spec.placements if p.is_shard() or isinstance(p, pt.StridedShard)]
        masks = [p.offset_dim for p in spec.placements if isinstance(p, pt.MaskPartial)]
        if len(masks) != len(set(masks)):  # an index split over several axes: first axis first
            return True
        if any(isinstance(p, pt.StridedShard) for p in spec.placements) or len(dims) != len(set(dims)):
            return True
    return False


def _conservative_steps(src: Any, dst: Any) -> list[Any]:
    """Gather/reduce the axes that must change to Replicate from the last axis to the
    first, then split into the target from the first axis to the last. Each step then
    sees the tensor as left-to-right sharding defines it (all later axes that split the
    same dim already replicated).

    An axis keeps its shard when its placement stays and no earlier axis changes how the
    same dim is split: a later axis that newly splits that dim narrows this rank's chunk
    (``S(0),R -> S(0),S(0)`` is a local narrow, no communication)."""
    ndim = len(src.placements)
    cur = list(src.placements)
    target = list(dst.placements)

    def shard_dim(p: Any) -> int | None:
        return p.dim if (p.is_shard() or isinstance(p, pt.StridedShard)) else None

    steps = []
    for axis in reversed(range(ndim)):
        s = cur[axis]
        if s.is_replicate():
            continue
        d = shard_dim(s)
        earlier_changes = d is not None and any(
            d in (shard_dim(cur[i]), shard_dim(target[i])) and cur[i] != target[i] for i in range(axis)
        )
        if s == target[axis] and not earlier_changes:
            continue
        steps.append(pt.TransformStep(axis, s, pt.Replicate()))
        cur[axis] = pt.Replicate()
    for axis in range(ndim):
        if cur[axis] != target[axis]:
            steps.append(pt.TransformStep(axis, cur[axis], target[axis]))
            cur[axis] = target[axis]
    return steps


def _globally_uneven(global_shape: tuple[int, ...], placements: list, axis: int, dim: int, mesh_shape: tuple[int, ...]) -> bool:
    """Whether splitting ``dim`` over ``axis`` can be uneven on *some* rank.

    Decided from the global size alone, so every rank emits the same ops (padding of zero
    where its own chunk happens to be full): the graph's structure never depends on the
    coordinate, only its sizes do.
    """
    ways = mesh_shape[axis]
    for j in range(axis):
        p = placements[j]
        if getattr(p, "dim", None) == dim and (p.is_shard() or isinstance(p, pt.StridedShard)):
            ways *= mesh_shape[j]
    if pt.is_symbolic(global_shape[dim]):
        return True  # dynamic=True: the padded form serves every size (no guard on evenness)
    return global_shape[dim] % ways != 0


def _emit_step(b: SubgraphBuilder, x: fx.Node, axis: int, s: Any, t: Any, logical: list[int], mask: fx.Node | None, why: str) -> tuple[fx.Node, fx.Node | None]:
    n = b.mctx.shape[axis]
    if isinstance(s, pt.StridedShard) or isinstance(t, pt.StridedShard):
        return _strided_step(b, x, axis, s, t, logical, mask, why)
    if s.is_partial() and t.is_replicate():
        if isinstance(s, pt.MaskPartial):
            x = _apply_mask(b, x, mask)
        x = _norm_pre(b, x, s)
        out = _collective(b, c10d.all_reduce.default, "all_reduce", x, axis, (_reduce_op(s),), why)
        return _norm_post(b, out, s), None
    if s.is_partial() and isinstance(t, pt.Shard):
        if isinstance(s, pt.MaskPartial):
            x = _apply_mask(b, x, mask)
        x = _norm_pre(b, x, s)
        out = _reduce_scatter(b, x, axis, t.dim, logical[t.dim], _reduce_op(s), why)
        return _norm_post(b, out, s), None
    if isinstance(s, pt.Shard) and t.is_replicate():
        return _all_gather(b, x, axis, s.dim, logical[s.dim], why), mask
    if isinstance(s, pt.Shard) and isinstance(t, pt.Shard):
        a, d = s.dim, t.dim
        la, ld = logical[a], logical[d]
        if not b.uneven[a] and not b.uneven[d]:
            return _all_to_all(b, x, axis, a, d, n, why), mask
        full = _all_gather(b, x, axis, a, la, why + " (uneven: gather then narrow)")
        return _narrow_shard(b, full, axis, d, ld), mask
    if s.is_replicate() and isinstance(t, pt.Shard):
        return _narrow_shard(b, x, axis, t.dim, logical[t.dim]), mask
    if s.is_replicate() and t.is_partial():
        if isinstance(t, pt.MaskPartial):
            size = int(t.offset_shape[t.offset_dim])
            return _mask_ids(b, x, axis, size, size % n != 0, mask)
        if isinstance(t, pt.NormPartial) and t.reduce_op == "sum":
            return b.call(aten.div.Scalar, x, float(n) ** (1.0 / t.norm_type)), None
        if t.reduce_op == "sum":
            return b.call(aten.div.Scalar, x, n), None
        if t.reduce_op in ("avg", "max", "min"):
            return x, None
    raise UnsupportedPlacementError(
        f"cannot redistribute {placements_text([s])} -> {placements_text([t])} ({why}); expected a transition between "
        f"Shard, Replicate and Partial that has a collective. fix: plan Replicate() on mesh axis "
        f"'{b.mctx.axis_names[axis]}' for the values this op reads"
    )


def _norm_pre(b: SubgraphBuilder, x: fx.Node, p: Any) -> fx.Node:
    """A partial p-norm reduces as (sum x^p)^(1/p): raise to p before the sum."""
    if isinstance(p, pt.NormPartial) and p.reduce_op == "sum" and p.norm_type != 1:
        return b.call(aten.pow.Tensor_Scalar, x, p.norm_type)
    return x


def _norm_post(b: SubgraphBuilder, x: fx.Node, p: Any) -> fx.Node:
    if isinstance(p, pt.NormPartial) and p.reduce_op == "sum" and p.norm_type != 1:
        return b.call(aten.pow.Tensor_Scalar, x, 1.0 / p.norm_type)
    return x


def _narrow_shard(b: SubgraphBuilder, x: fx.Node, axis: int, dim: int, size: int) -> fx.Node:
    local = b.local_chunk(size, axis)
    start = b.shard_offset(size, axis, b.uneven[dim])
    piece = b.call(aten.narrow.default, x, dim, start, local)
    return b.call(aten.clone.default, piece, memory_format=torch.contiguous_format)


def _all_gather(b: SubgraphBuilder, x: fx.Node, axis: int, dim: int, size: int, why: str) -> fx.Node:
    n = b.mctx.shape[axis]
    symbolic = pt.is_symbolic(size)
    uneven = True if symbolic else b.uneven[dim]  # a symbolic size: the general (padded) form
    # uneven: every piece padded to the longest; at least one row, so a rank whose part
    # of the dim is empty (1 row over 2x2) still cuts n distinct pieces below (n equal
    # narrows would be merged by a pass on that rank only: other nodes than its peers)
    if symbolic:  # dynamic=True (expand/symbolic.py): a size symbol, never asked whether it is 1
        sizes = []
        unit = size_unit(size)  # a dim split in units (a flattened batch): pieces of unit * chunk
        full = unit * b.sizes.fresh(torch.sym_max(1, (size // unit + (n - 1)) // n))
    else:
        sizes = chunk_sizes(size, n)
        full = max(1, max(sizes)) if uneven else max(sizes)
    local = x.meta["val"]
    if uneven:
        pad = full - local.shape[dim]
        if symbolic:  # constant_pad_nd's fake kernel needs concrete pads: cat with zeros
            zeros_shape = [pad if d == dim else s for d, s in enumerate(local.shape)]
            x = b.call(aten.cat.default, [x, b.call(aten.new_zeros.default, x, zeros_shape)], dim)
        else:
            spec = [0, 0] * (local.dim() - 1 - dim) + [0, pad]
            x = b.call(aten.constant_pad_nd.default, x, spec, 0)
    moved = dim != 0
    if moved:
        x = b.call(aten.movedim.int, x, dim, 0)
    x = _contiguous(b, x)
    g = _collective(b, c10d.all_gather_into_tensor.default, "all_gather", x, axis, (n,), why)
    if moved:  # back to the original dim order, in the original (contiguous) layout
        g = _contiguous(b, b.call(aten.movedim.int, g, 0, dim))
    if uneven and symbolic:
        # torch.chunk's layout puts the full pieces first: padded to ``full`` rows each,
        # the valid rows are exactly the first ``size`` (0 pieces of padding between them)
        g = b.call(aten.narrow.default, g, dim, 0, size)
    elif uneven:  # every rank's piece, empty ones included (the same ops on every rank)
        pieces = [b.call(aten.narrow.default, g, dim, j * full, sz) for j, sz in enumerate(sizes)]
        g = b.call(aten.cat.default, pieces, dim)
    return g


def _reduce_scatter(b: SubgraphBuilder, x: fx.Node, axis: int, dim: int, size: int, op: str, why: str) -> fx.Node:
    n = b.mctx.shape[axis]
    local = x.meta["val"]
    if pt.is_symbolic(size):  # dynamic=True: pieces of ``full`` rows, the padded form for every size
        unit = size_unit(size)
        full = unit * b.sizes.fresh(torch.sym_max(1, (size // unit + (n - 1)) // n))
        uneven = True
        # torch.chunk's layout puts rank j's rows at j * full: padded to n * full rows,
        # the reduce_scatter hands rank j exactly its piece (and padding) to narrow
        zeros_shape = [full * n - local.shape[dim] if d == dim else s for d, s in enumerate(local.shape)]
        x = b.call(aten.cat.default, [x, b.call(aten.new_zeros.default, x, zeros_shape)], dim)
    else:
        full = max(chunk_sizes(size, n))
        uneven = b.uneven[dim]
    if uneven and not pt.is_symbolic(size):
        pad = full * n - local.shape[dim]
        spec = [0, 0] * (local.dim() - 1 - dim) + [0, pad]
        x = b.call(aten.constant_pad_nd.default, x, spec, 0)
    moved = dim != 0
    if moved:
        x = b.call(aten.movedim.int, x, dim, 0)
    x = _contiguous(b, x)
    r = _collective(b, c10d.reduce_scatter_tensor.default, "reduce_scatter", x, axis, (op, n), why)
    if moved:
        r = _contiguous(b, b.call(aten.movedim.int, r, 0, dim))
    if uneven:
        r = b.call(aten.narrow.default, r, dim, 0, b.local_chunk(size, axis))
    return r


def _all_to_all(b: SubgraphBuilder, x: fx.Node, axis: int, src_dim: int, dst_dim: int, n: int, why: str) -> fx.Node:
    """Shard(src_dim) -> Shard(dst_dim) over ``axis`` with one all_to_all (even sizes)."""
    shape = list(x.meta["val"].shape)
    split = shape[:dst_dim] + [n, shape[dst_dim] // n] + shape[dst_dim + 1 :]
    y = b.call(aten.reshape.default, x, split)
    y = b.call(aten.movedim.int, y, dst_dim, 0)
    y = _contiguous(b, y)
    y = _collective(b, c10d.all_to_all_single.default, "all_to_all", y, axis, ([1] * n, [1] * n), why)
    # y: [n, ...] where block j is rank j's src_dim shard of our dst_dim chunk
    y = b.call(aten.movedim.int, y, 0, src_dim)
    out_shape = list(y.meta["val"].shape)
    merged = out_shape[:src_dim] + [out_shape[src_dim] * out_shape[src_dim + 1]] + out_shape[src_dim + 2 :]
    return b.call(aten.reshape.default, y, merged)


def _mask_ids(b: SubgraphBuilder, x: fx.Node, axis: int, size: int, uneven: bool, mask: fx.Node | None) -> tuple[fx.Node, fx.Node]:
    """Replicate -> MaskPartial: shift ids into this rank's chunk of a vocab of ``size``,
    mask the rest (together with what ``mask`` already masks on earlier axes)."""
    local = b.local_chunk(size, axis)
    start = b.shard_offset(size, axis, uneven)
    end = b.call(operator.add, start, local)
    below = b.call(aten.lt.Scalar, x, start)
    above = b.call(aten.ge.Scalar, x, end)
    new = b.call(aten.bitwise_or.Tensor, below, above)
    mask = new if mask is None else b.call(aten.bitwise_or.Tensor, mask, new)
    shifted = b.call(aten.sub.Scalar, x, start)
    masked = b.call(aten.masked_fill.Scalar, shifted, mask, 0)
    return masked, mask


def _strided_step(b: SubgraphBuilder, x: fx.Node, axis: int, s: Any, t: Any, logical: list[int], mask: fx.Node | None, why: str) -> tuple[fx.Node, fx.Node | None]:
    """Transitions involving a strided shard go through Replicate.

    ``_StridedShard(d, sf)`` splits dim d (size L) as ``[sf, n, L/(sf*n)]`` and gives
    rank j the slice ``[:, j, :]``: it is what a sharded inner dim becomes after a view
    merges it with an outer one (heads into batch*heads in attention).
    """
    if isinstance(s, pt.StridedShard) and isinstance(t, pt.StridedShard) and s == t:
        return x, mask
    if s.is_replicate():
        return _replicate_to_strided(b, x, axis, t, logical[t.dim], why), mask
    if t.is_replicate() and isinstance(s, pt.StridedShard):
        return _strided_to_replicate(b, x, axis, s, logical[s.dim], why), mask
    # anything else: to Replicate first, then to the target
    if isinstance(s, pt.StridedShard):
        full = _strided_to_replicate(b, x, axis, s, logical[s.dim], why)
    else:
        full, mask = _emit_step(b, x, axis, s, pt.Replicate(), logical, mask, why)
    return _emit_step(b, full, axis, pt.Replicate(), t, logical, mask, why)


def _even_strided(size: int, sf: int, n: int) -> bool:
    return size % (sf * n) == 0


def _strided_to_replicate(b: SubgraphBuilder, x: fx.Node, axis: int, s: Any, size: int, why: str) -> fx.Node:
    n, sf, d = b.mctx.shape[axis], int(s.split_factor), s.dim
    if _even_strided(size, sf, n):
        c = size // (sf * n)
        g = _all_gather(b, x, axis, d, size, why)  # rank-major: [n][sf][c] along d
        shape = list(g.meta["val"].shape)
        g = b.call(aten.reshape.default, g, shape[:d] + [n, sf, c] + shape[d + 1 :])
        g = b.call(aten.transpose.int, g, d, d + 1)
        return b.call(aten.reshape.default, g, shape)
    # uneven: pad every rank's piece to the longest, gather, and put each chunk back
    layout = strided_layout(size, sf, n)
    lengths = [sum(layout[k][j][1] for k in range(sf)) for j in range(n)]
    longest = max(1, max(lengths))  # at least one row: n distinct pieces on every rank (see _all_gather)
    local = x.meta["val"]
    pad = longest - local.shape[d]
    x = b.call(aten.constant_pad_nd.default, x, [0, 0] * (local.dim() - 1 - d) + [0, pad], 0)
    if d != 0:
        x = b.call(aten.movedim.int, x, d, 0)
    g = _collective(b, c10d.all_gather_into_tensor.default, "all_gather", _contiguous(b, x), axis, (n,), why)
    if d != 0:
        g = _contiguous(b, b.call(aten.movedim.int, g, 0, d))
    pieces = []
    for k in range(sf):
        for j in range(n):
            before = sum(layout[kk][j][1] for kk in range(k))
            pieces.append(b.call(aten.narrow.default, g, d, j * longest + before, layout[k][j][1]))
    return b.call(aten.cat.default, pieces, d)


def _replicate_to_strided(b: SubgraphBuilder, x: fx.Node, axis: int, t: Any, size: int, why: str) -> fx.Node:
    n, sf, d = b.mctx.shape[axis], int(t.split_factor), t.dim
    shape = list(x.meta["val"].shape)
    if _even_strided(size, sf, n):
        c = size // (sf * n)
        y = b.call(aten.reshape.default, x, shape[:d] + [sf, n, c] + shape[d + 1 :])
        y = b.call(aten.narrow.default, y, d + 1, b.coords[axis], 1)
        y = b.call(aten.reshape.default, y, shape[:d] + [sf * c] + shape[d + 1 :])
        return b.call(aten.clone.default, y, memory_format=torch.contiguous_format)
    # uneven: this rank's chunk of every block, at run-time offsets
    b.coord_dependent = True
    layout = strided_layout(size, sf, n)
    j = b.mctx.coordinate[axis]
    pieces = []
    start = 0
    for k, bsize in enumerate(chunk_sizes(size, sf)):
        off = b.shard_offset(bsize, axis, uneven=True)
        at = b.call(operator.add, off, start)
        pieces.append(b.call(aten.narrow.default, x, d, at, layout[k][j][1]))
        start += bsize
    y = b.call(aten.cat.default, pieces, d)
    return b.call(aten.clone.default, y, memory_format=torch.contiguous_format)
