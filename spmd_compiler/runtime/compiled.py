"""Stage 6: the compile-and-run API.

:func:`compile` wraps a single-device ``train_step(model, optimizer, *batch)``. The
first call distributes the model and optimizer (parameters become DTensors), traces the
step, expands it for this rank, optimizes it and checks that every rank compiled the
same graph. Later calls with the same batch shapes run the cached per-rank graph on the
local tensors directly: no tracing and no DTensor dispatch on the per-step path.
A new batch shape or dtype, or optimizer state appearing after the first step,
compiles again (logged at INFO with the reason).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..expand import ExpansionCache, expand
from ..plan import Plan
from ..trace import trace
from ..trace.state import StateCache, input_value
from ..trace.tracer import CONSTANT_LEAF_TYPES, _flatten_batch
from .agreement import check_agreement, comm_device, exchange
from .distribute import distribute_state, is_distributed, is_host_scalar
from .executor import compile_runner

__all__ = ["compile", "CompiledStep"]

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    """One compiled variant of the step (for one batch signature and state structure)."""

    step: Any  # ExpandedStep
    compile_seconds: float
    reason: str
    timings: dict[str, float] = field(default_factory=dict)


_LIVE_STEPS: "weakref.WeakSet[CompiledStep]" = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    """Free what holds process groups before the interpreter shuts down (best effort).

    A compiled graph reaches the DeviceMesh through the placements recorded on its
    nodes, DTensor's process-wide caches hold meshes too, and a mesh holds its process
    groups. Whatever is still alive at interpreter shutdown is destroyed there, where
    gloo's worker threads can no longer take the GIL to release the tensors of their
    last collective, and the process can abort ("terminate called without an active
    exception") after the training itself succeeded. Model parameters (DTensors) the
    program still references keep their mesh alive; scripts launched by torchrun should
    end with ``os._exit`` after ``destroy_process_group()``, as ``examples/train_gpt.py``
    does (and as multiprocessing's own workers do).
    """
    for step in list(_LIVE_STEPS):
        step._release()
    pt.clear_dtensor_caches()
    gc.collect()


@contextlib.contextmanager
def gc_paused() -> Any:
    """No garbage collection while compiling: a compile builds tens of thousands of fx
    nodes, and every full collection scans all of them (about 10% of a 32-layer compile).
    The cycles made meanwhile are collected after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _as_mesh(mesh: Any) -> DeviceMesh:
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, dict):
        names, shape = tuple(mesh), tuple(int(v) for v in mesh.values())
    elif isinstance(mesh, (tuple, list)) and all(isinstance(s, int) for s in mesh):
        names, shape = None, tuple(mesh)
    else:
        raise TypeError(f"mesh must be a DeviceMesh, a shape tuple or a {{name: size}} dict, got {type(mesh).__name__}")
    if not dist.is_initialized():
        raise ValueError(
            f"mesh {shape} needs an initialized process group; call torch.distributed.init_process_group() "
            f"first (torchrun sets up the environment for it)"
        )
    world = dist.get_world_size()
    size = 1
    for s in shape:
        size *= s
    if size > world:
        raise ValueError(f"mesh {dict(zip(names, shape)) if names else shape} needs {size} ranks but the world has {world}; fix: launch {size} processes or shrink the mesh")
    return init_device_mesh(comm_device().type, shape, mesh_dim_names=names)  # NCCL: cuda, else cpu


class CompiledStep:
    """A training step compiled for a mesh; call it like the original step.

    Attributes:
        mesh: the DeviceMesh; ``plan``: the Plan.
        compiles: how many times the step was (re)compiled.
        last: the ExpandedStep that ran last (its ``gm`` is the per-rank graph).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        mesh: Any,
        plan: Plan | None = None,
        fallback: str = "replicate",
        symbolic: str = "batch",
        check_ranks: bool = True,
        dump_dir: str | None = None,
        passes: Any = None,
        passes_disabled: tuple[str, ...] = (),
        bucket_mb: float = 25.0,
        first_bucket_mb: float | None = 1.0,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"compile() needs a callable train_step, got {type(fn).__name__}")
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan must be a spmd_compiler.Plan, got {type(plan).__name__}")
        self.fn = fn
        self._mesh_arg = mesh
        self._mesh: DeviceMesh | None = mesh if isinstance(mesh, DeviceMesh) else None
        self.plan = plan or Plan()
        self.fallback = fallback
        self.symbolic = symbolic
        self.check_ranks = check_ranks
        self.cache = ExpansionCache()
        self._states = StateCache()
        _LIVE_STEPS.add(self)
        self._entries: dict[Any, _Entry] = {}
        self._last_key: Any = None
        self.compiles = 0
        self.last: Any = None
        self.dump_dir = dump_dir
        self.dumps: list[Any] = []
        from ..optimize import default_passes

        self.passes = default_passes(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb) if passes is None else list(passes)
        self.passes_disabled = tuple(passes_disabled)
        # explain mode (python -m spmd_compiler explain): compile and dump, never execute
        self.explain = os.environ.get("SPMD_COMPILER_EXPLAIN") == "1"
        functools.update_wrapper(self, fn)

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            self._mesh = _as_mesh(self._mesh_arg)
        return self._mesh

    # ------------------------------------------------------------------ state
    def distribute(self, model: torch.nn.Module, optimizer: Any = None) -> None:
        """Shard ``model``/``optimizer`` per the plan now (the first call does it too).

        Call it before loading a checkpoint, so the state dicts hold DTensors to load into.
        """
        if not is_distributed(model):
            distribute_state(model, optimizer, self.mesh, self.plan)

    # ------------------------------------------------------------------ call
    def _state(self, model: torch.nn.Module, optimizer: Any) -> Any:
        """The named state of ``model``/``optimizer`` (cached between calls)."""
        return self._states.get(model, optimizer)

    def __call__(self, model: torch.nn.Module, optimizer: Any, *batch: Any, **kwargs: Any) -> Any:
        state = self._state(model, optimizer)
        if not state.params or not all(isinstance(p, DTensor) for p in state.params.values()):
            self.distribute(model, optimizer)
        key = self._signature(model, optimizer, batch, kwargs)
        entry = self._entries.get(key)
        if entry is None:
            reason = self._why(key)
            entry = self._compile(model, optimizer, batch, kwargs, reason)
            self._entries[key] = entry
        self._last_key = key
        self.last = entry.step
        return self._run(entry.step, model, optimizer, batch, kwargs)

    def _signature(self, model: Any, optimizer: Any, batch: tuple, kwargs: dict) -> Any:
        leaves, spec, paths = _flatten_batch(batch, kwargs)
        sig = []
        for path, leaf in zip(paths, leaves):
            if isinstance(leaf, torch.Tensor):
                sig.append((path, tuple(leaf.shape), leaf.dtype, leaf.device.type, leaf.requires_grad))
            else:
                sig.append((path, type(leaf).__name__, leaf if isinstance(leaf, CONSTANT_LEAF_TYPES) else id(leaf)))
        return (str(spec), tuple(sig), *self._state(model, optimizer).signature())

    def _why(self, key: Any) -> str:
        if self._last_key is None:
            return "first call"
        old = self._last_key
        if old[2] != key[2]:
            return "optimizer state changed (created by the first step)" if len(key[2]) > len(old[2]) else "optimizer state changed"
        if old[1] != key[1]:
            for a, b in zip(old[1], key[1]):
                if a != b:
                    what = ["shape", "dtype", "device", "requires_grad"] if len(a) == 5 else ["type", "value"]
                    diffs = [f"{w} {x} -> {y}" for w, x, y in zip(what, a[1:], b[1:]) if x != y]
                    return f"{b[0]}: " + ", ".join(diffs)
        if old[3] != key[3]:
            return "model parameters changed"
        if old[4] != key[4]:
            for a, b in zip(old[4], key[4]):
                if a != b:
                    return f"optimizer hyperparameter param_groups[{b[0]}][{b[1]!r}] changed: {a[2]} -> {b[2]}"
            return "optimizer param groups changed"
        return "batch structure changed"

    # ------------------------------------------------------------------ compile
    def _global_batch(self, batch: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Global example tensors for the local batch (each rank passes its shard)."""
        leaves, spec, paths = _flatten_batch(batch, kwargs)
        mesh = self.mesh
        ndim = mesh.ndim
        placements = _batch_placements(self.plan, paths, leaves, ndim)
        coord = tuple(mesh.get_coordinate())
        local = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves]
        everyone = exchange((coord, local))
        out = []
        for i, (leaf, pl) in enumerate(zip(leaves, placements)):
            if not isinstance(leaf, torch.Tensor):
                out.append(leaf)
                continue
            shape = list(leaf.shape)
            for d in range(len(shape)):
                axes = [a for a, p in enumerate(pl) if isinstance(p, pt.Shard) and p.dim == d]
                if not axes:
                    continue
                if len(everyone) == 1:  # fake group or one process: assume even shards
                    for a in axes:
                        shape[d] *= mesh.shape[a]
                    continue
                total = 0
                for c, shapes in everyone:
                    if all(c[a] == coord[a] for a in range(ndim) if a not in axes):
                        total += shapes[i][d]
                shape[d] = total
            for c, shapes in everyone:
                other = shapes[i]
                for d in range(len(shape)):
                    sharded = any(isinstance(p, pt.Shard) and p.dim == d for p in pl)
                    if not sharded and other[d] != leaf.shape[d]:
                        raise ValueError(
                            f"{paths[i]} has size {leaf.shape[d]} in dim {d} here but {other[d]} on the rank at mesh "
                            f"coordinate {c}; only the sharded dims of batch tensors may differ between ranks"
                        )
            out.append(torch.empty(shape, dtype=leaf.dtype, device=leaf.device).requires_grad_(leaf.requires_grad))
        args, kw = pytree.tree_unflatten(out, spec)
        return args, kw

    def _build(self, model: Any, optimizer: Any, batch: tuple, kwargs: dict) -> tuple[Any, dict[str, Any]]:
        """Trace, expand and optimize the step for this rank."""
        mesh = self.mesh
        g_args, g_kwargs = self._global_batch(batch, kwargs)
        traced = trace(
            self.fn, model, optimizer, *g_args, symbolic=self.symbolic, symbolic_dims=self._sharded_batch_dims(batch, kwargs),
            **g_kwargs,
        )
        step = expand(traced, mesh, self.plan, coordinate=tuple(mesh.get_coordinate()), fallback=self.fallback, cache=self.cache)
        return step, self._optimize(step)

    def _sharded_batch_dims(self, batch: tuple, kwargs: dict) -> dict[int, tuple[int, ...]]:
        """Per batch leaf, the dims the plan shards: only those are traced as symbols
        (an unsharded dim has the same size on every rank, and symbols slow the trace)."""
        leaves, _, paths = _flatten_batch(batch, kwargs)
        placements = _batch_placements(self.plan, paths, leaves, self.mesh.ndim)
        return {
            i: tuple(sorted({p.dim for p in pl if isinstance(p, pt.Shard)}))
            for i, pl in enumerate(placements)
            if pl is not None
        }

    def _compile(self, model: Any, optimizer: Any, batch: tuple, kwargs: dict, reason: str) -> _Entry:
        log.info("compiling %s (%s)", getattr(self.fn, "__name__", "step"), reason)
        start = time.perf_counter()
        error: BaseException | None = None
        step = None
        dump_texts: dict[str, Any] = {}
        try:
            with gc_paused():
                step, dump_texts = self._build(model, optimizer, batch, kwargs)
        except Exception as e:  # reported to every rank by check_agreement
            error = e
        if self.check_ranks:
            groups = {} if step is None else {g: n for g, n in zip(step.mctx.group_names, step.mctx.axis_names)}
            check_agreement(step.gm if step else None, groups, with_sizes=bool(step and step.rank_independent), error=error)
        elif error is not None:
            raise error
        elapsed = time.perf_counter() - start
        self.compiles += 1
        step.timings["total"] = elapsed
        self._maybe_dump(step, dump_texts)
        if log.isEnabledFor(logging.INFO):
            from ..dump.summary import comm_summary

            log.info("collectives per rank per step:\n%s", comm_summary(step.gm).table())
        log.info(
            "compiled %s in %.2fs (trace %.2fs, expand %.2fs, rebuild %.2fs, passes %.2fs): %d nodes, %d collectives",
            getattr(self.fn, "__name__", "step"), elapsed, step.timings["trace"], step.timings["expand"], step.timings["rebuild"],
            step.timings.get("passes", 0.0),
            len(step.gm.graph.nodes), len(step.collectives()),
        )
        return _Entry(step, elapsed, reason, dict(step.timings))

    def _dumping(self) -> bool:
        from ..dump.writer import dump_root, should_dump

        return dump_root(self.dump_dir) is not None and should_dump(dist.get_rank() if dist.is_initialized() else 0)

    def _optimize(self, step: Any) -> dict[str, Any]:
        """Run the passes on ``step.gm`` (in place); returns graph texts for the dump."""
        from ..dump.printer import annotated_code
        from ..optimize import run_passes

        texts: dict[str, Any] = {"expanded": None, "passes": []}
        dumping = self._dumping()
        if dumping:
            texts["expanded"] = annotated_code(step.gm, title="per-rank graph after expansion")

        def after(name: str, gm: Any) -> None:
            if dumping:
                texts["passes"].append((name, annotated_code(gm, title=f"after pass {name}")))

        t0 = time.perf_counter()
        step.gm, step.pass_records = run_passes(step.gm, self.passes, disabled=self.passes_disabled, after_pass=after)
        step.timings["passes"] = time.perf_counter() - t0
        for r in step.pass_records:
            step.timings[f"pass {r.name}"] = r.seconds
        return texts

    def _maybe_dump(self, step: Any, texts: dict[str, Any]) -> None:
        from ..dump.writer import dump_root, write_dump

        if not self._dumping():
            return
        root = dump_root(self.dump_dir)
        name = getattr(self.fn, "__name__", "step")
        folder = write_dump(
            root, step, name=name, expanded_text=texts.get("expanded"), pass_texts=texts.get("passes", []),
            info={"world size": dist.get_world_size() if dist.is_initialized() else 1},
        )
        self.dumps.append(folder)
        log.info("dump of %s written to %s", name, folder)

    # ------------------------------------------------------------------ run
    def _run(self, step: Any, model: Any, optimizer: Any, batch: tuple, kwargs: dict) -> Any:
        traced = step.traced
        state = self._state(model, optimizer)
        leaves, _, _ = _flatten_batch(batch, kwargs)
        inputs: list[Any] = list(step.mctx.coordinate)
        for inp in traced.inputs:
            inputs.append(pt.local_tensor(input_value(inp, state, leaves)))
        if self.explain:
            vals = [n.meta["val"] for n in step.gm.graph.find_nodes(op="output")[0].args[0]]
            outs = [torch.zeros(v.shape, dtype=v.dtype, device=v.device) for v in vals]
        else:
            runner = getattr(step, "runner", None)
            if runner is None:
                runner = step.runner = compile_runner(step.gm)
            with torch.no_grad():
                outs = runner(*inputs)
            pt.mark_optimizer_stepped(optimizer)
        user: dict[int, Any] = dict(traced.user_constants)
        mesh = self.mesh
        for slot, out in zip(step.outputs, outs):
            if slot.kind == "user":
                if all(p.is_replicate() for p in slot.spec.placements):
                    user[slot.index] = out
                else:
                    user[slot.index] = DTensor.from_local(out, mesh, slot.spec.placements, run_check=False, shape=slot.spec.shape, stride=slot.spec.stride)
            elif is_host_scalar(out):
                optimizer.state[state.params[slot.name]][slot.key] = out
            else:
                dt = DTensor.from_local(out, mesh, slot.spec.placements, run_check=False, shape=slot.spec.shape, stride=slot.spec.stride)
                optimizer.state[state.params[slot.name]][slot.key] = dt
        return pytree.tree_unflatten([user[i] for i in range(len(user))], traced.user_spec)

    def _release(self) -> None:
        """Drop compiled graphs and cached state (the next call compiles again)."""
        self._entries.clear()
        self._last_key = None
        self.last = None
        self.cache = ExpansionCache()
        self._states = StateCache()

    # ------------------------------------------------------------------ introspection
    def comm_summary(self) -> Any:
        """Collectives of the last compiled graph per kind, axis and phase (per rank per step)."""
        from ..dump.summary import comm_summary

        if self.last is None:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        return comm_summary(self.last.gm)

    def timings(self) -> dict[str, float]:
        """Seconds per compile phase of the last compile (trace, expand, rebuild, total)."""
        if self._last_key is None:
            return {}
        return dict(self._entries[self._last_key].timings)


