"""The ``backend="inductor"`` runner: the per-rank program compiled by torch's inductor.

:func:`compile_runner` (the ``"eager"`` backend) runs one aten call per node. Here the
whole per-rank GraphModule, functional collectives and in-place optimizer updates
included, goes through AOTAutograd (which functionalizes it and writes mutated inputs,
the parameters and optimizer state, back in place) and inductor (C++/OpenMP kernels on
CPU, Triton on GPU). Inductor runs ``_c10d_functional`` ops as extern kernels.

**Overlap.** Left to its defaults, inductor's scheduler undoes the schedule pass's
overlap: its peak-memory reordering puts the weight-gradient matmuls ahead of a backward
``all_reduce_`` and each ``wait_tensor`` right after its launch, so no collective
overlaps compute. A segment with collectives is therefore compiled without that pass and
with inductor's ``sink_waits`` (``reorder_for_compute_comm_overlap``; no runtime
estimates, so every rank orders the same way): launches stay where the graph has them and
each wait moves down to its first consumer (docs/architecture.md, "inductor").

**Rewrites before compiling.** A copy of each segment goes through
:func:`~.inductor_rewrites.scalars_as_tensors` (the optimizer's float ``.item()`` values
and the scalar arithmetic on them become 0-d float64 tensor ops: inductor would pass
them to its C++ kernels as 32-bit floats) and
:func:`~.inductor_rewrites.bool_collectives_as_uint8` (bool collectives on uint8 copies:
the C++ vectorizer fails on a gathered bool mask); :mod:`.inductor_rewrites` says why.

**The step guard.** Python runs in the middle of the program: the standalone check right
before the first effect, or the folded check's ``resync_if_flagged`` after the first
all_reduce's wait. The program is cut there into segments (:mod:`.segments`), each
compiled on its own, so the check keeps its overlap and its fold as on the eager runner.

**Less Python per call.** On CPU a segment is compiled with inductor's C++ wrapper (the
code that calls the kernels, matmuls and collectives is C++) and without inductor's input
size asserts (a segment is compiled once per input shape and stride): about 1 ms of a
TP GPT step's Python (benchmarks/results/step_time_inductor.md).

**Fallback.** If the C++ wrapper fails, the segment is compiled again with the Python one;
if inductor's C++ vectorizer fails on a CPU program, with scalar C++
kernels (each logged at INFO). If inductor cannot compile it at all, that segment runs on the
eager runner instead, with one WARNING naming the reason; the step never fails for it.

**A failed collective** (a dead peer, a timeout) inside the compiled program surfaces
as a CollectiveError naming the collective, as on the eager runner:
:meth:`InductorRunner.failed_node` finds the ``_c10d_functional`` call of inductor's
generated Python code that raised and maps it to the graph's node by order (inductor runs
collectives as extern kernels in the graph's order); in C++-wrapped code, which has no
Python frame, the process groups' launch counts since the segment started name the
collective launched last.

**Pipelines** (``compile(..., backend="inductor", pipeline=...)``): each stage piece
(forward, backward, optimizer) of this rank's stages is compiled on its first call
(:func:`piece_runner`), with the same fallback per piece.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..driver.batch_digest import digest_elements
from ..driver.fold import resync_if_flagged
from ..driver.guard import first_effect
from ..driver.progress import backend_done
from ..optimize.graph_utils import is_collective, is_wait
from .executor import compile_runner
from .failed_collective import collective_groups, generated_collective, last_launched
from .inductor_dynamic import SymbolicSegment, SymbolicSizes, inline_coordinates, sym_size_ops
from .inductor_rewrites import bool_collectives_as_uint8, scalars_as_tensors
from .segments import Segment, split_segments

__all__ = ["InductorRunner", "bool_collectives_as_uint8", "piece_runner", "scalars_as_tensors"]

log = logging.getLogger(__name__)


class InductorRunner:
    """Runs the per-rank program compiled by inductor, with the same calling convention as
    :func:`compile_runner`'s guarded run (``runner(*inputs, _check=check)``; without
    ``_check`` nothing is checked: a pipeline's stage piece). The program is cut into
    segments (:mod:`.segments`) where Python must run: the step check before the first
    effect, the folded check's ``resync_if_flagged``; each graph segment is compiled on its
    first call, once per input signature, or, if inductor cannot, runs on the eager runner
    after one WARNING. ``eager`` runs the whole program if it cannot be cut; ``name`` says
    what ``gm`` is in logs."""

    def __init__(self, gm: fx.GraphModule, eager: Callable[..., Any], *, timings: dict[str, float] | None = None,
                 name: str = "the per-rank program", sizes: SymbolicSizes | None = None) -> None:
        self.gm, self.eager, self.timings, self.name = gm, eager, timings if timings is not None else {}, name
        self.sizes = sizes  # dynamic=True: segments compiled once for every size (.inductor_dynamic)
        self.compiles = 0  # inductor compiles that succeeded (each segment, each variant)
        self.compiled: dict[tuple, list[Callable[..., Any] | None]] = {}  # per signature, per segment
        self.failed: str | None = None
        self.node_at_line = getattr(eager, "node_at_line", {})
        self.segments: list[Segment] | None = None
        self._params = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self._out = next(n for n in gm.graph.nodes if n.op == "output")
        self._by_name = {n.name: n for n in gm.graph.nodes}
        self._running: tuple[int, Any, dict[str, int | None]] | None = None
        self.cpp_wrapped: set[Callable[..., Any]] = set()  # compiled with inductor's C++ wrapper
        self._groups: dict[int, list[str]] = {}  # per segment: the process groups of its collectives
        templates = sizes.templates(gm) if sizes is not None else None
        self._symbolic = [t is not None for t in templates] if templates else [False] * len(self._params)

    def _key(self, inputs: tuple) -> tuple:
        # strides too: the compiled code asserts its inputs' (a stage piece may get a transposed view);
        # dynamic=True: not the sizes nor the batch's shapes (each SymbolicSegment checks them)
        return tuple((x.dim(), x.dtype, x.device) if sym and isinstance(x, torch.Tensor) else None if sym else
                     (tuple(x.shape), x.stride(), x.dtype, x.device) if isinstance(x, torch.Tensor) else x
                     for x, sym in zip(inputs, self._symbolic))

    def _segments(self, checked: bool) -> list[Segment]:
        if self.segments is None:
            folded = any(n.op == "call_function" and _is_host(n) for n in self.gm.graph.nodes)
            point = first_effect(self.gm) if checked and not folded else None  # folded: the check is in the program
            self.segments = split_segments(self.gm, host=_is_host, check_before=point)
            if len(self.segments) > 1:
                log.info("%s runs as %d segments (%s)", self.name, len(self.segments),
                         ", ".join(f"host {g.host.name}" if g.host is not None else
                                   f"{len(g.gm.graph.nodes)} nodes" + (" after the step check" if g.check_before else "")
                                   for g in self.segments))
        return self.segments

    def compile(self, gm: fx.GraphModule, inputs: tuple, name: str) -> Callable[..., Any] | None:
        """``gm`` compiled for ``inputs``' shapes; None (after one WARNING) if inductor cannot."""
        got = self._compile(gm, inputs, name, None)
        return None if got is None else got[0]

    def _compile(self, gm: fx.GraphModule, inputs: tuple, name: str, templates: list[Any] | None) -> tuple[Any, list[Any]] | None:
        """``(fn, guards)``: ``gm`` compiled for ``inputs``' shapes, or with ``templates`` for every
        size of the symbols (:func:`~spmd_compiler._private_torch.inductor_compile_symbolic`; the
        guards it relies on); None (after one WARNING) if inductor cannot."""
        t0 = time.perf_counter()
        guards: list[Any] = []
        hits, misses = pt.inductor_cache_counts()
        fn, reason = None, ""
        overlap = any(is_collective(n) for n in gm.graph.nodes)  # keep the schedule pass's overlap
        cpu = all(x.device.type == "cpu" for x in inputs if isinstance(x, torch.Tensor))
        # (vectorized kernels, C++ wrapper): the C++ wrapper on CPU first; each failure falls to the next
        attempts = [(True, True), (True, False), (False, False)] if cpu else [(True, False)]
        for vectorize, wrapper in attempts:
            try:
                copy = fx.GraphModule(gm, gm.graph.__deepcopy__())  # the reference graph stays as it is
                scalars_as_tensors(copy)
                bool_collectives_as_uint8(copy)
                if templates is None:
                    fn = pt.inductor_compile(copy, inputs, vectorize=vectorize, overlap=overlap, cpp_wrapper=wrapper)
                else:
                    sym_size_ops(copy)
                    inline_coordinates(copy, templates)
                    fn, guards = pt.inductor_compile_symbolic(copy, inputs, templates, vectorize=vectorize, overlap=overlap,
                                                              cpp_wrapper=wrapper)
                if wrapper:
                    self.cpp_wrapped.add(fn)
                break
            except Exception as e:  # noqa: BLE001 -- any compile failure falls back, by contract
                reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                log.debug("inductor failed (vectorize=%s, cpp_wrapper=%s)", vectorize, wrapper, exc_info=True)
                if wrapper:
                    log.info("inductor failed with its C++ wrapper (%s); retrying with the Python one", reason)
                elif vectorize and cpu:
                    log.info("inductor failed with vectorized C++ kernels (%s); retrying with scalar kernels", reason)
        if fn is None:
            self.failed = self.failed or reason
            log.warning("inductor could not compile %s (%s); it runs on the eager runner (backend='eager') instead",
                        name, reason)
            return None
        seconds = time.perf_counter() - t0
        hit = pt.inductor_cache_counts()[0] > hits
        self.timings["backend inductor"] = self.timings.get("backend inductor", 0.0) + seconds
        self.compiles += 1
        backend_done(f"inductor: {name} (FX graph cache {'hit' if hit else 'miss'})", seconds)
        log.info("inductor compiled %s%s in %.2fs (FX graph cache %s)", name,
                 "" if templates is None else f" for every batch size ({'; '.join(map(str, guards)) or 'no guard'})",
                 seconds, "hit" if hit else ("miss" if pt.inductor_cache_counts()[1] > misses else "unused"))
        return fn, guards

    def _segment_fn(self, gm: fx.GraphModule, inputs: tuple, name: str) -> Callable[..., Any]:
        """What runs segment ``gm``: compiled for ``inputs``' shapes, or (dynamic=True) a
        :class:`~.inductor_dynamic.SymbolicSegment` compiled once for every size."""
        templates = self.sizes.templates(gm) if self.sizes is not None else None
        if templates is None:
            return self.compile(gm, inputs, name) or compile_runner(gm)
        return SymbolicSegment(gm, templates, self.sizes, name, lambda a, t, n: self._compile(gm, a, n, t), compile_runner(gm))

    def failed_node(self, error: BaseException) -> fx.Node | None:
        """The collective (or wait) node of ``gm`` whose call raised ``error`` (a dead peer,
        a timeout), for :func:`~spmd_compiler.driver.failure.collective_failure`; None if it
        was not one. In inductor's generated code: inductor keeps a segment's collectives
        in order, and its waits too as long as ``sink_waits`` moves no wait past another
        (two collectives in flight at once whose waits the graph orders differently: not
        seen in the TP programs), so the i-th wait of the code is the segment's i-th wait;
        if the counts differ, None rather than a wrong name. In code with inductor's C++
        wrapper (no Python frame): the collective launched last, by the process groups' launch
        counts (:func:`~.failed_collective.last_launched`). In a segment on the eager runner: the line of its
        generated code."""
        if self._running is None:
            return None
        index, fn, launched = self._running
        seg = self.segments[index]
        node = None
        where = generated_collective(error)
        if where is not None:
            wait, i, count = where
            nodes = [n for n in seg.gm.graph.nodes if (is_wait(n) if wait else is_collective(n))]
            if count == len(nodes):
                node = nodes[i]
            else:
                log.debug("inductor's code has %d %s, the segment %d: cannot name the failed one", count,
                          "waits" if wait else "collectives", len(nodes))
        if node is None and launched:
            node = last_launched(seg.gm, launched)
        lines = getattr(fn, "node_at_line", {})
        for frame, lineno in traceback.walk_tb(error.__traceback__):
            if frame.f_code.co_filename.startswith("<spmd_compiler per-rank step"):
                node = lines.get(lineno, node)
        return None if node is None else self._by_name.get(node.name, node)

    def __call__(self, *inputs: Any, _check: Callable[[], None] | None = None) -> Any:
        try:
            segments = self._segments(_check is not None)
        except Exception as e:  # noqa: BLE001 -- cannot cut: the whole program runs eagerly, by contract
            if self.failed is None:
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("could not cut %s into segments for inductor (%s); it runs on the eager runner "
                            "(backend='eager') instead", self.name, self.failed)
            self.segments = []
        if not segments:
            return self.eager(*inputs) if _check is None else self.eager(*inputs, _check=_check)
        fns = self.compiled.setdefault(self._key(inputs), [None] * len(segments))
        env = dict(zip(self._params, inputs))
        pending = _check
        if pending is not None and not any(g.check_before for g in segments):
            pending()  # no effect to run before (or folded: the check is a no-op there)
            pending = None
        for i, seg in enumerate(segments):
            if seg.check_before and pending is not None:
                pending()  # the ops before the first effect ran meanwhile
                pending = None
            args = [env[name] for name in seg.inputs]
            if seg.boxed:  # host floats as float64 tensors (runtime/segments.py)
                args = [torch.tensor(a, dtype=torch.float64, device=seg.device) if name in seg.boxed else a
                        for name, a in zip(seg.inputs, args)]
            if seg.host is not None:
                host = seg.host
                env[host.name] = host.target(*fx.map_arg(host.args, lambda a: env[a.name]),
                                             **fx.map_arg(host.kwargs, lambda a: env[a.name]))
            else:
                fn = fns[i]
                if fn is None:
                    part = self.name if len(segments) == 1 else f"{self.name} (segment {i + 1} of {len(segments)})"
                    fn = fns[i] = self._segment_fn(seg.gm, tuple(args), part)
                groups = self._groups.get(i) if fn in self.cpp_wrapped or isinstance(fn, SymbolicSegment) else ()
                if groups is None:
                    groups = self._groups[i] = collective_groups(seg.gm)
                self._running = (i, fn, {g: pt.collectives_launched(g) for g in groups})
                with torch.no_grad():
                    outs = fn(*args)
                self._running = None
                env.update(zip(seg.outputs, outs))
            for name in seg.free:
                env.pop(name, None)
        return list(fx.map_arg(self._out.args[0], lambda a: env[a.name]))


def _is_host(n: fx.Node) -> bool:
    """A node that runs in Python between compiled segments (the folded check, and the
    batch digest it carries: driver/batch_digest.py)."""
    return n.target is resync_if_flagged or n.target is digest_elements


_PIECE_KINDS = {"G": "parameter", "F": "forward", "B": "backward", "O": "optimizer"}


def piece_runner(piece: Any, timings: dict[str, float]) -> InductorRunner:
    """The runner of one stage piece of a pipeline (``compile(..., backend="inductor",
    pipeline=...)``): the piece's GraphModule compiled by inductor on its first call, or
    run as it is after one WARNING if inductor cannot compile it. Compile time adds up in
    ``timings["backend inductor"]``."""
    name = f"stage {piece.stage}'s {_PIECE_KINDS.get(piece.kind, piece.kind)} piece ({piece.kind})"
    return InductorRunner(piece.gm, piece.gm, timings=timings, name=name)
