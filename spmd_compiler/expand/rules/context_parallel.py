"""Context-parallel attention: each rank's query rows against the keys they need.

With ``Plan(context_parallel=ContextParallel(axis=...))`` (:mod:`spmd_compiler.plan.context`)
and query, key and value split by sequence rows over that axis, :mod:`.attention` hands
the fused kernel (forward or backward) here instead of gathering. Terms: ``n`` ranks on
the axis; a *block* is one rank's key/value rows; *step* ``t`` processes the block of
rank ``s = (r - t) mod n`` (the source); a *call* is one kernel call of a query chunk
against a key chunk; the local query rows are ``m`` *chunks* of ``c`` rows (``m = 2``:
the head-tail layout under a causal mask, else 1).

* **Blocks.** Each step's calls are the same on every rank (one graph for all); which
  chunks they take is a run-time choice from the coordinate. Head-tail, causal: step 0
  is the rank's own block, the head against itself (causal), the tail against the head
  (full) and itself (causal); at a step whose source comes before the rank, head and tail
  each against the source's head; after it, the tail against the source's head and tail:
  two full ``c x c`` calls per step, ``2 n c^2`` per rank, a ``1/n`` share of the causal
  work. Contiguous pieces under a causal mask compute each block and drop the ones above
  the diagonal (unbalanced). Without a mask, every block is one full call.
* **Merging.** Each call returns its output and logsumexp; the outputs are combined
  with the logsumexp (online softmax: ``L = logaddexp(L, l)``, ``O = O e^{L_old - L} +
  o e^{l - L}``), which is the kernel's own result for the whole row. A run-time choice
  of chunk merges into every chunk with the others' logsumexp lowered by ``1e300``
  (``e^{-1e300} = 0``: the exact identity), so no chunk is written at a run-time offset.
* **Backward.** The kernel's backward of one call, given the whole rows' output and
  logsumexp, is that block's exact share of the query, key and value gradients (its
  ``P = exp(S - L)`` are the whole softmax's entries). Query gradients add up per chunk;
  key/value gradients go back to their block's rank.
* **Methods.** ``"allgather"``: keys and values of every rank in one all_gather per
  attention (forward and backward); key/value gradients back with one reduce_scatter.
  ``"ring"``: the block passed to the next rank (an all_to_all whose split sizes send the
  whole block to ``r + 1``, read from the coordinate), ``n - 1`` times, each transfer
  issued before the step that computes the block in hand; in backward the key/value
  gradients travel along with their block and reach its rank after ``n`` transfers.

The CPU kernel and CUDA's flash, efficient and cuDNN kernels (forward and backward) each
have an adapter (:class:`Kernel`): how a block is called and how its logsumexp is laid
out. Numerics are tested with the CPU kernel; the CUDA kernels' programs on fake CUDA
tensors (their meta kernels), since they cannot run here.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..builder import SubgraphBuilder
from ..collectives import _contiguous, _nbytes

__all__ = ["supports", "forward", "backward"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

CPU_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_LOWER = 1e300  # subtracted from a logsumexp: e^{-1e300} == 0 in every float dtype
SEQ = 2


def supports(op: Any, rows: int, chunks: int) -> bool:
    """Whether ``op`` (a fused attention kernel) has a context-parallel form here for
    ``rows`` local query rows cut in ``chunks`` (the efficient kernel: blocks of a
    multiple of 32 rows, its logsumexp's padding)."""
    kernel = KERNELS.get(op)
    return kernel is not None and rows % chunks == 0 and (rows // chunks) % kernel.row_block == 0


# ------------------------------------------------------------------ blocks and calls
class _Call:
    """One kernel call: query chunk ``q`` against key chunk ``k`` of the step's block
    (each an int or a run-time int node), causal or not; ``keep`` a run-time 0/1 (None:
    always kept)."""

    def __init__(self, q: Any, k: Any, causal: bool, keep: Any = None) -> None:
        self.q, self.k, self.causal, self.keep = q, k, causal, keep


def _schedule(b: SubgraphBuilder, axis: int, n: int, chunks: int, causal: bool) -> list[list[_Call]]:
    coord = b.coords[axis]
    steps: list[list[_Call]] = []
    for t in range(n):
        late = b.call(operator.gt, t, coord) if t else False  # the source comes after this rank
        if not causal:
            steps.append([_Call(0, 0, False)])
        elif chunks == 1:  # contiguous pieces: the block above the diagonal is computed and dropped
            steps.append([_Call(0, 0, True)] if t == 0 else [_Call(0, 0, False, b.call(operator.not_, late))])
        elif t == 0:
            steps.append([_Call(0, 0, True), _Call(1, 0, False), _Call(1, 1, True)])
        else:  # before: head and tail x the source's head; after: the tail x the source's head and tail
            steps.append([_Call(late, 0, False), _Call(1, late, False)])
    return steps


def _take(b: SubgraphBuilder, x: fx.Node, sel: Any, rows: int) -> fx.Node:
    """Chunk ``sel`` (an int or a run-time int) of ``rows`` rows along the sequence dim."""
    if rows == x.meta["val"].shape[SEQ]:
        return x
    start = sel * rows if isinstance(sel, int) else b.call(operator.mul, sel, rows)
    return b.call(aten.narrow.default, x, SEQ, start, rows)


def _is(b: SubgraphBuilder, sel: Any, j: int, keep: Any) -> Any:
    """Whether a call into chunk ``sel`` (kept when ``keep``) lands in chunk ``j``: True,
    False, or a run-time bool."""
    hit = (sel == j) if isinstance(sel, int) else b.call(operator.eq, sel, j)
    if keep is None or hit is False:
        return hit
    return keep if hit is True else b.call(operator.and_, hit, keep)


def _scaled(b: SubgraphBuilder, x: fx.Node, flag: Any) -> fx.Node:
    return x if flag is True else b.call(aten.mul.Scalar, x, flag)


def _add(b: SubgraphBuilder, acc: fx.Node | None, x: fx.Node) -> fx.Node:
    return x if acc is None else b.call(aten.add.Tensor, acc, x)


# ------------------------------------------------------------------ kernels
_OPS = {name: getattr(aten, name, None) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")}


class Kernel:
    """One fused kernel family as blocks see it: a forward call returning the output, the
    logsumexp as ``[B, H, rows]`` and the call's other results; a backward call taking that
    logsumexp back. ``lse``: the kernel's own layout of it, ``"rows"`` (CPU, flash),
    ``"padded"`` (efficient: rows padded to 32, so blocks of a multiple of 32 rows only) or
    ``"column"`` (cuDNN: ``[B, H, rows, 1]``)."""

    def __init__(self, forward: Any, backward: Any, lse: str, row_block: int = 1) -> None:
        self.forward_op, self.backward_op, self.lse, self.row_block = forward, backward, lse, row_block

    def call(self, b: SubgraphBuilder, q: fx.Node, k: fx.Node, v: fx.Node, causal: bool, scale: Any) -> tuple[fx.Node, fx.Node, list]:
        op = self.forward_op
        if op is CPU_FORWARD:
            node = b.call(op, q, k, v, 0.0, causal, scale=scale)
        elif self.lse == "rows":  # flash
            node = b.call(op, q, k, v, 0.0, causal, False, scale=scale)
        elif self.lse == "padded":  # efficient
            node = b.call(op, q, k, v, None, True, 0.0, causal, scale=scale)
        else:  # cuDNN
            node = b.call(op, q, k, v, None, True, 0.0, causal, False, scale=scale)
        items = b.getitems(node)
        return items[0], self.rows(b, items[1], q.meta["val"].shape[SEQ]), items

    def rows(self, b: SubgraphBuilder, lse: fx.Node, rows: int) -> fx.Node:
        """The kernel's logsumexp as ``[B, H, rows]``."""
        if self.lse == "column":
            return b.call(aten.squeeze.dim, lse, -1)
        if self.lse == "padded" and lse.meta["val"].shape[-1] != rows:
            return b.call(aten.narrow.default, lse, -1, 0, rows)
        return lse

    def layout(self, b: SubgraphBuilder, lse: fx.Node) -> fx.Node:
        """``[B, H, rows]`` back in the kernel's layout (rows a multiple of 32 for efficient)."""
        return b.call(aten.unsqueeze.default, lse, -1) if self.lse == "column" else lse

    def backward(self, b: SubgraphBuilder, go: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, out: fx.Node, lse: fx.Node, causal: bool,
                 scale: Any, extra: dict[str, Any]) -> list[fx.Node]:
        op, lse = self.backward_op, self.layout(b, lse)
        rows_q, rows_k = q.meta["val"].shape[SEQ], k.meta["val"].shape[SEQ]
        seed, offset = extra.get("philox_seed"), extra.get("philox_offset")
        if op is CPU_BACKWARD:
            node = b.call(op, go, q, k, v, out, lse, 0.0, causal, scale=scale)
        elif self.lse == "rows":
            node = b.call(op, go, q, k, v, out, lse, None, None, rows_q, rows_k, 0.0, causal, seed, offset, scale=scale)
        elif self.lse == "padded":
            node = b.call(op, go, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        else:
            node = b.call(op, go, q, k, v, out, lse, seed, offset, None, None, None, rows_q, rows_k, 0.0, causal, scale=scale)
        return b.getitems(node)[:3]


_KERNELS = [Kernel(CPU_FORWARD, CPU_BACKWARD, "rows")]
for _fwd, _bwd, _lse, _block in (("flash", "flash", "rows", 1), ("efficient", "efficient", "padded", 32), ("cudnn", "cudnn", "column", 1)):
    _f, _b = _OPS[f"_scaled_dot_product_{_fwd}_attention"], _OPS[f"_scaled_dot_product_{_bwd}_attention_backward"]
    if _f is not None and _b is not None:  # a kernel this torch lacks is skipped
        _KERNELS.append(Kernel(_f.default, _b.default, _lse, _block))
KERNELS = {op: kernel for kernel in _KERNELS for op in (kernel.forward_op, kernel.backward_op)}
FORWARD_OPS = {kernel.forward_op for kernel in _KERNELS}


# ------------------------------------------------------------------ blocks in hand
def _issue(b: SubgraphBuilder, op: Any, x: fx.Node, axis: int, args: tuple, kind: str, reason: str, wire: int) -> fx.Node:
    n = b.mctx.shape[axis]
    size = _nbytes(x.meta["val"]) * (n if kind == "all_gather" else 1)
    meta = {"spmd_comm": {"kind": kind, "axis": axis, "axis_name": b.mctx.axis_names[axis], "group_size": n, "reason": reason,
                          "bytes": size, "wire_bytes": wire, "dtype": str(x.meta["val"].dtype).replace("torch.", "")}}
    return b.call(op, x, *args, b.mctx.group_names[axis], meta=meta)


def _wait(b: SubgraphBuilder, started: fx.Node) -> fx.Node:
    return b.call(c10d.wait_tensor.default, started, meta={"spmd_wait": True})


def _rotate(b: SubgraphBuilder, x: fx.Node, axis: int, reason: str) -> fx.Node:
    """Send ``x`` to the next rank on ``axis``, receive the previous rank's (issued; wait later)."""
    n, coord = b.mctx.shape[axis], b.coords[axis]
    rows = x.meta["val"].shape[0]
    dst = b.call(operator.mod, b.call(operator.add, coord, 1), n)
    src = b.call(operator.mod, b.call(operator.add, coord, n - 1), n)
    sends = [b.call(operator.mul, rows, b.call(operator.eq, dst, j)) for j in range(n)]
    gets = [b.call(operator.mul, rows, b.call(operator.eq, src, j)) for j in range(n)]
    return _issue(b, c10d.all_to_all_single.default, _contiguous(b, x), axis, (gets, sends), "all_to_all", reason,
                  _nbytes(x.meta["val"]))


def _gather_blocks(b: SubgraphBuilder, kv: fx.Node, axis: int, reason: str) -> fx.Node:
    """``kv`` (``[2, B, H, rows, D]``) of every rank: ``[2, B, H, n * rows, D]``, rank-major."""
    n = b.mctx.shape[axis]
    moved = _contiguous(b, b.call(aten.movedim.int, kv, SEQ + 1, 0))
    started = _issue(b, c10d.all_gather_into_tensor.default, moved, axis, (n,), "all_gather", reason,
                     (n - 1) * _nbytes(kv.meta["val"]))
    return b.call(aten.movedim.int, _wait(b, started), 0, SEQ + 1)


def _source_block(b: SubgraphBuilder, every: fx.Node, axis: int, t: int, rows: int) -> fx.Node:
    """The block of step ``t``'s source, ``(coord - t) mod n``, from the gathered blocks."""
    if t == 0:
        source = b.coords[axis]
    else:
        source = b.call(operator.mod, b.call(operator.add, b.coords[axis], b.mctx.shape[axis] - t), b.mctx.shape[axis])
    return b.call(aten.narrow.default, every, SEQ + 1, b.call(operator.mul, source, rows), rows)


def _blocks(b: SubgraphBuilder, kv: fx.Node, axis: int, method: str, reason: str):
    """Yield ``(t, block)`` for every step: the block in hand at step ``t``."""
    n, rows = b.mctx.shape[axis], kv.meta["val"].shape[SEQ + 1]
    if method == "allgather":
        every = _gather_blocks(b, kv, axis, f"{reason}: every rank's keys and values (context parallel, all-gather)")
        for t in range(n):
            yield t, _source_block(b, every, axis, t, rows)
        return
    block = kv
    for t in range(n):
        started = _rotate(b, block, axis, f"{reason}: keys and values to the next rank (ring attention)") if t + 1 < n else None
        yield t, block
        if started is not None:
            block = _wait(b, started)


# ------------------------------------------------------------------ forward and backward
def forward(b: SubgraphBuilder, kernel: Kernel, q: fx.Node, k: fx.Node, v: fx.Node, *, axis: int, causal: bool, chunks: int,
            method: str, scale: Any, reason: str) -> tuple[fx.Node, fx.Node, list]:
    """This rank's output and logsumexp rows (in its local order, the logsumexp in the
    kernel's layout), and the first call's results (the kernel's other outputs)."""
    n = b.mctx.shape[axis]
    m = chunks if causal else 1
    rows = q.meta["val"].shape[SEQ]
    c = rows // m
    kv = b.call(aten.stack.default, [k, v])
    outs: list[Any] = [None] * m
    lses: list[Any] = [None] * m
    steps = _schedule(b, axis, n, m, causal)
    first: list = []
    for t, block in _blocks(b, kv, axis, method, reason):
        kb, vb = b.getitems(b.call(aten.unbind.int, block))
        for call in steps[t]:
            o, lse, items = kernel.call(b, _take(b, q, call.q, c), _take(b, kb, call.k, c), _take(b, vb, call.k, c), call.causal, scale)
            first = first or items
            o = b.call(aten._to_copy.default, o, dtype=lse.meta["val"].dtype) if o.meta["val"].dtype != lse.meta["val"].dtype else o
            for j in range(m):
                lands = _is(b, call.q, j, call.keep)
                if lands is False:
                    continue
                if outs[j] is None:  # the chunk's first call: static, kept
                    outs[j], lses[j] = o, lse
                    continue
                lowered = lse if lands is True else b.call(
                    aten.sub.Scalar, lse, b.call(operator.mul, _LOWER, b.call(operator.not_, lands)))
                outs[j], lses[j] = _merge(b, outs[j], lses[j], o, lowered)
    out = outs[0] if m == 1 else b.call(aten.cat.default, outs, SEQ)
    lse = lses[0] if m == 1 else b.call(aten.cat.default, lses, SEQ)
    if out.meta["val"].dtype != q.meta["val"].dtype:
        out = b.call(aten._to_copy.default, out, dtype=q.meta["val"].dtype)
    return out, kernel.layout(b, lse), first


def _merge(b: SubgraphBuilder, out: fx.Node, lse: fx.Node, o: fx.Node, l: fx.Node) -> tuple[fx.Node, fx.Node]:
    total = b.call(aten.logaddexp.default, lse, l)
    keep = b.call(aten.unsqueeze.default, b.call(aten.exp.default, b.call(aten.sub.Tensor, lse, total)), -1)
    add = b.call(aten.unsqueeze.default, b.call(aten.exp.default, b.call(aten.sub.Tensor, l, total)), -1)
    return b.call(aten.add.Tensor, b.call(aten.mul.Tensor, out, keep), b.call(aten.mul.Tensor, o, add)), total


def backward(b: SubgraphBuilder, kernel: Kernel, go: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, out: fx.Node, lse: fx.Node, *,
             axis: int, causal: bool, chunks: int, method: str, scale: Any, reason: str,
             extra: dict[str, Any] | None = None) -> tuple[fx.Node, fx.Node, fx.Node]:
    """This rank's query, key and value gradient rows (``extra``: the kernel's philox
    seed and offset, where it takes them)."""
    n = b.mctx.shape[axis]
    lse = kernel.rows(b, lse, q.meta["val"].shape[SEQ])
    m = chunks if causal else 1
    rows = q.meta["val"].shape[SEQ]
    c = rows // m
    kv = b.call(aten.stack.default, [k, v])
    dq: list[Any] = [None] * m
    per_step: list[fx.Node] = []  # allgather: each step's key/value gradients of its block
    carried = None  # ring: the gradients travelling with the block in hand
    steps = _schedule(b, axis, n, m, causal)
    for t, block in _blocks(b, kv, axis, method, reason):
        kb, vb = b.getitems(b.call(aten.unbind.int, block))
        dk: list[Any] = [None] * m
        dv: list[Any] = [None] * m
        for call in steps[t]:
            rq = [_take(b, x, call.q, c) for x in (go, q, out)]
            grads = kernel.backward(b, rq[0], rq[1], _take(b, kb, call.k, c), _take(b, vb, call.k, c), rq[2],
                                    _take(b, lse, call.q, c), call.causal, scale, extra or {})
            for j in range(m):
                if (hit := _is(b, call.q, j, call.keep)) is not False:
                    dq[j] = _add(b, dq[j], _scaled(b, grads[0], hit))
                if (hit := _is(b, call.k, j, call.keep)) is not False:
                    dk[j] = _add(b, dk[j], _scaled(b, grads[1], hit))
                    dv[j] = _add(b, dv[j], _scaled(b, grads[2], hit))
        dkv = b.call(aten.stack.default, [_whole(b, dk, kb), _whole(b, dv, vb)])
        if method == "allgather":
            per_step.append(dkv)
            continue
        carried = dkv if carried is None else b.call(aten.add.Tensor, _wait(b, carried), dkv)
        carried = _rotate(b, carried, axis, f"{reason}: key/value gradients along with their block (ring attention)")
    if method == "allgather":
        home = _scatter_home(b, per_step, axis, f"{reason}: key/value gradients to their ranks (context parallel, all-gather)")
    else:
        home = _wait(b, carried)
    dk_local, dv_local = b.getitems(b.call(aten.unbind.int, home))
    return (dq[0] if m == 1 else b.call(aten.cat.default, dq, SEQ)), dk_local, dv_local


def _whole(b: SubgraphBuilder, parts: list[Any], like: fx.Node) -> fx.Node:
    """A block's gradient from its chunks' (a chunk no call touched: zeros)."""
    parts = [p if p is not None else None for p in parts]
    if len(parts) == 1:
        return parts[0] if parts[0] is not None else b.call(aten.zeros_like.default, like)
    c = like.meta["val"].shape[SEQ] // len(parts)
    filled = [p if p is not None else b.call(aten.zeros_like.default, _take(b, like, j, c)) for j, p in enumerate(parts)]
    return b.call(aten.cat.default, filled, SEQ)


def _scatter_home(b: SubgraphBuilder, per_step: list[fx.Node], axis: int, reason: str) -> fx.Node:
    """Each step's gradients of its source's block, summed on the block's rank: ordered by
    source (step ``t`` held rank ``(r - t) mod n``'s block) and reduce-scattered."""
    n, coord = b.mctx.shape[axis], b.coords[axis]
    stacked = b.call(aten.stack.default, per_step)  # [n steps, 2, B, H, rows, D]
    by_source = b.call(aten.roll.default, b.call(aten.flip.default, stacked, [0]), [b.call(operator.add, coord, 1)], [0])
    x = _contiguous(b, by_source)  # [n sources, 2, B, H, rows, D]: rank-major, as reduce_scatter splits
    started = _issue(b, c10d.reduce_scatter_tensor.default, x, axis, ("sum", n), "reduce_scatter", reason,
                     (n - 1) * _nbytes(x.meta["val"]) // n)
    return b.call(aten.squeeze.dim, _wait(b, started), 0)
