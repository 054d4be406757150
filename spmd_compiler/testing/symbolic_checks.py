"""Checks of symbolic programs (``dynamic=True``) at concrete batch sizes.

A symbolic per-rank program takes each global batch size as an int input (``size_s3``)
and computes every size that depends on it (docs/dynamic_shapes.md). Its shapes are
expressions, so :func:`~spmd_compiler.testing.assert_distributed` checks it the way it
runs: for each of several global batch sizes (uneven ones included), every rank's
program is fed its coordinate and the size inputs of that call, and

* **inputs**: every input's local shape is the one-device input of that size split by
  its placements at the rank's coordinate (torch.chunk's layout: uneven and empty
  shards included) - :func:`~.checks.distribution_of` with the sizes substituted;
* **run**: the program runs on fake tensors of those shapes (no data, no
  communication: the integer nodes compute their sizes, every op its output shape), and
  every value's shape and every integer size the program computes equals what the
  program records for that size (its ``meta["val"]`` and ``meta["spmd_size_value"]``
  expressions evaluated); a size node or a collective that computes something else is
  caught here;
* **collectives**: the k-th all_reduce, all_gather and reduce_scatter gets a buffer of
  the same shape on every rank of its group (otherwise it would hang or mix rows).

The sizes a program does not serve (one of its size guards breaks) are skipped when the
sizes are the defaults and reported as a failure when they were asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..dump.format import short_source
from ..dump.sizes import SizeContext, readable
from ..expand.redistribute import COLLECTIVE_OPS

__all__ = ["default_batch_sizes", "is_symbolic", "mesh_shape_of", "served_sizes", "size_contexts", "check_run"]

_SAME_BUFFERS = ("all_reduce", "all_gather", "reduce_scatter")


def is_symbolic(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` takes batch sizes as inputs (a ``dynamic=True`` program)."""
    return any("spmd_size" in n.meta for n in gm.graph.find_nodes(op="placeholder"))


def default_batch_sizes(mesh_shape: Sequence[int]) -> list[int]:
    """Global batch sizes to check with: even and uneven over every mesh axis, fewer rows
    than ranks (empty shards), and one row."""
    n = math.prod(int(s) for s in mesh_shape) or 1
    return sorted({1, max(1, n - 1), n, n + 1, 2 * n + 1, 4 * n, 4 * n + 3})


def served_sizes(programs: list[tuple[tuple[int, ...], fx.GraphModule, Any]], sizes: Sequence[int],
                 explicit: bool) -> list[int]:
    """The sizes of ``sizes`` every program serves (all size guards hold). A size a
    program does not serve is skipped, or with ``explicit`` (the caller asked for it)
    raises AssertionError naming the guard."""
    out = []
    for b in sizes:
        broken = None
        for coord, _, step in programs:
            guards = getattr(step, "size_guards", None)
            why = guards.failing({s.symbol: b for s in step.size_symbols}) if guards is not None else None
            if why is not None:
                broken = f"the program of coordinate {coord} does not serve batch size {b}: {why}"
                break
        if broken is None:
            out.append(b)
        elif explicit:
            raise AssertionError(f"{broken}; expected batch_sizes the program serves (it compiles again for the others)")
    if not out:
        raise AssertionError(f"the program serves none of the batch sizes {list(sizes)}; pass batch_sizes= the program serves")
    return out


def mesh_shape_of(programs: list[tuple[tuple[int, ...], fx.GraphModule, Any]]) -> tuple[int, ...]:
    """The mesh shape of symbolic programs; TypeError for a bare GraphModule (its local
    sizes' definitions live on the ExpandedStep)."""
    for coord, _, step in programs:
        if step is None or not getattr(step, "size_symbols", None):
            raise TypeError(
                f"the program of coordinate {coord} takes batch sizes as inputs but came without its ExpandedStep "
                f"(a bare GraphModule); expected an ExpandedStep, CompiledStep or SimulatedTraining, whose size "
                f"definitions say what each rank's local sizes are"
            )
    return tuple(int(s) for s in programs[0][2].mctx.shape)


def size_contexts(programs: list[tuple[tuple[int, ...], fx.GraphModule, Any]], size: int) -> dict[tuple[int, ...], SizeContext]:
    """Per coordinate, the sizes of a call with global batch size ``size`` (every size
    symbol of the program gets it)."""
    mesh_shape_of(programs)
    return {coord: SizeContext(step, [size] * len(step.size_symbols)) for coord, _, step in programs}


