"""``compile(..., pipeline=Pipeline(...))``: a compiled step run as a pipeline.

The step is traced on one micro-batch with stage markers, expanded over the whole mesh
(Replicate on the pipeline axis, so no collective crosses it), split into per-stage
programs, and run by a :class:`~.runtime.PipelineRunner` on each rank. After the first
compile each rank keeps only the parameters (and optimizer state) of its own stages,
under their original FQNs: ``model.state_dict()`` on a rank holds that stage's subset.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import pathlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..driver import StepDriver, exchange, expand, gc_paused, global_batch, is_host_scalar, store_outputs
from ..driver.batch import sharded_batch_dims
from ..driver.dynamic import expand_dynamic
from ..driver.failure import collective_failure
from ..driver.progress import stage_done
from ..driver.rng import AxesRngSync
from ..driver.token_ids import explain_index_error
from ..errors import SpmdError
from ..expand.symbolic import SizeGuards, size_symbols_of
from ..trace import trace
from ..trace.host_values import resolve_constant
from ..trace.state import input_value
from ..trace.tracer import flatten_batch
from .api import Pipeline, check_split_points, pipeline_plan
from .balance import balanced_split
from .batchnorm import defer_batchnorm_stats
from .ghosts import StageOwnership
from .partition import assign_stages
from .runtime import PipelineRunner
from .sizes import MicroBatchSizes, per_shape_reason, size_reader
from .stages import split_program
from .timeline import chrome_trace_events, format_timeline

__all__ = ["PipelinedStep"]


log = logging.getLogger(__name__)


class PipelinedStep(StageOwnership, StepDriver):
    """A compiled step whose program runs as a pipeline over ``pipeline.axis`` (built on
    the same driver as :class:`~spmd_compiler.CompiledStep`: signature cache, agreement)."""

    checks_batch_values = False  # its stages read different parts of the batch (driver/batch_digest.py)

    def __init__(self, fn: Any, *, mesh: Any, plan: Any = None, pipeline: Pipeline, piece_runner: Any = None,
                 **options: Any) -> None:
        self.pipeline = pipeline  # read by _per_shape, during StepDriver.__init__
        super().__init__(fn, mesh=mesh, plan=plan, **options)
        if self.options.backend != "eager" and piece_runner is None:
            raise ValueError(f"backend={self.options.backend!r} needs a piece_runner for the stage pieces; "
                             f"fix: compile through spmd_compiler.compile(..., pipeline=...)")
        if self.options.memory_budget_gb is not None:
            raise ValueError(f"compile(memory_budget_gb={self.options.memory_budget_gb}) is not checked for pipelined steps yet "
                             f"(their memory is per stage and micro-batch, not one program's static trace); fix: leave it out, "
                             f"or check the plan's memory without pipeline= first")
        self.pipeline = pipeline
        self.piece_runner = piece_runner  # (piece, timings) -> runner of the piece; None: its GraphModule
        self._ghosts: dict[str, tuple[Any, ...]] = {}  # dropped params: shape, dtype, device, grad, group, position
        self._ghost_states: dict[str, dict[str, Any]] = {}  # their optimizer state: key -> (shape, dtype)
        self._ghost_buffers: dict[str, tuple[Any, ...]] = {}  # dropped buffers: shape, dtype, device
        self.runner: PipelineRunner | None = None
        self.last_timeline: list[Any] = []
        self._user_plan = self.plan

    def _per_shape(self) -> str | None:
        return per_shape_reason(self.options.backend, self.explain)

    def _batch_sizes(self, exchanged: bool) -> Any:
        """dynamic=True: the programs take micro-batch sizes (:mod:`.sizes`)."""
        sizes = super()._batch_sizes(exchanged)
        if sizes is None:
            return None
        return MicroBatchSizes(self.mesh, self.plan, exchanged, chunks=self.pipeline.chunks, no_chunk=tuple(self.pipeline.no_chunk))

    # ------------------------------------------------------------------ mesh and plan
    @property
    def pp_index(self) -> int:
        return self.pipeline.axis_index(self.mesh)

    @property
    def full_plan(self) -> Any:
        return pipeline_plan(self._user_plan, self.pp_index, self.mesh.ndim)

    @property
    def stage_mesh(self) -> Any:
        """The mesh each stage is expanded over: the axes other than the pipeline axis
        (the whole mesh when the pipeline axis is its only axis; everything is Replicate
        along it either way, so no collective crosses stages)."""
        mesh = self.mesh
        if mesh.ndim == 1:
            return mesh
        names = [n for n in mesh.mesh_dim_names if n != self.pipeline.axis]
        return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]

    @property
    def stage_plan(self) -> Any:
        """The user's plan (for the non-pipeline axes) with the pipeline's batch default;
        FSDP parameters gathered once per step and stage (one gather for forward and
        backward, hoisted into the stage's G piece) unless the pipeline reshards between
        micro-batches."""
        plan = self.full_plan if self.mesh.ndim == 1 else pipeline_plan(self._user_plan, None, self.mesh.ndim)
        if not self.pipeline.reshard_between_microbatches:
            plan = dataclasses.replace(plan, reshard_after_forward=False)
        return plan

    def _full_placements(self, placements: Any) -> list[Any]:
        """Stage-mesh placements widened with Replicate on the pipeline axis."""
        out = list(placements)
        if len(out) == self.mesh.ndim - 1:
            out.insert(self.pp_index, Replicate())
        return out

    def distribute(self, model: torch.nn.Module, optimizer: Any = None, *, _batch: Any = None) -> None:
        self.plan = self.full_plan
        super().distribute(model, optimizer, _batch=_batch)

    # ------------------------------------------------------------------ batch
    def _global_batch(self, batch: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The global example batch of one micro-batch."""
        args, kw = global_batch(batch, kwargs, self.mesh, self.plan, exchange)
        m = self.pipeline.chunks
        leaves, spec, paths = flatten_batch(args, kw)
        mine = flatten_batch(batch, kwargs)[0]
        out = []
        for path, leaf, local in zip(paths, leaves, mine):
            if isinstance(leaf, torch.Tensor) and path not in self.pipeline.no_chunk:
                if leaf.dim() and local.shape[0] != leaf.shape[0] and local.shape[0] % m:  # a shard: each rank cuts its own
                    raise ValueError(
                        f"{path}: this rank holds {local.shape[0]} of its {leaf.shape[0]} rows, which do not split into {m} "
                        f"equal micro-batches (each rank cuts its own shard); fix: a batch size that gives every rank a "
                        f"multiple of chunks={m} rows (a multiple of {m} x the ranks sharing the batch)"
                    )
                if leaf.dim() == 0 or leaf.shape[0] < m:
                    raise ValueError(
                        f"{path} has {leaf.shape[0] if leaf.dim() else 0} rows but chunks={m}: expected at least one "
                        f"row per micro-batch. fix: chunks <= {leaf.shape[0] if leaf.dim() else 1}, or list it in "
                        f"Pipeline(no_chunk=[{path!r}])"
                    )
                if leaf.shape[0] % m:
                    raise ValueError(f"{path} has {leaf.shape[0]} rows, which do not split into {m} equal micro-batches; fix: a batch size divisible by chunks")
                leaf = torch.empty((leaf.shape[0] // m, *leaf.shape[1:]), dtype=leaf.dtype, device=leaf.device)
            out.append(leaf)
        return pytree.tree_unflatten(out, spec)

    # ------------------------------------------------------------------ compile
    def _build(self, model: Any, optimizer: Any, batch: tuple, kwargs: dict) -> tuple[Any, dict[str, Any]]:
        """Trace one micro-batch with stage markers, expand it over the stage mesh, split
        it into stage programs and make this rank's runner."""
        mesh, cfg = self.mesh, self.pipeline
        pp_index = self.pp_index
        pp = mesh.shape[pp_index]
        check_split_points(model, cfg.split)
        split = dict(cfg.split or {})
        stages = pp * cfg.stages_per_rank
        if cfg.auto and not split:
            with self._ghosted(model, optimizer):
                split = balanced_split(model, stages, "params")
        g_args, g_kwargs = self._global_batch(batch, kwargs)
        smesh = self.stage_mesh
        dynamic = self.options.dynamic and self._sizes is not None
        # dynamic=True: the micro-batch sizes are symbols, fed as size_* inputs (.sizes)
        dims = None
        if dynamic:  # a tensor passed whole to every micro-batch (no_chunk) keeps its static size
            paths = flatten_batch(g_args, g_kwargs)[2]
            dims = sharded_batch_dims(self.stage_plan, g_args, g_kwargs, smesh.ndim, dynamic=True)
            dims = {i: () if paths[i] in cfg.no_chunk else d for i, d in dims.items()}
        with self._ghosted(model, optimizer), gc_paused():
            traced = trace(
                self.fn, model, optimizer, *g_args, symbolic=self.symbolic, split_points=split, fused_optimizer=False,
                symbolic_dims=dims, dynamic=dynamic, device_type=self.options.device_type or smesh.device_type,
                mixed_precision=self.options.mixed_precision, **g_kwargs
            )
        stage_done("trace", traced.trace_seconds, f"{len(traced.gm.graph.nodes):,} nodes")
        _refuse_kept_gradients(traced)
        defer_batchnorm_stats(traced.gm, cfg.chunks)
        assignment = assign_stages(traced.gm, traced.outputs)
        if assignment.num_stages != stages:
            raise ValueError(
                f"the step cuts into {assignment.num_stages} stage(s) ({assignment.num_stages - 1} split point(s)) but "
                f"the pipeline needs {stages} = {pp} ranks on axis {cfg.axis!r} x {cfg.stages_per_rank} stage(s) per rank; "
                f"fix: give {stages - 1} split points (Pipeline(split=...) or pipe_split() calls) or Pipeline(auto=True)"
            )
        with gc_paused():
            kw = dict(coordinate=tuple(smesh.get_coordinate()), fallback=self.fallback, cache=self.cache)
            if dynamic:
                step = expand_dynamic(lambda t, **k: expand(t, smesh, self.stage_plan, **k), traced, **kw)
            else:
                step = expand(traced, smesh, self.stage_plan, **kw)
        if step.size_symbols:  # every decision on a size symbol is a guard (no passes run on a pipeline)
            shape_env = pt.shape_env_of(pt.fake_mode_of(traced.placeholders()[step.size_symbols[0].index].meta["val"]))
            step.size_guards = SizeGuards(shape_env, step.size_symbols, step.size_definitions, step.size_coordinates,
                                          size_symbols_of(traced, every=True))
        stage_done("expand", step.timings.get("expand", 0.0) + step.timings.get("rebuild", 0.0),
                   f"{len(step.gm.graph.nodes):,} nodes, {len(step.collectives())} collectives")
        program = split_program(step.gm, assignment, hoist_params=not cfg.reshard_between_microbatches)
        coord = list(mesh.get_coordinate())
        self._optimize_pieces(step, program, [s for s in range(stages) if s % pp == coord[pp_index]])
        stage_done("passes", step.timings.get("passes", 0.0), f"{len(program.pieces)} stage pieces")
        mesh_ranks = mesh.mesh

        def stage_rank(stage: int) -> int:
            c = list(coord)
            c[pp_index] = stage % pp
            return int(mesh_ranks[tuple(c)].item())

        step.pipeline = PipelineRunner(
            program, pp_size=pp, pp_coord=coord[pp_index], stage_rank=stage_rank, chunks=cfg.chunks,
            schedule=cfg.schedule, stages_per_rank=cfg.stages_per_rank, scale_grads=cfg.scale_grads,
            pp_group=mesh.get_group(pp_index), checkpoint=cfg.checkpoint, rng_sync=self._stage_rng_sync(),
            piece_runner=None if self.piece_runner is None else (lambda piece: self.piece_runner(piece, step.timings)),
        )
        step.assignment = assignment
        step.program = program
        return step, {}

    def _optimize_pieces(self, step: Any, program: Any, mine: list[int]) -> None:
        """The passes (``compile(passes=...)``, default :func:`~spmd_compiler.optimize.default_passes`)
        on every piece of this rank's stages: gathers fused per unit in G, gradient
        reductions bucketed in O, collectives overlapped in F and B. Each piece keeps its
        inputs and outputs (the runner binds them by position)."""
        from ..optimize import run_passes

        passes = self.options.pass_list()
        if not passes:
            return
        t0 = time.perf_counter()
        for (s, kind), piece in sorted(program.pieces.items()):
            if s in mine:
                piece.gm, records = run_passes(piece.gm, passes, disabled=self.passes_disabled)
                for r in records:
                    step.timings[f"pass {r.name}"] = step.timings.get(f"pass {r.name}", 0.0) + r.seconds
        step.timings["passes"] = time.perf_counter() - t0

    def _memory(self, step: Any, batch: tuple, kwargs: dict) -> Any:
        """None: a pipeline's memory is per stage piece and micro-batch (``peak_activation_bytes``
        after a step), not the whole one-micro-batch program's static trace."""
        return None

    def _draws(self, step: Any) -> bool:
        """No world-wide generator agreement: each stage draws on its own ranks, so the
        pipeline ranks' generators part ways by design. The runner agrees the generators
        of each stage's ranks instead (:meth:`_stage_rng_sync`, docs/randomness.md)."""
        return False

    def _stage_rng_sync(self) -> Any:
        """The generator agreement among this stage's ranks (every mesh axis but the
        pipeline one); None when a stage has one rank."""
        mesh = self.mesh
        groups = [mesh.get_group(i) for i in range(mesh.ndim) if i != self.pp_index and mesh.shape[i] > 1]
        return AxesRngSync(groups, cuda=mesh.device_type == "cuda") if groups else None

    def _after_agreement(self, step: Any, model: Any, optimizer: Any) -> bool:
        return self._drop_other_stages(model, optimizer, step.assignment, step.pipeline.my_stages)

    # ------------------------------------------------------------------ dump
    def _dump(self, step: Any, texts: dict[str, Any]) -> None:
        """The usual dump, plus one annotated file per stage piece (``stage_<s>_<F|B|O>.py``)
        and ``pipeline.txt``: the stage of every parameter, the values crossing stages and
        the schedule."""
        from ..dump.writer import dump_root, write_dump
        from .schedule import build_schedule, format_schedule

        # the first run of this program adds its timeline to the dump (collective, so
        # every rank takes part when dumps are on, whichever ranks write them)
        step.timeline_pending = dump_root(self.dump_dir) is not None and not self.explain
        step.dump_folder = None
        if not self._dumping():
            return
        program, assignment, cfg = step.program, step.assignment, self.pipeline
        name = getattr(self.fn, "__name__", "step")
        pieces = [(f"{s}_{k}", program.pieces[(s, k)].gm) for (s, k) in sorted(program.pieces)]
        folder = write_dump(dump_root(self.dump_dir), step, name=name, stages=pieces,
                            info={"world size": dist.get_world_size(), "pipeline": repr(cfg)})
        pp = step.pipeline.pp
        lines = [f"{assignment.num_stages} stages over mesh axis {cfg.axis!r} ({pp} ranks), {cfg.chunks} micro-batches, "
                 f"schedule {cfg.schedule}, checkpoint {cfg.checkpoint}", "", "parameters (stage: FQN):"]
        lines += [f"  {','.join(map(str, owners))}: {fqn}" + ("   (tied)" if len(owners) > 1 else "")
                  for fqn, owners in sorted(assignment.param_stages.items(), key=lambda kv: (kv[1], kv[0]))]
        lines += ["", "values crossing stages (value: from -> to):"]
        lines += [f"  {value}: {t}{tk} -> {s}{k}" for value, t, s, tk, k in sorted(program.cross_stage())]
        lines += ["", "schedule (stage, F/B, micro-batch per pipeline rank):",
                  format_schedule(build_schedule(cfg.schedule, pp, cfg.chunks, cfg.stages_per_rank))]
        (folder / "pipeline.txt").write_text("\n".join(lines) + "\n")
        step.dump_folder = folder
        self.dumps.append(folder)
        log.info("dump of %s written to %s", name, folder)

    # ------------------------------------------------------------------ run
    def _run(self, step: Any, model: Any, optimizer: Any, batch: tuple, kwargs: dict, check: Any) -> Any:
        traced, runner = step.traced, step.pipeline
        check()  # every rank on this program (a pipeline's first action may already be a send)
        if self.explain:  # python -m spmd_compiler explain: compiled and dumped, never run
            out_nodes = next(n for n in step.gm.graph.nodes if n.op == "output").args[0]
            user_out: dict[int, Any] = {i: resolve_constant(c, optimizer) for i, c in traced.user_constants.items()}
            for slot, node in zip(step.outputs, out_nodes):
                if slot.kind == "user":
                    v = node.meta["val"]
                    user_out[slot.index] = torch.zeros(tuple(v.shape), dtype=v.dtype, device=v.device)
            return pytree.tree_unflatten([user_out[i] for i in range(len(user_out))], traced.user_spec)
        state = self._state(model, optimizer)
        leaves, _, paths = flatten_batch(batch, kwargs)
        m = self.pipeline.chunks
        chunked = {}
        for inp in traced.inputs:
            if inp.kind == "batch":
                leaf = leaves[inp.index]
                chunked[inp.index] = leaf.tensor_split(m, dim=0) if paths[inp.index] not in self.pipeline.no_chunk else [leaf] * m
        by_name = {n.name: n.meta.get("spmd_input") for n in step.gm.graph.nodes if n.op == "placeholder"}
        coord = dict(zip(step.mctx.axis_names, step.mctx.coordinate))
        # dynamic=True: every micro-batch's sizes (they are equal), as the ranks agreed on them
        sizes = {f"size_{s.symbol}": v for s, v in zip(step.size_symbols, self._feed)}
        size_of = size_reader(step, self._feed) if step.size_symbols else None

        def feed(name: str, mb: int | None) -> Any:
            inp = by_name[name]
            if name in sizes:
                return sizes[name]
            if inp is None:
                return coord[name[len("coord_") :]]
            if inp.kind == "batch":
                return chunked[inp.index][mb if mb is not None else 0]
            return pt.local_tensor(input_value(inp, state, leaves))

        try:
            values = runner.run(feed, size_of)
        except (RuntimeError, IndexError) as e:  # a peer stage died or timed out: say so on every survivor
            bad_ids = explain_index_error(e, traced, batch, kwargs)  # a token id out of range
            if bad_ids is not None:
                raise bad_ids from e
            if isinstance(e, (SpmdError, IndexError)):
                raise
            raise collective_failure(e, where=f"the pipeline schedule ({self.pipeline.schedule}: sends, receives and "
                                     f"stage collectives)", step_name=getattr(self.fn, "__name__", "step"), call=self.calls,
                                     timeout=self.options.timeout) from e
        pt.mark_optimizer_stepped(optimizer)
        out_nodes = next(n for n in step.gm.graph.nodes if n.op == "output").args[0]
        mesh = self.mesh
        last_rank = runner.stage_rank(runner.last_stage)

        def wrap(slot: Any, got: Any) -> Any:
            if slot.kind == "user":  # the last stage has every micro-batch's value; everyone gets their mean or sum
                if got is not None:
                    combined = torch.stack(got).mean(0) if self.pipeline.scale_grads else torch.stack(got).sum(0)
                else:
                    v = node_of[slot].meta["val"]
                    shape = tuple(v.shape) if size_of is None else tuple(size_of(d, None) for d in v.shape)
                    combined = torch.empty(shape, dtype=v.dtype, device=v.device)
                dist.broadcast(combined, src=last_rank, group=runner.pp_group)
                return combined
            if is_host_scalar(got[0]):
                return got[0]
            return DTensor.from_local(got[0], mesh, self._full_placements(slot.spec.placements), run_check=False,
                                      shape=slot.spec.shape, stride=slot.spec.stride)

        def missing(slot: Any) -> None:  # another stage's new optimizer state: remember its shape
            assert slot.name in self._ghosts, f"optimizer state for {slot.name!r}, a parameter no stage holds"
            self._ghost_states.setdefault(slot.name, {})[slot.key] = (slot.spec.shape, slot.spec.tensor_meta.dtype)

        node_of = dict(zip(step.outputs, out_nodes))
        result = store_outputs(step, [values.get(n.name) for n in out_nodes], state, optimizer, wrap, missing=missing)
        self.last_timeline = runner.timeline()
        if getattr(step, "timeline_pending", False):
            step.timeline_pending = False
            everyone = self.gather_timeline()
            if step.dump_folder is not None:
                (step.dump_folder / "timeline.txt").write_text(format_timeline(everyone) + "\n")
                (step.dump_folder / "timeline_trace.json").write_text(json.dumps(chrome_trace_events(everyone)))
        return result

    # ------------------------------------------------------------------ timeline
    def gather_timeline(self) -> list[list[Any]]:
        """The last step's spans of every rank (index = global rank). Collective: every
        rank must call it."""
        spans = [s.__dict__ for s in self.last_timeline]
        return exchange(spans)

    def timeline_text(self, *, width: int = 72) -> str:
        """The last step as a text Gantt chart, one row per rank (see
        :mod:`spmd_compiler.pipeline.timeline`). Collective: every rank must call it."""
        return format_timeline(self.gather_timeline(), width=width)

    def chrome_trace(self, path: str | pathlib.Path) -> pathlib.Path:
        """Write the last step's schedule as Chrome-trace JSON (open in Perfetto or
        chrome://tracing): one row per rank, spans for F, B, O, R, send and recv.
        Collective: every rank must call it; rank 0 writes the file."""
        everyone = self.gather_timeline()
        path = pathlib.Path(path)
        if dist.get_rank() == 0:
            path.write_text(json.dumps(chrome_trace_events(everyone)))
        return path


def _refuse_kept_gradients(traced: Any) -> None:
    """A pipelined step accumulates its micro-batches' gradients inside the schedule and
    must start and end without gradients: gradients across calls are refused, never
    dropped. Gradients the step only zeroes (``zero_grad(set_to_none=False)``) are
    left out of its outputs; ``.grad`` stays None after a pipelined call."""
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    grads = [(d.name, a) for d, a in zip(traced.outputs, out.args[0]) if d.kind == "grad"]
    if not traced.grads_in and all(_zeroed(a) for _, a in grads):
        if grads:
            kept = [(d, a) for d, a in zip(traced.outputs, out.args[0]) if d.kind != "grad"]
            out.args = ([a for _, a in kept],)
            traced.outputs = [d for d, _ in kept]
            traced.grads_left = ()
            traced.gm.recompile()
        return
    if traced.grads_in:
        names = traced.grads_in
        what = "parameters hold gradients when the step is called"
    else:
        names = tuple(n for n, a in grads if not _zeroed(a))
        what = "the step leaves gradients set (no optimizer.zero_grad() at its end)"
    raise SpmdError(
        f"a pipelined step cannot keep gradients across calls: {what} ({', '.join(names[:3])}"
        f"{', ...' if len(names) > 3 else ''}); expected every .grad to be None before and after the step. fix: end "
        f"the step with optimizer.step() and optimizer.zero_grad(), and accumulate over more micro-batches within the "
        f"step with Pipeline(chunks=...) instead of over calls"
    )


def _zeroed(node: Any) -> bool:
    aten = torch.ops.aten
    return node.target is aten.zero_.default or any(u.target is aten._foreach_zero_.default for u in node.users)
