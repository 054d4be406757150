"""Turning a single-device model and optimizer into sharded ones (DTensors).

After :func:`distribute_state`, every parameter and buffer of the model is a DTensor
with the plan's placements (parameters stay ``nn.Parameter``), the optimizer holds the
new parameters, and any existing optimizer state and gradient (``.grad``) is a DTensor
laid out like its parameter. ``model.state_dict()`` / ``optimizer.state_dict()`` then return DTensors, which
``torch.distributed.checkpoint`` saves and loads. Values come from rank 0 (``distribute_tensor``
scatters/broadcasts), so all ranks start identical even if they initialized differently.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ..plan import Plan
from ..trace.state import collect_state
from ..trace.tracer import GraphInput

__all__ = ["distribute_state", "state_inputs", "is_distributed", "is_host_scalar"]

log = logging.getLogger(__name__)


def state_inputs(model: torch.nn.Module, optimizer: Any) -> tuple[list[GraphInput], Any]:
    """GraphInputs for the model's parameters, buffers and tensor optimizer state."""
    state = collect_state(model, optimizer)
    inputs: list[GraphInput] = []

    def add(kind: str, name: str, t: torch.Tensor, key: str | None = None) -> None:
        inputs.append(GraphInput(kind, name, tuple(t.shape), tuple(t.stride()), t.dtype, key, device=t.device))

    for n, p in state.params.items():
        add("param", n, p)
    for n, b in state.buffers.items():
        add("buffer", n, b)
    for (n, k) in state.tensor_optim_keys():
        add("optim", n, state.optim[(n, k)], key=k)
    return inputs, state


def is_host_scalar(t: Any) -> bool:
    """A 0-d CPU tensor of optimizer state (AdamW's ``step``): it stays a plain tensor on
    the host, as torch's optimizers keep it whatever the parameters' device, so reading
    it (``step.item()``) never waits for a GPU. Made a DTensor it would move to the mesh's
    device and cost a device-to-host sync per parameter per step."""
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() == 0 and t.device.type == "cpu"


def is_distributed(model: torch.nn.Module) -> bool:
    return all(isinstance(p, DTensor) for p in model.parameters()) and any(True for _ in model.parameters())


def _set(model: torch.nn.Module, fqn: str, value: Any, buffer: bool) -> None:
    mod_path, _, attr = fqn.rpartition(".")
    mod = model.get_submodule(mod_path) if mod_path else model
    if buffer:
        mod._buffers[attr] = value
    else:
        mod._parameters[attr] = value


def distribute_state(model: torch.nn.Module, optimizer: Any, mesh: Any, plan: Plan) -> dict[str, tuple]:
    """Shard ``model``'s parameters and buffers and ``optimizer``'s state per ``plan``.

    Tensors that already are DTensors must already have the planned placements.
    Returns the placements by input label.
    """
    inputs, state = state_inputs(model, optimizer)
    resolved = plan.resolve(SimpleNamespace(inputs=inputs, state=state, model=model), mesh)
    placements = {inp.label: pl for inp, pl in zip(inputs, resolved.placements)}
    new_params: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for inp, pl in zip(inputs, resolved.placements):
            if inp.kind == "param":
                p = state.params[inp.name]
                if isinstance(p, DTensor):
                    _check(inp.label, p, pl)
                    continue
                dt = distribute_tensor(p.detach(), mesh, list(pl))
                new = torch.nn.Parameter(dt, requires_grad=p.requires_grad)
                if p.grad is not None:  # a gradient accumulated before: laid out like its parameter
                    new.grad = distribute_tensor(p.grad.detach(), mesh, list(pl))
                new_params[id(p)] = new
                _set(model, inp.name, new, buffer=False)
                for alias, canonical in state.aliases.items():
                    if canonical == inp.name:
                        _set(model, alias, new, buffer=False)
            elif inp.kind == "buffer":
                b = state.buffers[inp.name]
                if isinstance(b, DTensor):
                    _check(inp.label, b, pl)
                    continue
                _set(model, inp.name, distribute_tensor(b, mesh, list(pl)), buffer=True)
        if optimizer is not None:
            old_state = optimizer.state
            for group in optimizer.param_groups:
                group["params"] = [new_params.get(id(p), p) for p in group["params"]]
            new_state: dict = {}
            by_name = collect_state(model, None).params
            for names, group in zip(state.param_groups, optimizer.param_groups):
                for name, p in zip(names, group["params"]):
                    old_p = state.params[name]
                    entries = old_state.get(old_p, old_state.get(p, {}))
                    if not entries:
                        continue
                    converted = {}
                    for key, value in entries.items():
                        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and not is_host_scalar(value):
                            value = distribute_tensor(value, mesh, list(placements[f"{name}[{key!r}]"]))
                        converted[key] = value
                    new_state[by_name[name]] = converted
            optimizer.state.clear()
            optimizer.state.update(new_state)
    log.info("distributed %d parameters and %d buffers over mesh %s", len(state.params), len(state.buffers), tuple(mesh.shape))
    return placements


def _check(label: str, t: DTensor, placements: tuple) -> None:
    if tuple(t.placements) != tuple(placements):
        raise ValueError(
            f"{label} is already a DTensor with placements {list(t.placements)}, but the plan asks for "
            f"{list(placements)}; fix: pass the model before distributing it, or a plan matching its placements"
        )
