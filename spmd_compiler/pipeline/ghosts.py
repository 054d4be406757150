"""The parameters and buffers of other pipeline stages, kept as shape-only ghosts.

After the first compile each rank of a pipelined step keeps only the parameters (and
optimizer state) and buffers of its own stages (:meth:`StageOwnership._drop_other_stages`);
the others stay known by shape, dtype and place so that every rank traces the same step
(:meth:`StageOwnership._ghosted` puts them back as empty tensors for the trace).
:class:`~.step.PipelinedStep` holds the ghosts (``_ghosts``, ``_ghost_states``,
``_ghost_buffers``, set up in its ``__init__``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..trace.state import collect_state

__all__ = ["StageOwnership"]


def _owner(model: torch.nn.Module, fqn: str) -> tuple[torch.nn.Module, str]:
    """The module holding ``fqn`` and the attribute name there."""
    mod_path, _, attr = fqn.rpartition(".")
    return (model.get_submodule(mod_path) if mod_path else model), attr


class StageOwnership:
    """Stage ownership of a :class:`~.step.PipelinedStep` (a mixin)."""

    def _drop_other_stages(self, model: torch.nn.Module, optimizer: Any, assignment: Any, mine: list[int]) -> bool:
        """Remove the parameters and buffers no stage of this rank owns, from the model and
        the optimizer; they stay known as shape-only ghosts so every rank traces the same
        step. True when it dropped something."""
        state = collect_state(model, optimizer)
        drop_buffers = {f for f, owners in assignment.buffer_stages.items() if owners and not set(owners) & set(mine)}
        for fqn in drop_buffers & set(state.buffers):
            b = state.buffers[fqn]
            self._ghost_buffers[fqn] = (b.shape, b.dtype, b.device)
            mod, attr = _owner(model, fqn)
            mod._buffers[attr] = None
        drop = {fqn for fqn, owners in assignment.param_stages.items() if not set(owners) & set(mine)}
        drop &= set(state.params)
        if not drop:
            return bool(drop_buffers & set(state.buffers))
        positions = {}
        if optimizer is not None:
            for gi, names in enumerate(state.param_groups):
                for pi, name in enumerate(names):
                    positions[name] = (gi, pi)
        dropped = {id(state.params[f]) for f in drop}
        for fqn in drop:
            p = state.params[fqn]
            self._ghosts[fqn] = (p.shape, p.dtype, p.device, p.requires_grad, *positions.get(fqn, (None, None)))
            for (name, key), value in state.optim.items():
                if name == fqn and isinstance(value, torch.Tensor):
                    self._ghost_states.setdefault(fqn, {})[key] = (value.shape, value.dtype)
            for name in [fqn, *[a for a, c in state.aliases.items() if c == fqn]]:
                mod, attr = _owner(model, name)
                mod._parameters[attr] = None
        if optimizer is not None:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in dropped]
            for p in list(optimizer.state):
                if id(p) in dropped:
                    del optimizer.state[p]
        return True

    def _ghosted(self, model: torch.nn.Module, optimizer: Any = None) -> Any:
        """Context: the dropped parameters (and their optimizer state) and buffers back as
        empty tensors at their original places, for tracing."""
        import contextlib

        @contextlib.contextmanager
        def ctx() -> Any:
            placed, inserted, buffers = [], [], []
            for fqn, (shape, dtype, device) in self._ghost_buffers.items():
                mod, attr = _owner(model, fqn)
                mod._buffers[attr] = torch.zeros(shape, dtype=dtype, device=device)
                buffers.append((mod, attr))
            for fqn, (shape, dtype, device, rg, gi, pi) in sorted(self._ghosts.items(), key=lambda kv: (kv[1][4] or 0, kv[1][5] or 0)):
                mod, attr = _owner(model, fqn)
                p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=rg)
                mod._parameters[attr] = p
                placed.append((mod, attr))
                if optimizer is not None and gi is not None:
                    optimizer.param_groups[gi]["params"].insert(pi, p)
                    inserted.append((gi, p))
                    for key, (s_shape, s_dtype) in self._ghost_states.get(fqn, {}).items():
                        optimizer.state[p][key] = torch.empty(s_shape, dtype=s_dtype, device=device)
            try:
                yield
            finally:
                for mod, attr in placed:
                    mod._parameters[attr] = None
                for mod, attr in buffers:
                    mod._buffers[attr] = None
                for gi, p in inserted:
                    optimizer.param_groups[gi]["params"] = [q for q in optimizer.param_groups[gi]["params"] if q is not p]
                    optimizer.state.pop(p, None)

        return ctx()
