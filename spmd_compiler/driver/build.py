"""From a step function and its example inputs to one rank's optimized program.

:func:`expand` runs stages 2 and 3 (expansion hands its result to rebuild);
:func:`build_program` runs stages 1 to 4 for one mesh coordinate. ``compile()``, the
pipeline and the simulated test harness all call these, with the same
:class:`Options`, so a test that simulates every rank exercises the program a user runs.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import _private_torch as pt
from ..expand import ExpansionCache, MeshContext, expand_graph
from ..expand.emit_sizes import emit_sizes_pass
from ..expand.symbolic import SizeGuards, size_symbols_of
from ..expand.rules.random import RNG_MODES as RNG
from ..plan import Plan
from ..rebuild import ExpandedStep, finalize
from ..trace import trace
from .progress import current, stage_done

__all__ = ["Options", "expand", "build_program", "optimize_program", "gc_paused"]

FALLBACKS = ("replicate", "error")
SYMBOLIC = ("batch", "all", "none")
BACKENDS = ("eager", "inductor")


@dataclass(frozen=True)
class Options:
    """How a step is compiled (the keyword options of ``spmd_compiler.compile``).

    Attributes:
        fallback: "replicate" runs ops without a sharding strategy on gathered inputs
            (with a warning); "error" raises UnsupportedOpError.
        symbolic: "batch" traces the plan's sharded batch dims as symbols; "all" every
            batch dim; "none" no symbol.
        passes: PassSpecs to run (None: :func:`spmd_compiler.optimize.default_passes`).
        passes_disabled: names of passes to skip.
        bucket_mb, first_bucket_mb: gradient bucket sizes for the default passes.
        check_ranks: exchange program fingerprints between ranks at every compile, and
            compare every step the batch values that ranks must share (a batch
            Replicate on a mesh axis, :mod:`.batch_digest`).
        dump_dir: write a dump folder per compile (``$SPMD_COMPILER_DUMP`` too).
        cache_size: compiled programs kept (least recently used evicted, logged at INFO).
        timeout: seconds a collective may wait for the other ranks before every rank
            raises CollectiveError (None: the process group's own timeout).
        rng: how random ops draw (docs/randomness.md): "exact" gives every element the
            number the single-device step draws (each rank draws the global tensor and
            keeps its slice); "fast" draws only local elements from per-shard seeds
            (Replicate values still agree across ranks; not the single-device numbers).
        dynamic: True: one program for every size of the plan's sharded batch dims
            (docs/dynamic_shapes.md): the per-rank program takes the global sizes as
            run-time ints and computes every size that depends on them; a call whose
            sizes break a condition the compile relied on compiles again. False: one
            program per batch shape. None (the default): automatic, as torch.compile's
            automatic dynamic shapes: the first call compiles for its exact shapes, and
            the first call whose sharded batch sizes differ (nothing else) compiles once
            more with them symbolic, a program every later size reuses
            (:mod:`.auto_dynamic`).
        backend: what runs the per-rank program: "eager" (one aten call per node, from
            generated straight-line Python) or "inductor" (the whole program compiled by
            torch's inductor; a program it cannot compile runs eagerly, with a WARNING).
        check_intent: check at every compile that the per-rank program kept what the step
            wrote (:mod:`.intent`: no host number from a NaN, every activation-checkpointing
            recomputation, every parameter update, every phase), after the trace, the
            expansion and every pass; IntentError names where it was lost. Off by default
            (it walks the program once per pass); on in the test harness.
        device_type: the device type the program is for ("cpu", "cuda"; None: the mesh's).
            It matters for a model on ``meta`` (explain mode, compile-only checks): SDPA is
            traced as the fused kernel that device runs, so the program and its memory
            trace are that device's (``trace(device_type=...)``).
        init_weights: how a model built on ``meta`` gets its values at the first call
            (:mod:`.deferred_init`): ``"reset_parameters"`` (every module's) or a callable
            ``init_weights(model)``, run on each rank's freshly allocated shards (DTensors), with
            shard-independent random draws; None (the default): a model on meta is refused
            unless the run is compile-only (explain mode, a batch on meta).
        mixed_precision: a :class:`~spmd_compiler.MixedPrecisionPolicy` (FSDP2's: parameters
            computed and gathered in ``param_dtype``, gradients reduced in float32), or None.
        memory_budget_gb: GiB of device memory per rank; a program whose static peak
            (``step.memory_trace()``) exceeds it raises MemoryBudgetError at compile time, on
            every rank, with the peak, its largest contributors and a fix (:mod:`.budget`).
        init_seed: the seed of those draws (``spmd_compiler.materialize(..., seed=)`` gives the
            same values on one device).
        progress: the compile's progress lines on rank 0 (:mod:`.progress`): True (a compile
            longer than 2 s shows a line per stage and a summary), False (none), "verbose"
            (every compile, and a line per pass); None (the default): ``SPMD_COMPILER_LOGS``
            decides (``-progress`` off, ``+progress`` verbose), else True.
    """

    fallback: str = "replicate"
    symbolic: str = "batch"
    passes: Sequence[Any] | None = None
    passes_disabled: tuple[str, ...] = ()
    bucket_mb: float = 25.0
    first_bucket_mb: float | None = 1.0
    check_ranks: bool = True
    dump_dir: str | None = None
    cache_size: int = 8
    timeout: float | None = 300.0
    rng: str = "exact"
    backend: str = "eager"
    dynamic: bool | None = None
    check_intent: bool = False
    device_type: str | None = None
    init_weights: Any = None
    init_seed: int = 0
    mixed_precision: Any = None
    memory_budget_gb: float | None = None
    progress: Any = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback={self.fallback!r}: expected one of {list(FALLBACKS)}")
        if self.symbolic not in SYMBOLIC:
            raise ValueError(f"symbolic={self.symbolic!r}: expected one of {list(SYMBOLIC)}")
        if self.rng not in RNG:
            raise ValueError(f"rng={self.rng!r}: expected one of {list(RNG)} (see docs/randomness.md)")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {list(BACKENDS)} (the per-rank program's runner)")
        if not isinstance(self.check_intent, bool):
            raise ValueError(f"check_intent={self.check_intent!r}: expected True (check the program against its trace) or False")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise ValueError(f"dynamic={self.dynamic!r}: expected None (automatic: static until the batch size changes), "
                             f"True (one program for every batch size) or False (one program per batch size)")
        if self.dynamic and self.symbolic == "none":
            raise ValueError("dynamic=True needs symbolic batch sizes; expected symbolic='batch' or 'all', got 'none'")
        object.__setattr__(self, "passes_disabled", tuple(self.passes_disabled))
        if not isinstance(self.cache_size, int) or self.cache_size < 1:
            raise ValueError(f"cache_size={self.cache_size!r}: expected an int >= 1 (compiled programs to keep)")
        if self.device_type is not None and not isinstance(self.device_type, str):
            raise ValueError(f"device_type={self.device_type!r}: expected a device type such as 'cuda' or 'cpu', or None")
        if self.init_weights is not None and not callable(self.init_weights) and self.init_weights != "reset_parameters":
            raise ValueError(f"init_weights={self.init_weights!r}: expected 'reset_parameters', a callable init_weights(model), or None")
        from ..plan import MixedPrecisionPolicy

        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecisionPolicy):
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: expected a spmd_compiler.MixedPrecisionPolicy "
                             f"(e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)) or None")
        if self.memory_budget_gb is not None and not (isinstance(self.memory_budget_gb, (int, float)) and self.memory_budget_gb > 0):
            raise ValueError(f"memory_budget_gb={self.memory_budget_gb!r}: expected GiB > 0 per rank, or None")
        from .progress import progress_mode

        progress_mode(self.progress, env="")  # a bad value is refused here, not at the first compile
        if not isinstance(self.init_seed, int):
            raise ValueError(f"init_seed={self.init_seed!r}: expected an int")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r}: expected seconds > 0, or None for the process group's own")

    def pass_list(self) -> list[Any]:
        """The passes to run, in order."""
        if self.passes is not None:
            return list(self.passes)
        from ..optimize import default_passes

        return default_passes(bucket_mb=self.bucket_mb, first_bucket_mb=self.first_bucket_mb)

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> "Options":
        """Options from ``compile()``'s keywords; an unknown keyword is a TypeError naming the known ones."""
        known = set(cls.__dataclass_fields__) - {"extra"}
        unknown = sorted(set(options) - known)
        if unknown:
            import difflib

            hints = [f"{u!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, known, n=1)) else repr(u) for u in unknown]
            raise TypeError(f"unknown compile option(s) {', '.join(hints)}; expected some of {sorted(known)}")
        return cls(**options)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
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


def expand(
    traced: Any,
    mesh: Any,
    plan: Plan | None = None,
    *,
    coordinate: tuple[int, ...] | None = None,
    fallback: str = "replicate",
    cache: ExpansionCache | None = None,
    reduce_partial_outputs: bool = True,
    rng: str = "exact",
    dynamic: bool = False,
) -> ExpandedStep:
    """Expand ``traced`` (from :func:`spmd_compiler.trace`) into the per-rank program.

    Args:
        traced: the TracedStep.
        mesh: a ``DeviceMesh`` (1-D or 2-D).
        plan: a :class:`spmd_compiler.Plan` (default: parameters Replicate, batch
            Shard(0) on the first mesh axis, i.e. data parallel).
        coordinate: expand for the rank at this mesh coordinate (default: this process's).
            Only matters when some dim is sharded unevenly.
        fallback: ``"replicate"`` runs ops without a sharding strategy on gathered
            inputs (with a warning); ``"error"`` raises UnsupportedOpError instead.
        cache: an ExpansionCache to share recipes across expansions.
        reduce_partial_outputs: reduce Partial step outputs to Replicate.
        rng: how random ops draw, ``"exact"`` or ``"fast"`` (see :class:`Options`).
        dynamic: keep the sharded batch sizes symbolic (see :class:`Options`); the
            graph then takes one ``size_*`` int per batch symbol after the coordinates.

    Returns an :class:`~spmd_compiler.rebuild.ExpandedStep`.
    """
    if plan is None:
        plan = Plan()
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a spmd_compiler.Plan, got {type(plan).__name__}; fix: plan=spmd_compiler.Plan(...)")
    mctx = MeshContext.of(mesh, coordinate, cp=plan.cp_layout(mesh))
    resolved = plan.resolve(traced, mesh)
    t0 = time.perf_counter()
    expansion = expand_graph(
        traced, mctx, resolved.placements, fallback=fallback, cache=cache, fsdp_axes=plan.fsdp_axis_indices(mesh),
        activation_sharding=plan.activation_sharding, sources=resolved.sources, rng=rng, dynamic=dynamic,
        reshard_after_forward=plan.reshard_after_forward, expert_axes=plan.expert_axis_indices(mesh),
        expert_capacity=plan.expert_capacity,
    )
    t1 = time.perf_counter()
    step = finalize(expansion, reduce_partial_outputs=reduce_partial_outputs, grad_placements=resolved.grads)
    if expansion.dynamic:
        sources = {**expansion.size_nodes, **dict(zip(expansion.local_sizes.symbols, expansion.coords))}
        emit_sizes_pass(step.gm, sources=sources, definitions=expansion.local_sizes.definitions)
        step.size_coordinates = dict(expansion.local_sizes.coordinates)
        step.size_definitions = dict(expansion.local_sizes.definitions)
        step.size_symbols = list(expansion.size_symbols)
        step.size_guard_nodes = list(expansion.size_guard_nodes)
    t2 = time.perf_counter()
    step.plan_sources = resolved.sources
    step.timings = {"trace": traced.trace_seconds, "expand": t1 - t0, "rebuild": t2 - t1}
    return step


def optimize_program(
    step: ExpandedStep, passes: Sequence[Any], *, disabled: Sequence[str] = (), texts: dict[str, Any] | None = None,
    check: Callable[[str, Any], None] | None = None,
) -> ExpandedStep:
    """Stage 4 on ``step`` (its ``gm`` is replaced); with ``texts``, the annotated graph
    before and after every pass is recorded there for a dump (and their node notes,
    ``texts["notes"]``: :mod:`spmd_compiler.dump.notes`); ``check(name, gm)`` runs
    after every pass (the intent check)."""
    from ..optimize import run_passes

    after: Callable[[str, Any], None] | None = check
    if texts is not None:
        from ..dump.notes import graph_notes
        from ..dump.printer import annotated_code
        from ..dump.sizes import SizeContext

        # a symbolic program: its size expressions with the values of the call being compiled
        values = texts.get("size_values")
        sizes = SizeContext(step, values(step)) if step.size_symbols and values is not None else None
        texts["expanded"] = annotated_code(step.gm, title="per-rank graph after expansion", sizes=sizes)
        texts["passes"] = []
        texts["notes"] = graph_notes(step.gm, "expanded")  # what the texts say on single nodes, for the report

        def record(name: str, gm: Any) -> None:
            texts["passes"].append((name, annotated_code(gm, title=f"after pass {name}", sizes=sizes)))
            texts["notes"].extend(graph_notes(gm, name))
            if check is not None:
                check(name, gm)

        after = record

    t0 = time.perf_counter()
    step.gm, step.pass_records = run_passes(step.gm, list(passes), disabled=tuple(disabled), after_pass=after)
    step.timings["passes"] = time.perf_counter() - t0
    p = current()
    for r in step.pass_records:
        step.timings[f"pass {r.name}"] = r.seconds
        if p is not None and p.verbose:
            p.line(f"    pass {r.name:<24} {r.seconds:6.2f} s")
    return step


def build_program(
    fn: Callable[..., Any],
    model: Any,
    optimizer: Any,
    args: tuple,
    kwargs: dict[str, Any],
    mesh: Any,
    plan: Plan,
    options: Options,
    *,
    coordinate: tuple[int, ...] | None = None,
    cache: ExpansionCache | None = None,
    traced: Any = None,
    texts: dict[str, Any] | None = None,
) -> ExpandedStep:
    """Trace ``fn(model, optimizer, *args, **kwargs)`` on the *global* example batch,
    expand it for the rank at ``coordinate`` and run the passes.

    ``traced`` reuses a trace made for another coordinate of the same step (the trace
    does not depend on the rank).
    """
    from .batch import sharded_batch_dims

    if traced is None:
        with gc_paused():
            traced = trace(
                fn, model, optimizer, *args, symbolic=options.symbolic,
                symbolic_dims=sharded_batch_dims(plan, args, kwargs, len(tuple(mesh.shape)), dynamic=bool(options.dynamic)),
                dynamic=bool(options.dynamic), device_type=options.device_type or getattr(mesh, "device_type", None),
                mixed_precision=options.mixed_precision, **kwargs,
            )
        stage_done("trace", traced.trace_seconds, f"{len(traced.gm.graph.nodes):,} nodes")
    with gc_paused():
        if options.dynamic:
            from .dynamic import expand_dynamic

            step = expand_dynamic(
                lambda t, **kw: expand(t, mesh, plan, **kw), traced, coordinate=coordinate, fallback=options.fallback,
                cache=cache, rng=options.rng,
            )
        else:
            step = expand(traced, mesh, plan, coordinate=coordinate, fallback=options.fallback, cache=cache, rng=options.rng)
    check = None
    if options.check_intent:
        from .intent import check_intent, check_trace

        intent = check_trace(traced.gm)
        check_intent(intent, step.gm, "expansion")
        check = lambda name, gm: check_intent(intent, gm, f"pass {name!r}")  # noqa: E731
    stage_done("expand", step.timings.get("expand", 0.0) + step.timings.get("rebuild", 0.0),
               f"{len(step.gm.graph.nodes):,} nodes, {len(step.collectives())} collectives")
    step = optimize_program(step, options.pass_list(), disabled=options.passes_disabled, texts=texts, check=check)
    stage_done("passes", step.timings.get("passes", 0.0), f"{len(step.gm.graph.nodes):,} nodes")
    if step.size_symbols:  # after the passes: every decision on a size symbol is a guard by now
        shape_env = pt.shape_env_of(pt.fake_mode_of(traced.placeholders()[step.size_symbols[0].index].meta["val"]))
        step.size_guards = SizeGuards(shape_env, step.size_symbols, step.size_definitions, step.size_coordinates,
                                      size_symbols_of(traced, every=True))
    return step
