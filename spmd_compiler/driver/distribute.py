"""Turning a single-device model and optimizer into sharded ones (DTensors).

After :func:`distribute_state`, every parameter and buffer of the model is a DTensor
with the plan's placements (parameters stay ``nn.Parameter``), the optimizer holds the
new parameters, and any existing optimizer state and gradient (``.grad``) is a DTensor
laid out like its parameter. ``model.state_dict()`` / ``optimizer.state_dict()`` then return DTensors, which
``torch.distributed.checkpoint`` saves and loads. Values come from rank 0 (``distribute_tensor``
scatters/broadcasts), so all ranks start identical even if they initialized differently.
A model built on ``meta`` is instead allocated shard by shard and initialized there
(``init_weights``, :mod:`.deferred_init`): no rank holds a whole parameter.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ..errors import DeferredInitError
from ..plan import Plan
from ..trace.state import collect_state
from ..trace.tracer import GraphInput
from .deferred_init import _FIX_INIT, empty_shard, run_init, target_device

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


def distribute_state(model: torch.nn.Module, optimizer: Any, mesh: Any, plan: Plan, *, init_weights: Any = None,
                     init_seed: int = 0, keep_meta: bool = False) -> dict[str, tuple]:
    """Shard ``model``'s parameters and buffers and ``optimizer``'s state per ``plan``.

    Tensors that already are DTensors must already have the planned placements. Tensors
    on ``meta`` stay on meta with ``keep_meta`` (a compile-only run); otherwise each rank
    allocates its shards on the mesh's device and ``init_weights`` initializes them
    (:mod:`.deferred_init`; None: DeferredInitError). Returns the placements by input label.
    """
    inputs, state = state_inputs(model, optimizer)
    resolved = plan.resolve(SimpleNamespace(inputs=inputs, state=state, model=model), mesh)
    placements = {inp.label: pl for inp, pl in zip(inputs, resolved.placements)}
    new_params: dict[int, torch.nn.Parameter] = {}
    deferred = not keep_meta and _check_deferred(state, init_weights)
    device = target_device(mesh.device_type) if deferred else None
    with torch.no_grad():
        for inp, pl in zip(inputs, resolved.placements):
            if inp.kind == "param":
                p = state.params[inp.name]
                if isinstance(p, DTensor):
                    _check(inp.label, p, pl)
                    continue
                dt = empty_shard(p, mesh, pl, device) if deferred and p.is_meta else distribute_tensor(p.detach(), mesh, list(pl))
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
                _set(model, inp.name, empty_shard(b, mesh, pl, device) if deferred and b.is_meta else distribute_tensor(b, mesh, list(pl)),
                     buffer=True)
        if deferred:  # every rank initializes its own shards (the init's ops are collective where DTensor's are)
            _, replaced = run_init(model, init_weights, seed=init_seed, sharded=True)
            for name, b in replaced.items():  # a buffer the init computed again (RoPE tables): placed as planned
                _set(model, name, distribute_tensor(b.to(device), mesh, list(placements[name])), buffer=True)
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


def _check_deferred(state: Any, init_weights: Any) -> bool:
    """Whether the model is on meta and has an init path (DeferredInitError when it has none,
    or when its optimizer already holds state or gradients on meta)."""
    meta = [n for n, t in {**state.params, **state.buffers}.items() if t.is_meta and not isinstance(t, DTensor)]
    if not meta:
        return False
    if init_weights is None:
        raise DeferredInitError(
            f"{len(meta)} parameter(s)/buffer(s) of the model are on the meta device ({', '.join(meta[:3])}"
            f"{', ...' if len(meta) > 3 else ''}): a model built under torch.device('meta') has shapes but no values, and "
            f"this step runs on real tensors", _FIX_INIT, meta)
    real = [n for n, t in state.params.items() if not t.is_meta and not isinstance(t, DTensor)]
    if real:  # init_weights runs the model's whole init: it would overwrite the values these already hold
        raise DeferredInitError(
            f"the model is partly on the meta device: {len(meta)} parameter(s)/buffer(s) on meta ({', '.join(meta[:3])}"
            f"{', ...' if len(meta) > 3 else ''}) and {len(real)} parameter(s) with values ({', '.join(real[:3])}"
            f"{', ...' if len(real) > 3 else ''}); init_weights initializes the whole model, and would overwrite the values "
            f"those hold (loaded weights, say)",
            "build the whole model on meta (then load weights into the distributed model: step.distribute(model, "
            "optimizer), then torch.distributed.checkpoint.load), or give the meta part values yourself before the call "
            "(submodule.to_empty(device='cpu'); submodule.reset_parameters()) and compile without init_weights", real)
    stale = [n for (n, _), v in state.optim.items() if isinstance(v, torch.Tensor) and v.is_meta]
    stale += [n for n, p in state.params.items() if p.grad is not None]
    if stale:
        raise DeferredInitError(
            f"the optimizer state or gradients of {stale[:3]} exist already, on meta, before the model has values",
            "build the optimizer on the meta model and call the compiled step before any optimizer.step()", stale)
    return True


def _check(label: str, t: DTensor, placements: tuple) -> None:
    if tuple(t.placements) != tuple(placements):
        raise ValueError(
            f"{label} is already a DTensor with placements {list(t.placements)}, but the plan asks for "
            f"{list(placements)}; fix: pass the model before distributing it, or a plan matching its placements"
        )
