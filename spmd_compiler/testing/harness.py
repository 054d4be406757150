"""Train a model with every rank simulated in one process.

:class:`SimulatedTraining` compiles a step the way ``spmd_compiler.compile`` does
(trace, expand for each distinct rank layout, recompile when the optimizer state
appears), runs all ranks with :func:`~spmd_compiler.testing.simulate.run_lockstep`, and
keeps the model and optimizer passed in updated with the assembled global state, so the
result can be compared with a single-device run of the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..expand import ExpansionCache, expand
from ..plan import Plan
from ..trace import trace
from ..trace.state import collect_state, input_value
from .simulate import assemble, group_axes_of, rank_coordinates, run_lockstep, shard_tensor

__all__ = ["SimulatedTraining"]


class SimulatedTraining:
    """Run ``step_fn(model, optimizer, *batch)`` on all ranks of ``mesh`` in one process.

    ``model`` and ``optimizer`` are single-device objects; after every step they hold the
    global values assembled from all ranks. Batches are given globally and sharded per
    rank by the plan. ``expansions`` holds the ExpandedSteps of the last compile, keyed
    by mesh coordinate.
    """

    def __init__(
        self,
        step_fn: Callable[..., Any],
        model: torch.nn.Module,
        optimizer: Any,
        mesh: Any,
        plan: Plan | None = None,
        *,
        fallback: str = "replicate",
        passes: Any = None,
    ) -> None:
        self.step_fn = step_fn
        self.model = model
        self.optimizer = optimizer
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        self.plan = plan or Plan()
        self.fallback = fallback
        self.cache = ExpansionCache()
        self.coords = rank_coordinates(self.mesh_shape)
        self.expansions: dict[tuple[int, ...], Any] = {}
        self._key: Any = None
        self.compiles = 0
        self.passes = list(passes) if passes is not None else []

    def _structure_key(self, batch: tuple) -> Any:
        state = collect_state(self.model, self.optimizer)
        leaves = pytree.tree_leaves(batch)
        shapes = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("c", x) for x in leaves)
        return shapes, tuple(sorted(state.optim)), tuple(state.params), tuple(state.buffers), state.fixed_hparams()

    def _compile(self, batch: tuple) -> None:
        traced = trace(self.step_fn, self.model, self.optimizer, *batch)
        first = expand(traced, self.mesh, self.plan, coordinate=self.coords[0], fallback=self.fallback, cache=self.cache)
        self.expansions = {self.coords[0]: first}
        for c in self.coords[1:]:
            self.expansions[c] = first if first.rank_independent else expand(
                traced, self.mesh, self.plan, coordinate=c, fallback=self.fallback, cache=self.cache
            )
        if self.passes:
            from ..optimize import run_passes

            for e in {id(e): e for e in self.expansions.values()}.values():
                e.gm, e.pass_records = run_passes(e.gm, self.passes)
        self.traced = traced
        self.compiles += 1

    def step(self, *batch: Any) -> Any:
        key = self._structure_key(batch)
        if key != self._key:
            self._compile(batch)
            self._key = self._structure_key(batch)
        traced = self.traced
        state = collect_state(self.model, self.optimizer)
        batch_leaves = pytree.tree_leaves((batch, {}))
        globals_: list[torch.Tensor] = []
        for inp in traced.inputs:
            value = input_value(inp, state, batch_leaves)
            globals_.append(value.detach() if inp.kind == "param" else value)
        first = self.expansions[self.coords[0]]
        inputs = {
            c: [shard_tensor(g, spec.placements, self.mesh_shape, c) for g, spec in zip(globals_, first.input_specs)]
            for c in self.coords
        }
        outs = run_lockstep({c: e.gm for c, e in self.expansions.items()}, inputs, self.mesh_shape, group_axes=group_axes_of(first))
        pt.mark_optimizer_stepped(self.optimizer)
        # write the updated state back, assembled, into the single-device objects
        with torch.no_grad():
            for i, (inp, spec) in enumerate(zip(traced.inputs, first.input_specs)):
                if inp.kind in ("batch", "hparam"):
                    continue
                full = assemble(spec.placements, spec.shape, {c: inputs[c][i] for c in self.coords}, self.mesh_shape)
                globals_[i].copy_(full)
        user_leaves: dict[int, Any] = dict(traced.user_constants)
        for j, slot in enumerate(first.outputs):
            full = assemble(slot.spec.placements, slot.spec.shape, {c: outs[c][j] for c in self.coords}, self.mesh_shape)
            if slot.kind == "user":
                user_leaves[slot.index] = full
            else:
                param = state.params[slot.name]
                self.optimizer.state[param][slot.key] = full
        leaves = [user_leaves[i] for i in range(len(user_leaves))]
        return pytree.tree_unflatten(leaves, traced.user_spec)