def check_run(programs: list[tuple[tuple[int, ...], fx.GraphModule, Any]], contexts: dict[tuple[int, ...], SizeContext],
              size: int) -> None:
    """Run every rank's program on fake tensors at the sizes of ``contexts`` and compare
    its shapes, its integer sizes and its collectives' buffers (see the module doc).
    Raises AssertionError naming the rank, the batch size, the node and what differs."""
    buffers: dict[tuple[int, ...], list[tuple[str, str, tuple[int, ...], str]]] = {}
    axis_names: tuple[str, ...] = ()
    for coord, gm, step in programs:
        ctx = contexts[coord]
        axis_names = tuple(step.mctx.axis_names)
        buffers[coord] = _run(gm, ctx, coord, size)
    _same_buffers(buffers, axis_names, size)


def _where(coord: tuple[int, ...], size: int) -> str:
    return f"on the rank at coordinate {coord}, global batch size {size}"


def _source(node: fx.Node) -> str:
    """`` (from cumsum, model.py:42: y = x.cumsum(0))``: the traced node and the user's line."""
    origin = node.meta.get("spmd_origin") or {}
    if not origin.get("node"):
        return ""
    src = (origin.get("source") or "").strip().splitlines()
    if not src:
        return f" (from {origin['node']})"
    code = src[-1].split(" in ", 1)[-1].partition(": ")[2].split("  #")[0].strip()
    return f" (from {origin['node']}, {short_source(src[-1])}" + (f": {code})" if code else ")")


def _expected(val: Any, ctx: SizeContext) -> Any:
    """``val`` (a tensor, a size, a list of them) with this call's sizes, or None where the
    batch sizes do not determine it (a data-dependent size)."""
    try:
        if isinstance(val, torch.Tensor):
            return tuple(ctx.value(d) for d in val.shape)
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            return ctx.value(val)
    except ValueError:
        return None
    return None


def _run(gm: fx.GraphModule, ctx: SizeContext, coord: tuple[int, ...], size: int) -> list[tuple[str, str, tuple[int, ...], str]]:
    """Run ``gm`` on fake tensors at ``ctx``'s sizes; compare as it goes. Returns the
    collectives' (kind, axis, input shape, node name) in program order."""
    where = _where(coord, size)
    args = []
    for n in gm.graph.find_nodes(op="placeholder"):
        val = n.meta.get("val")
        if "spmd_coord" in n.meta or not isinstance(val, (torch.Tensor, torch.SymInt)):
            args.append(val)
        elif "spmd_size" in n.meta:
            args.append(ctx.value(val))
        else:
            args.append(_Empty(tuple(ctx.value(d) for d in val.shape), tuple(ctx.value(s) for s in val.stride()), val))
    mode = pt.static_fake_mode()
    with mode:
        feed = [torch.empty_strided(a.shape, a.stride, dtype=a.like.dtype, device=a.like.device) if isinstance(a, _Empty) else a
                for a in args]
    checker = _Checker(gm, ctx, where)
    try:
        with mode:
            checker.run(*feed)
    except AssertionError:
        if checker.failure is not None:  # without the notes fx's interpreter adds
            raise AssertionError(checker.failure) from None
        raise
    except pt.data_dependent_exceptions():
        pass  # a size that depends on the data: the rest of the program is not checked at this size
    except Exception as e:  # noqa: BLE001 - the program does not run at this size: report where
        node = checker.current
        raise AssertionError(
            f"{where}: the program fails at {node.name if node is not None else '?'} "
            f"({getattr(node, 'target', '?')}){_source(node) if node is not None else ''}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}; expected it to run for every batch size its size guards allow"
        ) from e
    return checker.collectives


