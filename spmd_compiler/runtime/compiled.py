"""Stage 6: the compile-and-run API.

:func:`compile` wraps a single-device ``train_step(model, optimizer, *batch)``. The
first call distributes the model and optimizer (parameters become DTensors), then the
driver (:mod:`spmd_compiler.driver`) traces the step on the global example batch,
expands it for this rank, optimizes it and checks that every rank compiled the same
program. Later calls with the same signature run the cached per-rank graph on the local
tensors directly: no tracing and no DTensor dispatch on the per-step path. A new dtype,
shape of an unsharded dim, or optimizer state appearing after the first step, compiles
again (logged at INFO with the reason); a new sharded batch size compiles once more, a
symbolic program that serves every later size (``dynamic=None``, the default;
docs/dynamic_shapes.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.distributed.tensor import DTensor

from .. import _private_torch as pt
from ..driver import StepDriver, build_program, exchange, global_batch, is_host_scalar, program_inputs, store_outputs
from ..driver.failure import collective_failure, failed_node, is_collective_node
from ..driver.batch_digest import with_digest
from ..driver.fold import FoldChain, FoldPoint, find_fold, fold_guard_pass
from ..driver.guard import GuardError, Resync, first_effect
from ..driver.token_ids import explain_index_error
from ..expand.symbolic import concrete_shape
from ..plan import Plan
from ..trace.tracer import flatten_batch
from .executor import compile_runner
from .step_trace import ENV_TRACE, write_step_trace
from .inductor import InductorRunner, piece_runner
from .inductor_dynamic import SymbolicSizes

__all__ = ["compile", "CompiledStep"]

log = logging.getLogger(__name__)


class CompiledStep(StepDriver):
    """A training step compiled for a mesh, run on this rank's local tensors.

    Attributes:
        mesh: the DeviceMesh; ``plan``: the Plan; ``options``: the compile Options.
        compiles: how many times the step was (re)compiled.
        last: the ExpandedStep that ran last (its ``gm`` is the per-rank graph).
        fold_guard: carry the per-step check in the program's first all_reduce where it
            can (gloo; :mod:`spmd_compiler.driver.fold`); False: always the standalone check.
        checks: steps per check path ("folded", "standalone", "unchecked", "resync (...)").

    ``trace_step(path)`` times the next call and writes a Chrome/Perfetto trace of it
    (:mod:`.step_trace`; ``$SPMD_COMPILER_TRACE`` too).
    """

    fold_guard = True
    _trace_path: str | None = None  # trace_step(path): the next call is timed and written there
    _traced_env = False  # SPMD_COMPILER_TRACE: written once
    _compiles_run = 0  # compiles when the last call ran (a call that compiled has more)

    def trace_step(self, path: str | os.PathLike) -> None:
        """Time the next call node by node and write a Chrome/Perfetto trace of it to
        ``path`` (rank 0 writes every rank's spans; call it on every rank: the call
        gathers them). Open the file in ui.perfetto.dev (:mod:`.step_trace`). The
        environment variable ``SPMD_COMPILER_TRACE=path`` does the same for the first
        call that runs without compiling."""
        self._trace_path = os.fspath(path)

    def _trace_request(self) -> str | None:
        """Where this call's trace goes, if it is to be traced (and forget the request)."""
        compiled, self._compiles_run = self.compiles != self._compiles_run, self.compiles
        path, self._trace_path = self._trace_path, None
        env = os.environ.get(ENV_TRACE)
        if path is None and env and not self._traced_env and not compiled:
            path, self._traced_env = env, True
        if path is not None and self.explain:
            log.info("explain mode runs no step: no step trace for %s", path)
            return None
        return path

    def _per_shape(self) -> str | None:
        return "explain mode" if self.explain else None

    def _build(self, model: Any, optimizer: Any, batch: tuple, kwargs: dict) -> tuple[Any, dict[str, Any]]:
        mesh = self.mesh
        args, kw = global_batch(batch, kwargs, mesh, self.plan, exchange)
        if self.explain and any(p.is_meta for p in model.parameters()):
            # a model built on meta stays there in explain mode (nothing runs): so does the example batch
            args, kw = pytree.tree_map_only(torch.Tensor, lambda t: t if t.is_meta else torch.empty_like(t, device="meta"), (args, kw))
        texts: dict[str, Any] | None = self._dump_texts(batch, kwargs) if self._dumping() else None
        step = build_program(
            self.fn, model, optimizer, args, kw, mesh, self.plan, self._sizes.options(self.options, batch, kwargs) if self._sizes else self.options,
            coordinate=tuple(mesh.get_coordinate()), cache=self.cache, texts=texts,
        )
        return step, texts or {}

    def _runner(self, step: Any, gm: Any) -> Any:
        """The runner of ``gm`` (the program, or its variant carrying the step check)."""
        eager = compile_runner(gm, guard=True, check_before=first_effect(gm))
        if self.options.backend == "inductor":
            sizes = SymbolicSizes(symbols=[s.symbol for s in step.size_symbols], definitions=step.size_definitions,
                                  coordinates=step.size_coordinates) if step.size_symbols else None
            return InductorRunner(gm, eager, timings=step.timings, sizes=sizes)
        return eager

    def _run(self, step: Any, model: Any, optimizer: Any, batch: tuple, kwargs: dict, check: Callable[[], None]) -> Any:
        state = self._state(model, optimizer)
        leaves, _, _ = flatten_batch(batch, kwargs)
        feed = self._feed if step.size_symbols else []  # dynamic=True: the global sizes every rank agreed on
        inputs: list[Any] = [*step.mctx.coordinate, *feed, *(pt.local_tensor(v) for v in program_inputs(step, state, leaves))]
        if self.explain:
            check()
            vals = [n.meta["val"] for n in step.gm.graph.find_nodes(op="output")[0].args[0]]
            outs = [torch.zeros(v.shape, dtype=v.dtype, device=v.device) for v in vals]
        else:
            point = self._fold_point(step)
            attr = "folded_runner" if point is not None else "runner"
            runner = getattr(step, attr, None)
            program = getattr(step, "program_id", 1)  # its slot in the cache (driver/step.py), carried by the fold
            if runner is None or (point is not None and getattr(step, "folded_id", None) != program):
                gm = step.gm if point is None else fold_guard_pass(step.gm, point=point, program=program)
                if point is not None:
                    step.folded_gm, step.folded_id = gm, program
                runner = self._runner(step, gm)
                setattr(step, attr, runner)
            trace_path = self._trace_request()
            if trace_path is not None:  # the same program, on the eager runner timing every node
                gm = step.gm if point is None else step.folded_gm
                if self.options.backend != "eager":
                    log.warning("the traced call runs on the eager runner (backend=%r times no single node)", self.options.backend)
                runner = compile_runner(gm, guard=True, check_before=first_effect(gm), timed=True)
            try:
                with torch.no_grad():
                    outs = runner(*inputs, _check=check)
            except (Resync, GuardError):
                raise
            except (RuntimeError, IndexError) as e:  # gloo/NCCL: a timeout or a dead peer; a token id out of range
                bad_ids = explain_index_error(e, step.traced, batch, kwargs)
                if bad_ids is not None:
                    raise bad_ids from e
                if isinstance(e, IndexError) or not is_collective_node(failed_node(e, runner)):
                    raise
                raise collective_failure(e, runner, step_name=getattr(self.fn, "__name__", "step"), call=self.calls,
                                         timeout=self.options.timeout) from e
            pt.mark_optimizer_stepped(optimizer)
            if trace_path is not None:
                write_step_trace(trace_path, gm, runner.spans, coordinate=step.mctx.coordinate)
        mesh = self.mesh
        values = dict(zip((s.symbol for s in step.size_symbols), feed))

        def wrap(slot: Any, out: Any) -> Any:
            if is_host_scalar(out) or (slot.kind == "user" and all(p.is_replicate() for p in slot.spec.placements)):
                return out
            shape, stride = slot.spec.shape, slot.spec.stride
            if values and any(pt.is_symbolic(n) for n in (*shape, *stride)):  # a batch-shaped result (dynamic=True)
                shape = concrete_shape(shape, values, step.size_definitions)
                stride = concrete_shape(stride, values, step.size_definitions)
            return DTensor.from_local(out, mesh, slot.spec.placements, run_check=False, shape=shape, stride=stride)

        return store_outputs(step, outs, state, optimizer, wrap)

    def _fold_point(self, step: Any) -> FoldPoint | FoldChain | None:
        """The program's first collective over every rank, if the check can ride on it (gloo;
        under inductor the program is cut after that collective's wait, runtime/segments.py)."""
        if step.size_symbols:
            return None  # a symbolic program waits for the sizes before it starts (driver/sizes.py)
        if not self.fold_guard or self.explain or self._guard is None or not self._guard.can_fold:
            return None
        if not hasattr(step, "fold_point"):
            mctx = step.mctx  # a 2-D mesh: one fold per axis group (a FoldChain)
            point = find_fold(step.gm, world_size=dist.get_world_size(), axes=tuple(zip(mctx.group_names, mctx.shape)),
                              ids=self.options.cache_size)
            step.fold_point = with_digest(point, step) if self._checks_values() else point  # driver/batch_digest.py
        return step.fold_point