def _batch_placements(plan: Plan, paths: list[str], leaves: list[Any], ndim: int) -> list[tuple | None]:
    """Placements of every batch leaf (None for constants), resolved without a trace."""
    from ..trace.tracer import GraphInput

    inputs = [
        GraphInput("batch", path, tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, index=i, device=leaf.device)
        for i, (path, leaf) in enumerate(zip(paths, leaves))
        if isinstance(leaf, torch.Tensor)
    ]
    resolved = iter(plan.batch_placements(inputs, ndim))
    return [next(resolved)[0] if isinstance(leaf, torch.Tensor) else None for leaf in leaves]


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
        options: ``fallback`` ("replicate" | "error"), ``symbolic`` ("batch" | "all"),
            ``check_ranks`` (exchange graph fingerprints at compile, default True),
            ``dump_dir`` (write a dump folder per compile; ``$SPMD_COMPILER_DUMP`` too),
            ``passes`` (a list of PassSpec; default :func:`spmd_compiler.optimize.default_passes`),
            ``passes_disabled`` (pass names to skip), ``bucket_mb`` (gradient bucket size, 25),
            ``first_bucket_mb`` (size of each group's first bucket, 1 as in DDP; None: ``bucket_mb``),
            ``pipeline`` (a :class:`spmd_compiler.Pipeline`: run the step as a pipeline over
            one mesh axis; the plan then gives placements for the other axes).
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

        cls: Any = lambda f, **kw: PipelinedStep(f, pipeline=pipeline, **kw)  # noqa: E731
    else:
        cls = CompiledStep
    if fn is None:
        return lambda f: cls(f, mesh=mesh, plan=plan, **options)
    return cls(fn, mesh=mesh, plan=plan, **options)