class _Empty(NamedTuple):
    """A fake input to make: its concrete shape and strides, and the recorded value."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    like: torch.Tensor


class _Checker(fx.Interpreter):
    """Runs the per-rank graph, comparing each result with the recorded value."""

    def __init__(self, gm: fx.GraphModule, ctx: SizeContext, where: str) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.ctx, self.where = ctx, where
        self.current: fx.Node | None = None
        self.failure: str | None = None
        self.collectives: list[tuple[str, str, tuple[int, ...], str]] = []

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        out = super().run_node(n)
        if n.op == "call_function":
            try:
                self._compare(n, out)
            except AssertionError as e:
                self.failure = str(e)
                raise
            kind = COLLECTIVE_OPS.get(n.target)
            if kind in _SAME_BUFFERS:
                src = self.env.get(n.args[0]) if isinstance(n.args[0], fx.Node) else None
                axis = str((n.meta.get("spmd_comm") or {}).get("axis_name", ""))
                shape = tuple(src.shape) if isinstance(src, torch.Tensor) else ()
                self.collectives.append((kind, axis, shape, n.name))
        return out

    def _compare(self, n: fx.Node, out: Any) -> None:
        val = n.meta.get("val")
        expr = n.meta.get("spmd_size_value")
        if expr is not None and isinstance(out, (int, float)) and not isinstance(out, bool):
            want = self.ctx.value(expr) if _is_int(expr) else float(_evaluate(expr, self.ctx))
            if not math.isclose(float(out), float(want), rel_tol=1e-12, abs_tol=0.0):
                raise AssertionError(
                    f"{self.where}: size node {n.name} ({getattr(n.target, '__name__', n.target)}){_source(n)} computes "
                    f"{out}, but the program records {readable(expr, self.ctx.coordinates)} = {want} for this size; "
                    f"expected the integer nodes to compute the sizes the expansion derived (expand/emit_sizes.py)"
                )
            return
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        for i, (v, o) in enumerate(zip(vals, outs)):
            want = _expected(v, self.ctx)
            if want is None:
                continue
            got = tuple(o.shape) if isinstance(o, torch.Tensor) else o
            if isinstance(v, torch.Tensor) != isinstance(o, torch.Tensor):
                continue
            if got != want:
                what = "shape" if isinstance(v, torch.Tensor) else "size"
                recorded = [str(d) for d in v.shape] if isinstance(v, torch.Tensor) else [str(v)]
                part = f" output {i}" if len(vals) > 1 else ""
                raise AssertionError(
                    f"{self.where}: {n.name} ({n.target}){part}{_source(n)} has {what} {list(got) if what == 'shape' else got}, "
                    f"but the program records [{', '.join(recorded)}] = {list(want) if what == 'shape' else want} for this "
                    f"size; the per-rank program computes another size than it was expanded for"
                )


def _is_int(expr: Any) -> bool:
    return bool(getattr(expr, "is_integer", False))


def _evaluate(expr: Any, ctx: SizeContext) -> Any:
    from ..dump.sizes import evaluate
    from ..expand.symbolic import resolve

    return evaluate(resolve(expr, ctx.definitions), ctx.coordinates, ctx.values)


def _same_buffers(buffers: dict[tuple[int, ...], list[tuple[str, str, tuple[int, ...], str]]], axis_names: tuple[str, ...],
                  size: int) -> None:
    """The k-th collective of every rank of a group gets a buffer of one shape."""
    coords = list(buffers)
    if not coords:
        return
    first = buffers[coords[0]]
    for coord in coords[1:]:
        if len(buffers[coord]) != len(first):
            raise AssertionError(
                f"global batch size {size}: the rank at coordinate {coords[0]} issues {len(first)} collectives, the one at "
                f"{coord} {len(buffers[coord])}; expected every rank to issue the same collectives (it would hang)"
            )
    for k, (kind, axis, _, name) in enumerate(first):
        a = axis_names.index(axis) if axis in axis_names else None
        groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...], str]]] = {}
        for coord in coords:
            rest = tuple(c for i, c in enumerate(coord) if i != a) if a is not None else ()
            groups.setdefault(rest, []).append((coord, buffers[coord][k][2], buffers[coord][k][3]))
        for members in groups.values():
            shapes = {shape for _, shape, _ in members}
            if len(shapes) > 1:
                held = ", ".join(f"{c}: {node} {list(s)}" for c, s, node in members)
                raise AssertionError(
                    f"global batch size {size}: {kind} over mesh axis {axis or '?'} (collective {k} of the program) gets "
                    f"buffers of different shapes on the ranks of one group ({held}); expected one shape on every rank "
                    f"(an uneven shard must be padded to the largest piece before it is communicated)"
                )