def compile(fn: Callable[..., Any] | None = None, *, mesh: Any, plan: Plan | None = None, **options: Any) -> Any:
    """Compile a single-device training step for a mesh.

    Use as a decorator or a call::

        @spmd_compiler.compile(mesh=mesh, plan=plan)
        def train_step(model, optimizer, x, y): ...

        step = spmd_compiler.compile(train_step, mesh=(4,))

    Args:
        fn: ``train_step(model, optimizer, *batch)``; each rank passes its local batch shard.
        mesh: a DeviceMesh, a shape tuple, or ``{"dp": 2, "tp": 2}``.
        plan: placements (default: data parallel).
        options: those of :class:`spmd_compiler.driver.Options`: ``fallback`` ("replicate" |
            "error"), ``symbolic`` ("batch" | "all" | "none"), ``check_ranks`` (exchange
            program fingerprints at compile, and check every step that the ranks of a
            mesh axis on which the batch is Replicate pass the same values; default True), ``dump_dir`` (write a dump
            folder per compile; ``$SPMD_COMPILER_DUMP`` too), ``passes`` (a list of
            PassSpec; default :func:`spmd_compiler.optimize.default_passes`),
            ``passes_disabled`` (pass names to skip), ``bucket_mb`` (gradient bucket size,
            25), ``first_bucket_mb`` (size of each group's first bucket, 1 as in DDP;
            None: ``bucket_mb``), ``cache_size`` (programs kept, 8), ``timeout`` (seconds a
            collective waits for the other ranks, 300; None: the process group's), ``backend``
            ("eager" | "inductor": what runs the per-rank program, default "eager";
            :mod:`spmd_compiler.runtime.inductor`), ``rng`` ("exact" | "fast": how random ops
            draw, docs/randomness.md; default "exact", the single-device numbers); ``dynamic`` (None,
            the default: automatic, as torch.compile's automatic dynamic shapes: the first call
            compiles for its exact shapes, and the first call whose sharded batch sizes differ
            (nothing else) compiles once more with them symbolic, a program every later size
            reuses, with one INFO line; a change of anything else (dtype, an unsharded dim,
            state) compiles a static program; True: one program for every size of the sharded
            batch dims from the first call, docs/dynamic_shapes.md; False: one program per
            batch shape; the ranks agree on the global sizes in the step check, and take the
            switch together; backend="inductor" compiles each segment once for every size,
            :mod:`spmd_compiler.runtime.inductor_dynamic`); ``device_type`` (the device the program is
            for, "cpu" | "cuda"; default the mesh's: a model on ``meta`` then traces SDPA as
            that device's fused kernel); and ``pipeline`` (a :class:`spmd_compiler.Pipeline`: run
            the step as a pipeline over one mesh axis; the plan then gives placements for
            the other axes).
    """
    pipeline = options.pop("pipeline", None)
    if pipeline is not None:
        from ..pipeline.api import Pipeline
        from ..pipeline.step import PipelinedStep

        if not isinstance(pipeline, Pipeline):
            raise TypeError(
                f"compile(pipeline=...) expects a spmd_compiler.Pipeline, got {type(pipeline).__name__} {pipeline!r}; "
                f"fix: pipeline=spmd_compiler.Pipeline(chunks=4, schedule='1F1B')"
            )

        pieces = piece_runner if options.get("backend") == "inductor" else None  # each stage piece compiled
        cls: Any = lambda f, **kw: PipelinedStep(f, pipeline=pipeline, piece_runner=pieces, **kw)  # noqa: E731
    else:
        cls = CompiledStep
    if fn is None:
        return lambda f: cls(f, mesh=mesh, plan=plan, **options)
    return cls(fn, mesh=mesh, plan=plan, **options)
