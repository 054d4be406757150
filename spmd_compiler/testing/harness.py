"""Train a model with every rank simulated in one process, through the real driver.

:class:`SimulatedTraining` compiles a step with the same driver as
``spmd_compiler.compile`` (:func:`spmd_compiler.driver.build_program`, same Options, same
default passes, same call signature deciding when to recompile, rank agreement between
the simulated ranks), feeds each program by name (:func:`~spmd_compiler.driver.program_inputs`)
and stores its results the same way (:func:`~spmd_compiler.driver.store_outputs`). It
runs all ranks with :func:`~spmd_compiler.testing.simulate.run_lockstep` and keeps the
model and optimizer passed in updated with the assembled global state, so the result can
be compared with a single-device run of the same step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from .. import _private_torch as pt
from ..driver import Options, build_program, compare_fingerprints, fingerprint, program_inputs, signature, store_outputs, why_recompile
from ..driver.auto_dynamic import switch_message
from ..driver.batch import sharded_batch_dims
from ..driver.token_ids import embedding_ids_error
from ..expand import ExpansionCache
from ..expand.symbolic import concrete_shape
from ..plan import Plan
from ..trace.state import StateCache, unwrap_compiled
from ..trace.tracer import flatten_batch
from .simulate import assemble, check_replicas, group_axes_of, rank_coordinates, run_lockstep, shard_tensor

__all__ = ["SimulatedTraining"]

log = logging.getLogger(__name__)


class SimulatedTraining:
    """Run ``step_fn(model, optimizer, *batch)`` on all ranks of ``mesh`` in one process.

    ``model`` and ``optimizer`` are single-device objects; after every step they hold the
    global values assembled from all ranks. Batches are given globally and sharded per
    rank by the plan. ``options`` are ``compile()``'s (:class:`spmd_compiler.driver.Options`;
    ``passes`` defaults to the same passes). ``expansions`` holds the programs of the last
    compile, keyed by mesh coordinate; ``reasons`` why each compile happened.
    ``create_lazy_state``: create the optimizer's state before the first trace, as
    ``compile()`` does (False: trace the state-creating first step, as ``compile()`` does
    for an optimizer whose state comes from its update, such as SGD's momentum).
    """

    def __init__(
        self,
        step_fn: Callable[..., Any],
        model: torch.nn.Module,
        optimizer: Any,
        mesh: Any,
        plan: Plan | None = None,
        *,
        create_lazy_state: bool = True,
        **options: Any,
    ) -> None:
        self.step_fn = step_fn
        self.create_lazy_state = create_lazy_state
        self.model = unwrap_compiled(model)  # a torch.compile'd model: its original module
        self.optimizer = optimizer
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        self.plan = plan or Plan()
        # the intent check (driver/intent.py) is on: a program that lost what the step wrote fails the test
        self.options = Options.from_kwargs({"check_ranks": True, "check_intent": True, **options})
        self.cache = ExpansionCache()
        self._states = StateCache()
        self.coords = rank_coordinates(self.mesh_shape)
        self.expansions: dict[tuple[int, ...], Any] = {}
        self._key: Any = None
        self.compiles = 0
        self.reasons: list[str] = []
        self.last_sizes: list[int] = []  # the size_* inputs of the last call (dynamic=True)
        # dynamic=True: the symbolic programs (free signature, expansions), most recently used
        # first, up to cache_size, as the driver keeps them (driver/sizes.py: BatchSizes.pick)
        self._kept: list[tuple[Any, dict]] = []
        # dynamic=None (automatic, as compile()): the free signature and global batch sizes of
        # every compile, and the free signatures whose symbolic compile fell back
        self._compiled_free: list[tuple[Any, list[int]]] = []
        self._fallen: list[Any] = []

    def write_dump(self, root: Any, *, name: str = "step") -> Any:
        """Write the dump of rank 0's program of the last compile (``spmd_compiler.dump``)
        with the sizes of the last call (a symbolic program's ``sizes.txt`` lists every
        rank's local sizes); returns its folder."""
        from ..dump.writer import write_dump

        first = self.expansions[self.coords[0]]
        return write_dump(root, first, name=name, sizes=self.last_sizes if first.size_symbols else None)

    def _auto_options(self, state: Any, batch: tuple) -> Any:
        """The options of a compile: under ``dynamic=None`` (automatic) ``dynamic=True`` when
        an earlier compile had this call's free signature (only the batch sizes differ),
        with one INFO line, as the driver decides (:mod:`spmd_compiler.driver.auto_dynamic`)."""
        if self.options.dynamic is not None:
            return self.options
        free, sizes = self._free(state, batch)
        old = next((s for f, s in reversed(self._compiled_free) if f == free), None)
        symbolic = self.options.symbolic != "none" and old is not None and sizes and free not in self._fallen
        if symbolic:
            log.info("%s", switch_message(old, sizes))
        return dataclasses.replace(self.options, dynamic=bool(symbolic))

    def _free(self, state: Any, batch: tuple) -> tuple[Any, list[int]]:
        """The call signature without the symbolic batch dims' sizes, and those sizes (global)."""
        dims = sharded_batch_dims(self.plan, batch, {}, len(self.mesh_shape), dynamic=True)
        leaves = flatten_batch(batch, {})[0]
        return signature(state, batch, {}, free_dims=dims), [int(leaves[i].shape[d]) for i, ds in dims.items() for d in ds]

    def _compile(self, batch: tuple) -> None:
        state = self._states.get(self.model, self.optimizer)
        options = self._auto_options(state, batch)
        first = build_program(self.step_fn, self.model, self.optimizer, batch, {}, self.mesh, self.plan, options,
                              coordinate=self.coords[0], cache=self.cache)
        self.expansions = {self.coords[0]: first}
        for c in self.coords[1:]:
            self.expansions[c] = first if first.rank_independent else build_program(
                self.step_fn, self.model, self.optimizer, batch, {}, self.mesh, self.plan, options,
                coordinate=c, cache=self.cache, traced=first.traced,
            )
        if self.options.check_ranks:  # what check_agreement exchanges between real ranks
            groups = dict(zip(first.mctx.group_names, first.mctx.axis_names))
            compare_fingerprints([fingerprint(e.gm, groups, with_sizes=first.rank_independent) for e in self.expansions.values()])
        self.traced = first.traced
        self._states.add_value_guards(first.traced.value_guards)
        self.compiles += 1
        if self.options.dynamic is None:  # after the value guards: they join the signature
            free, sizes = self._free(self._states.get(self.model, self.optimizer), batch)
            self._compiled_free = [*self._compiled_free, (free, sizes)][-64:]
            if options.dynamic and not first.size_symbols:
                self._fallen.append(free)

    def _signature(self, state: Any, batch: tuple) -> tuple:
        """The call signature; a symbolic program's (dynamic=True) leaves out the sizes of
        its symbolic batch dims (dim 0), which its size guards check instead; a split
        sequence stays in it (static: a new length compiles again)."""
        first = self.expansions.get(self.coords[0])
        free = sharded_batch_dims(self.plan, batch, {}, len(self.mesh_shape), dynamic=True) if first is not None and first.size_symbols else None
        return signature(state, batch, {}, free_dims=free)

    def _globals(self, first: Any, state: Any, batch: tuple) -> list[Any]:
        leaves, _, _ = flatten_batch(batch, {})
        return [v.detach() if inp.kind == "param" else v for inp, v in zip(first.traced.inputs, program_inputs(first, state, leaves))]

    def _pick(self, state: Any, batch: tuple) -> bool:
        """Switch to the first kept symbolic program (most recently used first) for this
        call's free signature whose every rank's size guards hold; False if none does."""
        free = signature(state, batch, {}, free_dims=sharded_batch_dims(self.plan, batch, {}, len(self.mesh_shape), dynamic=True))
        for i, (key, expansions) in enumerate(self._kept):
            first = expansions[self.coords[0]]
            if key != free:
                continue
            globals_ = self._globals(first, state, batch)
            values = first.size_guards.values_of(globals_)
            if first.size_guards.disagreement(globals_) or any(e.size_guards.failing(values) for e in expansions.values()):
                continue
            self._kept.insert(0, self._kept.pop(i))
            self.expansions, self._key, self.traced = expansions, key, first.traced
            return True
        return False

    def step(self, *batch: Any) -> Any:
        if self.optimizer is not None and self.create_lazy_state:  # as the driver's calls do (StepDriver._lazy_state)
            pt.create_lazy_state(self.optimizer)
        state = self._states.get(self.model, self.optimizer)
        key = self._signature(state, batch)
        reason = why_recompile(self._key, key) if key != self._key else None
        if reason is None and self.expansions[self.coords[0]].size_symbols:
            first = self.expansions[self.coords[0]]
            globals_ = self._globals(first, state, batch)
            values = first.size_guards.values_of(globals_)
            broken = [why for why in [first.size_guards.disagreement(globals_)] if why]
            broken += [why for e in self.expansions.values() if (why := e.size_guards.failing(values))]
            if broken:  # every rank's program must serve the sizes
                reason = f"batch sizes {dict((str(k), v) for k, v in values.items())} break a size guard: {broken[0]}"
        if reason is not None and self._kept and self._pick(state, batch):
            reason = None
        if reason is not None:
            self.reasons.append(reason)
            self._compile(batch)
            state = self._states.get(self.model, self.optimizer)
            self._key = self._signature(state, batch)
            if self.expansions[self.coords[0]].size_symbols:
                self._kept = [(self._key, self.expansions), *self._kept][: self.options.cache_size]
        bad_ids = embedding_ids_error(self.traced, batch, {})  # as the driver checks every call, before the program runs
        if bad_ids is not None:
            raise bad_ids
        first = self.expansions[self.coords[0]]
        globals_ = self._globals(first, state, batch)
        sizes = list(first.size_guards.values_of(globals_).values()) if first.size_symbols else []
        self.last_sizes = sizes
        inputs = {
            c: [shard_tensor(g, spec.placements, self.mesh_shape, c, first.mctx.cp) for g, spec in zip(globals_, first.input_specs)]
            for c in self.coords
        }
        feeds = {c: sizes + inputs[c] for c in self.coords}  # the size_* inputs follow the coordinates
        outs = run_lockstep({c: e.gm for c, e in self.expansions.items()}, feeds, self.mesh_shape, group_axes=group_axes_of(first))
        values = first.size_guards.values_of(globals_) if first.size_symbols else {}

        def shape(spec: Any) -> tuple[int, ...]:
            return concrete_shape(spec.shape, values, first.size_definitions) if values else tuple(spec.shape)

        pt.mark_optimizer_stepped(self.optimizer)
        for j, slot in enumerate(first.outputs):  # what the plan calls Replicate is the same on every rank
            check_replicas(f"output {j}", slot.spec.placements, {c: outs[c][j] for c in self.coords}, self.mesh_shape)
        # write the updated state back, assembled, into the single-device objects
        with torch.no_grad():
            for i, (inp, spec) in enumerate(zip(first.traced.inputs, first.input_specs)):
                if inp.kind in ("batch", "hparam"):
                    continue
                full = assemble(spec.placements, shape(spec), {c: inputs[c][i] for c in self.coords}, self.mesh_shape, first.mctx.cp)
                globals_[i].copy_(full)
        assembled = [
            assemble(slot.spec.placements, shape(slot.spec), {c: outs[c][j] for c in self.coords}, self.mesh_shape, first.mctx.cp)
            for j, slot in enumerate(first.outputs)
        ]
        return store_outputs(first, assembled, state, self.optimizer, lambda slot, value: value)
