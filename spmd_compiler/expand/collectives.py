"""The collectives and local ops one placement change is made of (``redistribute`` plans
the chain, these emit each step): all_gather, reduce_scatter and all_to_all of a shard
(uneven and symbolic sizes included: padding and narrowing), the narrow of a replicated
value to this rank's shard, and the interleaved ``_StridedShard`` layouts. Every
collective node records why it exists and the bytes it moves.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from .builder import SubgraphBuilder
from .symbolic import size_hint, size_unit
from .chunks import chunk_sizes, strided_layout

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

COLLECTIVE_OPS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
}



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
    graph has the same nodes on every rank (contiguity of size-0/1 dims varies).

    A symbolic shape (dynamic=True) that torch cannot prove contiguous for every size is
    copied with ``clone``: ``contiguous()`` would ask whether it already is (``Eq(16*s3,
    16)`` for a moved dim of a batch of one row), a guard that pins the batch size."""
    val = x.meta["val"]
    if any(pt.is_symbolic(s) for s in val.shape) and not pt.definitely_contiguous(val):
        return b.call(aten.clone.default, x, memory_format=torch.contiguous_format)
    return b.call(aten.contiguous.default, x)


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
        # constant_pad_nd's fake kernel needs concrete pads, and reads every size as an
        # int (pinning a symbolic batch in another dim: 8 features over 3 ranks of a
        # (B, T, 8) activation): cat with zeros
        if symbolic or any(pt.is_symbolic(s) for s in local.shape):
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


def _even_strided(size: int, sf: int, n: int) -> bool:
    return size % (sf * n) == 0


def _symbolic_split_to_replicate(b: SubgraphBuilder, x: fx.Node, axis: int, d: int, period: int, why: str) -> fx.Node:
    """Gather a ``pt.symbolic_split``: every rank holds ``c = period / n`` rows of each of
    the same symbolic number of blocks; the gather is rank-major, ``[n][blocks][c]``."""
    n = b.mctx.shape[axis]
    c = period // n
    rows = x.meta["val"].shape[d]
    blocks = rows // c if c > 1 else rows
    if d != 0:
        x = b.call(aten.movedim.int, x, d, 0)
    g = _collective(b, c10d.all_gather_into_tensor.default, "all_gather", _contiguous(b, x), axis, (n,), why)
    rest = list(g.meta["val"].shape[1:])
    g = b.call(aten.reshape.default, g, [n, blocks, c] + rest)
    # [blocks][n][c] by stacking the ranks' pieces: a transposed view would ask torch
    # whether it is contiguous, ``blocks == 1``, a guard that pins the batch size
    g = b.call(aten.stack.default, b.getitems(b.call(aten.unbind.int, g, 0)), 1)
    g = b.call(aten.reshape.default, g, [blocks * period] + rest)
    if d != 0:
        g = b.call(aten.movedim.int, g, 0, d)
    return _contiguous(b, g)


def _replicate_to_symbolic_split(b: SubgraphBuilder, x: fx.Node, axis: int, d: int, period: int) -> fx.Node:
    """This rank's ``period / n`` rows of every block of ``period`` rows."""
    n = b.mctx.shape[axis]
    c = period // n
    shape = list(x.meta["val"].shape)
    blocks = shape[d] // period
    y = b.call(aten.reshape.default, x, shape[:d] + [blocks, n, c] + shape[d + 1:])
    y = b.call(aten.narrow.default, y, d + 1, b.coords[axis], 1)
    y = b.call(aten.reshape.default, y, shape[:d] + [blocks * c] + shape[d + 1:])
    return b.call(aten.clone.default, y, memory_format=torch.contiguous_format)


def _strided_to_replicate(b: SubgraphBuilder, x: fx.Node, axis: int, s: Any, size: int, why: str) -> fx.Node:
    if pt.split_period(s) is not None:
        return _symbolic_split_to_replicate(b, x, axis, s.dim, pt.split_period(s), why)
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
    if pt.split_period(t) is not None:
        return _replicate_to_symbolic_split(b, x, axis, t.dim, pt.split_period(t))
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


def strided_all_to_all_ok(size: Any, sf: int, n: int) -> bool:
    """Whether ``Shard(d) <-> _StridedShard(d, sf)`` of a dim of ``size`` over ``n`` ranks is one
    all_to_all here: static, even (``sf n`` divides it), and ``n`` divides ``sf`` or ``sf`` divides ``n``."""
    return not pt.is_symbolic(size) and size % (sf * n) == 0 and (sf % n == 0 or n % sf == 0)


def _owned_blocks(b: SubgraphBuilder, axis: int, sf: int, n: int, rows: int) -> tuple[list, list]:
    """``n % sf == 0``: the run-time split sizes (in rows) of the Shard -> _StridedShard
    all_to_all: this rank's ``sf`` blocks go to ``sf`` consecutive ranks from ``(coord sf) mod n``;
    it receives one block from each rank ``i`` with ``coord - (i sf mod n)`` in ``[0, sf)``."""
    coord = b.coords[axis]
    first = b.call(operator.mod, b.call(operator.mul, coord, sf), n)
    sends, gets = [], []
    for j in range(n):
        away = b.call(operator.sub, j, first)
        sends.append(b.call(operator.mul, rows, b.call(operator.and_, b.call(operator.ge, away, 0), b.call(operator.lt, away, sf))))
        back = b.call(operator.sub, coord, (j * sf) % n)
        gets.append(b.call(operator.mul, rows, b.call(operator.and_, b.call(operator.ge, back, 0), b.call(operator.lt, back, sf))))
    return sends, gets


def shard_to_strided(b: SubgraphBuilder, x: fx.Node, axis: int, d: int, sf: int, size: int, why: str, inverse: bool = False) -> fx.Node:
    """``Shard(d) -> _StridedShard(d, sf)`` (``inverse``: back) over ``axis`` with one
    all_to_all (:func:`strided_all_to_all_ok`). The dim is ``sf n`` blocks of ``c`` rows:
    ``Shard`` gives rank ``i`` blocks ``[i sf, (i + 1) sf)``, ``_StridedShard`` rank ``j`` the
    blocks ``b`` with ``b mod n == j``, in order; each block goes straight to its rank."""
    n = b.mctx.shape[axis]
    c = size // (sf * n)
    moved = d != 0
    y = b.call(aten.movedim.int, x, d, 0) if moved else x
    rest = list(y.meta["val"].shape[1:])
    if sf % n == 0:  # every rank sends sf / n blocks to every rank: equal splits, blocks grouped by rank
        per = sf // n
        if not inverse:  # local block m goes to rank m mod n
            y = b.call(aten.reshape.default, _contiguous(b, b.call(aten.transpose.int, b.call(aten.reshape.default, y, [per, n, c] + rest), 0, 1)), [sf * c] + rest)
        y = _collective(b, c10d.all_to_all_single.default, "all_to_all", _contiguous(b, y), axis, ([per * c] * n, [per * c] * n), why)
        if inverse:  # received from rank j: its blocks q, this rank's local blocks j + n q
            y = b.call(aten.reshape.default, _contiguous(b, b.call(aten.transpose.int, b.call(aten.reshape.default, y, [n, per, c] + rest), 0, 1)), [sf * c] + rest)
    else:  # n % sf == 0: each block to one rank, in order on both sides
        sends, gets = _owned_blocks(b, axis, sf, n, c)
        args = (sends, gets) if inverse else (gets, sends)
        y = _collective(b, c10d.all_to_all_single.default, "all_to_all", _contiguous(b, y), axis, args, why)
    return _contiguous(b, b.call(aten.movedim.int, y, 0, d)) if moved else y
