"""The driver every compiled step runs on: one program per signature, agreed by all ranks.

:class:`StepDriver` holds what a compiled step keeps between calls: the mesh, the plan,
the :class:`~.build.Options`, the model's named state and one compiled program per call
signature (batch shapes and dtypes, state structure, fixed hyperparameters). A call with
a new signature compiles (``_build``, which a subclass provides) inside one block that
every rank leaves together: an error on any rank, or programs that differ, raise on all
ranks (:mod:`.agreement`). :class:`spmd_compiler.CompiledStep` runs the program on the
local tensors; :class:`spmd_compiler.pipeline.step.PipelinedStep` runs it as a pipeline.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import _private_torch as pt
from ..errors import SpmdError
from ..expand import ExpansionCache
from ..plan import Plan
from ..trace.state import StateCache, unwrap_compiled
from ..trace.tracer import flatten_batch
from .._format import format_bytes
from .agreement import check_agreement, exchange
from .batch import signature, why_recompile
from .auto_dynamic import AutoDynamic
from .batch_digest import batch_digests, value_slots, values_error
from .budget import check_budget
from .build import Options
from .cache_watch import CacheWatch
from .checkpoint import DriverCheckpoints
from .distribute import distribute_state, is_distributed
from .failure import collective_failure, start_heartbeat
from .copied_batch import global_batch_error, shard_digests
from .guard import GuardError, Resync, StepGuard
from .introspect import DriverIntrospection
from .mesh import _LIVE, as_mesh
from .progress import compiling, header_line, progress_mode, running, summary_line
from .rng import draws
from .sizes import BatchSizes
from .token_ids import IdCheck, embedding_ids_error, ranks_ids_error

__all__ = ["StepDriver", "Program", "as_mesh"]


log = logging.getLogger(__name__)


@dataclass
class Program:
    """One compiled variant of the step (for one call signature)."""

    step: Any  # ExpandedStep
    compile_seconds: float
    reason: str
    timings: dict[str, float] = field(default_factory=dict)
    local_key: Any = None  # this rank's call signature for it
    draws: bool = False  # the program has random ops (the step check agrees the generators too)
    sizes: Any = None  # a symbolic program's (dynamic=True) sizes.SizeProgram: keyed without the sharded sizes
    slot: int = 1  # its id in the cache, 1 to cache_size, the same on every rank (carried by a folded check)
    state_changed: bool = False  # its compile changed the state the call signature reads (keyed by the state after)
    free: Any = None  # every rank's free-signature digest (dynamic=None: a call differing only in batch sizes switches)
    batch_sizes: Any = None  # the global sharded batch sizes it was compiled for (dynamic=None's INFO line)


class StepDriver(DriverIntrospection, DriverCheckpoints):
    """A training step compiled for a mesh; call it like the original step.

    Attributes:
        mesh: the DeviceMesh; ``plan``: the Plan; ``options``: the compile Options.
        compiles: how many times the step was (re)compiled.
        last: the ExpandedStep that ran last (its ``gm`` is the per-rank graph).
    """

    def __init__(self, fn: Callable[..., Any], *, mesh: Any, plan: Plan | None = None, **options: Any) -> None:
        if not callable(fn):
            raise TypeError(f"compile() needs a callable train_step, got {type(fn).__name__}")
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan must be a spmd_compiler.Plan, got {type(plan).__name__}; fix: plan=spmd_compiler.Plan(...)")
        self.fn = fn
        self.options = Options.from_kwargs(options)
        self.explain = os.environ.get("SPMD_COMPILER_EXPLAIN") == "1"  # compile and dump, never execute
        why = self._per_shape()
        if self.options.dynamic is not False and (why or self.options.symbolic == "none"):
            if self.options.dynamic:
                log.info("dynamic=True: %s compiles one program per batch shape (docs/dynamic_shapes.md)", why)
            self.options = dataclasses.replace(self.options, dynamic=False)
        # dynamic=None (the default): static programs until the batch size changes (.auto_dynamic)
        self._auto: AutoDynamic | None = AutoDynamic() if self.options.dynamic is None else None
        self._sizes: BatchSizes | None = None  # dynamic=True: the ranks' agreement on the batch sizes
        self._feed: list[int] = []  # the size_* inputs of the running call
        self._compiling: list[Any] | None = None  # dynamic=True: every rank's local sizes of the call being compiled
        self._mesh_arg = mesh
        self._mesh: DeviceMesh | None = mesh if isinstance(mesh, DeviceMesh) else None
        self.plan = plan or Plan()
        self.cache = ExpansionCache()
        self._states = StateCache()
        self._progress = progress_mode(self.options.progress)  # "off", "on" or "verbose" (SPMD_COMPILER_LOGS read now)
        self._lazy_checked: dict[int, int] = {}  # id(optimizer) -> len(optimizer.state) after creating its lazy state
        self._pinned: tuple[Any, Any, Any] | None = None  # (model, optimizer, state) while a cached program runs
        _LIVE.add(self)
        self._programs: OrderedDict[Any, Program] = OrderedDict()  # by every rank's signature, least recent first
        self._watch = CacheWatch(self.options.cache_size)  # warns once when the cache thrashes
        self._current: Program | None = None  # the program every rank agreed on last
        self._guard: StepGuard | None = None
        self.checks: Counter[str] = Counter()  # steps per check path ("folded", "standalone", "resync (folded)", ...)
        self.calls = 0
        self._last_key: Any = None
        self.compiles = 0
        self.last: Any = None
        self.dumps: list[Any] = []
        self.passes = self.options.pass_list()
        functools.update_wrapper(self, fn)

    # options, as attributes (read by dumps and tests)
    fallback = property(lambda self: self.options.fallback)
    symbolic = property(lambda self: self.options.symbolic)
    check_ranks = property(lambda self: self.options.check_ranks)
    dump_dir = property(lambda self: self.options.dump_dir)
    passes_disabled = property(lambda self: self.options.passes_disabled)
    checks_batch_values = True  # a pipeline's stages read different parts of the batch: it says no

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            self._mesh = as_mesh(self._mesh_arg)
        return self._mesh

    # ------------------------------------------------------------------ state
    def distribute(self, model: torch.nn.Module, optimizer: Any = None, *, _batch: Any = None) -> None:
        """Shard ``model``/``optimizer`` per the plan now (the first call does it too).

        Call it before loading a checkpoint, so the state dicts hold DTensors to load into.
        A model built on ``meta`` is allocated shard by shard and initialized with the
        ``init_weights`` option (:mod:`.deferred_init`); it stays on meta in a compile-only
        run (explain mode, or a first call whose batch is on meta).
        """
        model = unwrap_compiled(model)
        if not is_distributed(model):
            leaves = [t for t in flatten_batch(*_batch)[0] if isinstance(t, torch.Tensor)] if _batch is not None else []
            keep_meta = self.explain or (bool(leaves) and all(t.is_meta for t in leaves))
            distribute_state(model, optimizer, self.mesh, self.plan, init_weights=self.options.init_weights,
                             init_seed=self.options.init_seed, keep_meta=keep_meta)

    def _lazy_state(self, optimizer: Any) -> bool:
        """Create the optimizer's lazy state now (what its first ``step()`` creates before
        its update, :func:`pt.create_lazy_state`), so the first call compiles the steady
        program and the second runs it; checked again only when the state's size changed."""
        size = len(optimizer.state)
        if self._lazy_checked.get(id(optimizer)) == size:
            return False
        made = pt.create_lazy_state(optimizer)
        self._lazy_checked[id(optimizer)] = len(optimizer.state)
        if made:
            log.info("created the optimizer state of %d parameters before the first step (as its first step would): "
                     "the first call compiles the steady program", made)
        return bool(made)

    def _state(self, model: torch.nn.Module, optimizer: Any) -> Any:
        """The named state of ``model``/``optimizer`` (cached between calls; while a cached
        program runs, the state its call signature was computed from, with no second
        fingerprint of the model and optimizer)."""
        pinned = self._pinned
        if pinned is not None and pinned[0] is model and pinned[1] is optimizer:
            return pinned[2]
        return self._states.get(model, optimizer)

    # ------------------------------------------------------------------ call
    def __call__(self, model: torch.nn.Module, optimizer: Any, *batch: Any, **kwargs: Any) -> Any:
        model = unwrap_compiled(model)  # a torch.compile'd model: its original module
        state = self._state(model, optimizer)
        if not state.params or not all(isinstance(p, DTensor) for p in state.params.values()):
            self.distribute(model, optimizer, _batch=(batch, kwargs))
            state = self._state(model, optimizer)
        if optimizer is not None and self._lazy_state(optimizer):
            state = self._state(model, optimizer)
        key = signature(state, batch, kwargs)
        self.calls += 1
        if self._guard is None:  # every rank's first call: set up together
            self._setup_groups()
        free = self._sizes.free_key(state, batch, kwargs) if self._sizes is not None else None
        current = self._current
        name = getattr(self.fn, "__name__", "step")
        self._feed = []
        bad_ids = None
        if current is not None:
            sized = current.sizes is not None
            mine = free if sized else key
            bad_ids = self._bad_ids(current, batch, kwargs)  # every rank must raise: this rank raises the flag
            fold = None if sized else self._fold_point(current.step)
            path = "folded" if fold is not None else "standalone" if self._guard.group is not None else "unchecked"
            self.checks[path] += 1
            # the program this rank runs: the agreed one, or another cached one for its signature
            # (none while this rank's batch has a bad token id: it raises the flag, every rank stops)
            target = None if bad_ids is not None else current if current.local_key == mine else None if sized else self._switch_target(mine, fold)
            meets = target is current or fold is None or (target is not None and getattr(self._fold_point(target.step), "spec", None) == fold.spec)
            try:
                slots = self._sizes.slots(current.sizes, batch, kwargs, target is current) if sized else None
                leaves = flatten_batch(batch, kwargs)[0]
                if target is not None and not meets:  # its fold is another collective: join the agreed one's, naming it
                    self._guard.start(changed=True, fold=fold, program=target.slot, leaves=leaves)  # Resync unless every rank named it
                    check = self._guard.agreed(target.draws)
                else:  # the agreed program, or one whose fold meets the agreed one's: its fold checks the ids
                    check = self._guard.start(changed=target is None, fold=fold, draws=current.draws, sizes=slots,
                                              program=target.slot if target is not None else 0, ids=self.options.cache_size,
                                              values=value_slots(self.mesh, current.step, leaves, target is None)
                                              if fold is None and self._checks_values() else None,
                                              leaves=leaves)
                if target is not None:
                    if sized:  # needs every rank's sizes before it starts; a broken size guard: Resync
                        self._feed, check = self._sizes.wait(current.sizes, check, batch, kwargs)
                    self._last_key, self.last = key, target.step
                    self._pinned = (model, optimizer, state)  # nothing changes it before the program runs
                    try:
                        out = self._run_checked(target, model, optimizer, batch, kwargs, check)
                    finally:
                        self._pinned = None
                    if target is not current:  # every rank ran it (its check read every rank's id): agreed
                        self.checks[f"switched ({path})"] += 1
                        self._current = target
                        self._programs.move_to_end(next(k for k, p in self._programs.items() if p is target))
                    return out
                check()  # raises Resync: this rank's signature changed, the others learn it from the flag
            except Resync as e:
                self.checks[f"resync ({path})"] += 1
                log.info("call %d: %s; agreeing on the program anew", self.calls, e.args[0] if e.args else "a rank's call signature changed")
            except GuardError as e:
                where = e.where or "the per-step check that every rank runs the same program (before the step's first collective)"
                raise collective_failure(e, where=where, step_name=name, call=self.calls, timeout=self.options.timeout) from e
        try:
            checks = self._checks_values()
            everyone = tuple(exchange((self._payload(key, free, batch, kwargs), None if bad_ids is None else str(bad_ids),
                                       batch_digests(self.mesh, self.plan, batch, kwargs) if checks else None,
                                       shard_digests(self.mesh, self.plan, batch, kwargs) if checks else None)))
        except RuntimeError as e:
            raise collective_failure(e, where="the exchange of call signatures that picks the program", step_name=name,
                                     call=self.calls, timeout=self.options.timeout) from e
        error = (bad_ids or ranks_ids_error([text for _, text, _, _ in everyone])
                 or values_error([d for _, _, d, _ in everyone], self.mesh)
                 or global_batch_error([s for _, _, _, s in everyone], self.mesh))  # every rank passed the global batch
        if error is not None:
            raise error
        everyone = tuple(payload for payload, _, _, _ in everyone)
        program = self._agree_program(model, optimizer, batch, kwargs, key, everyone, free)
        self._current = program
        self._last_key, self.last = key, program.step
        return self._run_checked(program, model, optimizer, batch, kwargs, self._guard.agreed(program.draws))

    def _run_checked(self, program: Program, model: Any, optimizer: Any, batch: tuple, kwargs: dict, check: Any) -> Any:
        try:
            with running(self._progress):  # a backend compiling on the first run reports in this mode
                return self._run(program.step, model, optimizer, batch, kwargs, check)
        finally:
            check.finish()  # ranks other than 0 that drew from rank 0's generator get theirs back

    def _bad_ids(self, program: Program, batch: tuple, kwargs: dict) -> ValueError | None:
        """The error for a token id of this rank's batch outside an embedding's table
        (:mod:`.token_ids`; a vocab-sharded table would mask it out silently), or None."""
        try:
            return IdCheck.of(program.step.traced)(batch, kwargs)
        except Exception:  # the check must never stop one rank alone (the others would wait for it)
            log.warning("the token-id check failed on this batch; the step runs unchecked", exc_info=True)
            return None

    def _checks_values(self) -> bool:
        """Whether the step check compares the batch values that ranks must share
        (:mod:`.batch_digest`): with ``check_ranks``, on a process group of several ranks."""
        return self.checks_batch_values and self.options.check_ranks and self._guard is not None and self._guard.group is not None

    def _setup_groups(self) -> None:
        """The step guard's group, and the collective timeout on the mesh's groups."""
        timeout = self.options.timeout
        self._guard = StepGuard(self.mesh, timeout)
        if self.options.dynamic is not False:  # True, or None (automatic: the payloads carry the sizes from the start)
            self._sizes = self._batch_sizes(self._guard.group is not None)
            if self._sizes is None:  # the sizes cannot ride in the step check: one program per shape
                self.options = dataclasses.replace(self.options, dynamic=False)
                self._auto = None
        if not dist.is_initialized() or dist.get_backend() == "fake":
            return
        start_heartbeat()  # a roll call after a failed collective tells blocked ranks from dead ones
        if timeout is None:
            return
        for axis in range(self.mesh.ndim):
            pt.set_group_timeout(self.mesh.get_group(axis), timeout)
        if self._guard.group is not None:
            pt.set_group_timeout(self._guard.group, timeout)

    def _payload(self, key: Any, free: Any, batch: tuple, kwargs: dict) -> Any:
        """What a rank sends to agree on the program: its signature's digest (dynamic=True:
        also the digest without the sharded sizes, and its local sizes)."""
        digest = hashlib.sha1(repr(key).encode()).hexdigest()
        if self._sizes is None:
            return digest
        return digest, hashlib.sha1(repr(free).encode()).hexdigest(), self._sizes.local(batch, kwargs)

    def _batch_sizes(self, exchanged: bool) -> BatchSizes | None:
        """The ranks' agreement on the batch sizes (dynamic=True; see :meth:`BatchSizes.over`)."""
        return BatchSizes.over(self.mesh, self.plan, exchanged)

    def _per_shape(self) -> str | None:
        """Why this step cannot serve every batch size with one program (None: it can)."""
        return "this step"

    def _agree_program(self, model: Any, optimizer: Any, batch: tuple, kwargs: dict, key: Any, everyone: tuple, free: Any = None) -> Program:
        """Every rank together, with every rank's call signature (``everyone``): reuse the
        program compiled for exactly these signatures (or, dynamic=True, a symbolic one
        whose size guards hold for the sizes of every rank) or compile one (collective)."""
        reason, payloads = None, everyone
        if self._sizes is not None:
            found, self._feed, reason = self._sizes.pick(self._programs, tuple(p[1] for p in payloads), [p[2] for p in payloads])
            if found is not None:
                self._programs.move_to_end(found)
                return self._programs[found]
            everyone = tuple(p[0] for p in payloads)
        program = self._programs.get(everyone)
        if program is not None:
            self._programs.move_to_end(everyone)
            return program
        self._compiling = [p[2] for p in payloads] if self._sizes is not None else None  # every rank's sizes, for dumps
        symbolic, note = False, None
        if self._auto is not None:  # decided from every rank's payload and the cache: the same on every rank
            symbolic, note = self._auto.decide(self._programs, tuple(p[1] for p in payloads), self._sizes,
                                               self._sizes.dims(batch, kwargs), self._compiling)
            if note:
                log.info("%s", note)
        program = self._compile_as(symbolic, model, optimizer, batch, kwargs,
                                   reason or (note.split(":")[0] + ", batch dims symbolic" if note else why_recompile(self._last_key, key)))
        if self._auto is not None:
            self._auto.compiled(tuple(p[1] for p in payloads), symbolic, program)
        known = len(self._states.value_guards)
        self._states.add_value_guards(getattr(getattr(program.step, "traced", None), "value_guards", []))
        if len(self._states.value_guards) > known or program.state_changed:  # the same on every rank (they agreed on the program)
            # the outcomes of the optimizer's branches it found join the signature (trace/value_guards.py);
            # or the compile changed the state the signature reads (a pipeline rank dropped other stages' parameters)
            # (with the modules' modes and the context the call came in with: the step may have switched them, model.train())
            key = signature(self._state(model, optimizer), batch, kwargs)[:-2] + key[-2:]
            free = self._sizes.free_key(self._state(model, optimizer), batch, kwargs)[:-2] + free[-2:] if self._sizes is not None else None
            rekeyed = self._rekeyed(key[-3]) if len(self._states.value_guards) > known else []
            sent = tuple(exchange((self._payload(key, free, batch, kwargs), [digest for _, _, digest in rekeyed])))
            payloads = tuple(p for p, _ in sent)
            everyone = payloads if self._sizes is None else tuple(p[0] for p in payloads)
            self._apply_rekeyed(rekeyed, [d for _, d in sent])
        program.local_key = key
        if self._sizes is not None:
            program.free = tuple(p[1] for p in payloads)
            program.batch_sizes = self._global_or_none(batch, kwargs, [p[2] for p in payloads])
        if self._sizes is not None and program.step.size_symbols:  # serves every size its guards allow
            program.sizes = self._sizes.describe(program.step, self._sizes.dims(batch, kwargs))
            program.local_key = free
            self._feed, broken = self._sizes.agreed_values(program.sizes, [p[2] for p in payloads])
            assert broken is None, broken  # compiled for these sizes
            everyone = self._sizes.new_key(self._programs, tuple(p[1] for p in payloads), reason)
        while everyone not in self._programs and len(self._programs) >= self.options.cache_size:
            dropped, old = self._programs.popitem(last=False)
            self._watch.drop(dropped)
            log.info("compile cache full (cache_size=%d): dropped the least recently used program (%s)", self.options.cache_size, old.reason)
        self._watch.compiled(everyone, compiles=self.compiles, calls=self.calls, seconds=program.compile_seconds)
        # its id, carried by a folded check (fold.py): the lowest slot free, the same on every rank (the cache is)
        used = {p.slot for k, p in self._programs.items() if k != everyone}
        program.slot = min(set(range(1, self.options.cache_size + 1)) - used)
        program.step.program_id = program.slot
        self._programs[everyone] = program
        return program

    def _compile_as(self, symbolic: bool, *args: Any) -> Program:
        """``_compile`` with ``dynamic=True`` (``symbolic``) or as the options say; dynamic=None
        (automatic) compiles static unless ``symbolic``."""
        if self._auto is None:
            return self._compile(*args)
        self.options = dataclasses.replace(self.options, dynamic=symbolic)
        try:
            return self._compile(*args)
        finally:
            self.options = dataclasses.replace(self.options, dynamic=None)

    def _global_or_none(self, batch: tuple, kwargs: dict, everyone: list[Any]) -> list[int] | None:
        """The call's global sharded batch sizes (None: a layout torch.chunk does not cut)."""
        dims = self._sizes.dims(batch, kwargs) if self._sizes is not None else None
        if not dims:
            return None
        try:
            return self._sizes.global_of(dims, everyone)
        except ValueError:
            return None

    def _rekeyed(self, outcomes: tuple) -> list[tuple[Any, tuple, str]]:
        """The cached fixed-size programs keyed anew with the current outcomes of the
        optimizer's branches (a program compiled before a branch was found never took it:
        it serves either outcome, and stays cached rather than compiling again under the
        longer signature): ``(cache key, new local key, its digest)``, in cache order (the
        same on every rank)."""
        out = []
        for k, p in self._programs.items():
            if p.sizes is None and isinstance(p.local_key, tuple) and len(p.local_key) >= 3:
                new = p.local_key[:-3] + (outcomes,) + p.local_key[-2:]
                out.append((k, new, hashlib.sha1(repr(new).encode()).hexdigest()))
        return out

    def _apply_rekeyed(self, rekeyed: list[tuple[Any, tuple, str]], digests: list[list[str]]) -> None:
        """Move the programs of :meth:`_rekeyed` to the keys every rank's new digests make."""
        if not rekeyed:
            return
        moved = {}
        for i, (k, new, _) in enumerate(rekeyed):
            self._programs[k].local_key = new
            moved[k] = tuple(d[i] for d in digests)
        items = list(self._programs.items())  # least recent first: kept so
        self._programs.clear()
        for k, p in items:
            self._programs[moved.get(k, k)] = p

    def _switch_target(self, mine: Any, fold: Any) -> Program | None:
        """A cached program for this rank's signature ``mine`` (not the agreed one), to
        switch to without an exchange of signatures: with the standalone check (``fold``
        None) the rank runs it, the check's exchange carrying its id (:mod:`.guard`); if its folded check
        meets the agreed program's ``fold`` in the same collective (same
        :attr:`~.fold.FoldPoint.spec`) the rank runs it, and its fold's ids tell every
        rank whether all ran the same program (then it is the agreed one) or not (then
        all resync); otherwise the rank joins the agreed program's fold naming it, and
        runs it if every rank named it. None: none cached (or only symbolic programs, or
        programs that draw, which agree through the exchange). Of several, one whose
        fold meets ``fold``, the most recently used (another rank may pick otherwise:
        then they resync)."""
        found = [p for p in reversed(self._programs.values()) if p.local_key == mine and p.sizes is None and not p.draws]
        meets = [p for p in found if fold is None or getattr(self._fold_point(p.step), "spec", None) == fold.spec]
        return (meets or found or [None])[0]

    def _compile(self, model: Any, optimizer: Any, batch: tuple, kwargs: dict, reason: str) -> Program:
        """``_build`` on every rank, then agreement: all ranks return, or all raise; with
        progress lines on rank 0 (:mod:`.progress`)."""
        name = getattr(self.fn, "__name__", "step")
        with compiling(header_line(name, self.mesh, reason), self._progress) as progress:
            program = self._compile_stages(model, optimizer, batch, kwargs, reason, progress)
            if progress is not None:
                progress.finish(summary_line(name, program.compile_seconds, program.step))
        return program

    def _compile_stages(self, model: Any, optimizer: Any, batch: tuple, kwargs: dict, reason: str, progress: Any) -> Program:
        name = getattr(self.fn, "__name__", "step")
        log.info("compiling %s (%s)", name, reason)
        start = time.perf_counter()
        error: BaseException | None = None
        step, texts, memory = None, {}, None
        try:  # anything that can fail on one rank fails here, before the step's first collective
            step, texts = self._build(model, optimizer, batch, kwargs)
            bad_ids = embedding_ids_error(step.traced, batch, kwargs)  # once per compile, on the batch it is for
            if bad_ids is not None:
                raise bad_ids
            shown = progress is not None and (progress.verbose or time.perf_counter() - start >= progress.threshold)
            memory = self._memory(step, batch, kwargs) if self.options.memory_budget_gb or log.isEnabledFor(logging.INFO) or shown else None
            step.static_peak_bytes = memory.peak_bytes if memory is not None else None
            if memory is not None and self.options.memory_budget_gb:
                check_budget(memory, self.options.memory_budget_gb, name=name)
            self._dump(step, {**texts, "reason": reason})
        except BaseException as e:  # reported to every rank by check_agreement (an interrupt too)
            error = e
        if self.options.check_ranks:
            groups = {} if step is None else {g: n for g, n in zip(step.mctx.group_names, step.mctx.axis_names)}
            try:
                check_agreement(step.gm if step else None, groups, with_sizes=bool(step and step.rank_independent), error=error)
            except RuntimeError as e:
                if e is error or isinstance(e, SpmdError):
                    raise
                raise collective_failure(e, where="the rank agreement of the compile (exchange of program fingerprints)",
                                         step_name=name, call=self.calls, timeout=self.options.timeout) from e
        elif error is not None:
            raise error
        state_changed = self._after_agreement(step, model, optimizer)
        elapsed = time.perf_counter() - start
        self.compiles += 1
        step.timings["total"] = elapsed
        if log.isEnabledFor(logging.INFO):
            from ..dump.summary import comm_summary

            log.info("collectives per rank per step:\n%s", comm_summary(step.gm).table())
            if memory is not None:
                log.info("memory per rank per step (static trace%s):\n%s", memory.sizes_note, memory.table())
            peak = f", static peak {format_bytes(memory.peak_bytes)} per rank" if memory is not None else ""
            log.info(
                "compiled %s in %.2fs (%s): %d nodes, %d collectives%s", name, elapsed,
                ", ".join(f"{k} {v:.2f}s" for k, v in step.timings.items() if not k.startswith("pass ") and k != "total"),
                len(step.gm.graph.nodes), len(step.collectives()), peak,
            )
        return Program(step, elapsed, reason, dict(step.timings), draws=self._draws(step), state_changed=state_changed)

    # ------------------------------------------------------------------ what subclasses provide
    def _build(self, model: Any, optimizer: Any, batch: tuple, kwargs: dict) -> tuple[Any, dict[str, Any]]:
        """This rank's program for the call (and graph texts for a dump)."""
        raise NotImplementedError

    def _after_agreement(self, step: Any, model: Any, optimizer: Any) -> bool:
        """Called once all ranks compiled the same program; True when it changed the state
        the call signature reads (the program is then keyed by the changed state)."""
        return False

    def _draws(self, step: Any) -> bool:
        """Whether the step's random draws need every rank's generator in one state (a
        pipeline's stages draw on different ranks, so it says no)."""
        return draws(step.gm)

    def _fold_point(self, step: Any) -> Any:
        """The collective of ``step`` that carries the per-step check (a
        :class:`~.fold.FoldPoint`), or None for the standalone check. The same on every
        rank: it depends only on the agreed program and the backend."""
        return None

    def _run(self, step: Any, model: Any, optimizer: Any, batch: tuple, kwargs: dict, check: Callable[[], None]) -> Any:
        """Run ``step``; call ``check()`` before its first collective, write or random op
        (it raises Resync when another rank's signature changed: nothing may have changed yet)."""
        raise NotImplementedError

    def _release(self) -> None:
        """Drop compiled programs and cached state (the next call compiles again)."""
        self._programs.clear()
        self._current = None
        self._last_key = None
        self.last = None
        self.cache = ExpansionCache()
        self._states = StateCache()
