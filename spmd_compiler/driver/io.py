"""Feeding a compiled program and storing what it returns, bound by name.

A program's inputs are its traced inputs (:class:`~spmd_compiler.trace.tracer.GraphInput`:
a parameter, buffer or optimizer state by FQN, a batch leaf by path, a lifted
hyperparameter by group); its outputs are :class:`~spmd_compiler.rebuild.OutputSlot`
(a leaf of the step's return value, or optimizer state the step created, by FQN and key).
The real runtime and the simulator both go through these two functions; they differ
only in how a value becomes local (a DTensor's local shard, or a global tensor sharded
for one simulated rank) and how a result is wrapped (a DTensor, or the assembled value).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..trace.host_values import resolve_constant
from ..trace.state import input_value

__all__ = ["program_inputs", "store_outputs"]


def program_inputs(step: Any, state: Any, batch_leaves: list[Any]) -> list[Any]:
    """The value of every traced input of ``step``, looked up by name in ``state``
    (parameters, buffers, optimizer state, gradients, hyperparameters) or by index in
    the batch.

    A gradient of a distributed parameter must be laid out like it (a DTensor with the
    placements the program reads, as the compiled step stores it); ValueError otherwise.
    """
    values = [input_value(inp, state, batch_leaves) for inp in step.traced.inputs]
    if step.traced.grads_in:
        for inp, value, spec in zip(step.traced.inputs, values, step.input_specs):
            if inp.kind == "grad":
                _check_grad(inp.name, state.params[inp.name], value, spec)
    return values


def _check_grad(name: str, param: Any, grad: Any, spec: Any) -> None:
    if not isinstance(param, DTensor):
        return  # one device, or the simulator's global tensors
    want = tuple(spec.placements)
    if isinstance(grad, DTensor) and tuple(grad.placements) == want and grad.device_mesh == param.device_mesh:
        return
    got = f"a DTensor with placements {list(grad.placements)}" if isinstance(grad, DTensor) else f"a {type(grad).__name__} (not a DTensor)"
    partial = any(p.is_partial() for p in want)
    if partial:  # Plan(defer_grad_sync=True)
        expected = f"an unreduced DTensor, placements {list(want)} (Plan(defer_grad_sync=True): Partial on the data axes)"
    else:
        expected = f"a DTensor laid out like the parameter, placements {list(want)}"
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements) and not partial:
        hint = ("the gradient was kept unreduced by a step compiled with Plan(defer_grad_sync=True): compile this "
                "step with the same option, or ")
    else:
        hint = ""
    raise ValueError(
        f"the gradient of parameter {name!r} (its .grad, kept from before this call) is {got}; expected {expected}, "
        f"as the compiled step stores gradients. fix: {hint}let the compiled step compute the gradients it accumulates, "
        f"call optimizer.zero_grad() (set_to_none=True) before the call, or assign "
        f"p.grad = g.redistribute(p.device_mesh, {list(want)})"
    )


def store_outputs(
    step: Any,
    values: list[Any],
    state: Any,
    optimizer: Any,
    wrap: Callable[[Any, Any], Any],
    *,
    missing: Callable[[Any], None] | None = None,
) -> Any:
    """Put the program's outputs where they belong and return the step's result.

    ``values[i]`` is the value of ``step.outputs[i]``; ``wrap(slot, value)`` turns it into
    what the user sees. Optimizer state the step created is stored into
    ``optimizer.state`` under its parameter (found by FQN); a slot whose parameter this
    rank does not hold (a pipeline stage elsewhere) goes to ``missing``. ``None``
    values (user outputs another rank holds) are skipped by ``wrap``'s caller.
    """
    traced = step.traced
    # constants of the return value; a returned hyperparameter (lr) is read now, as the
    # optimizer holds it for this call (an LR scheduler changes it between calls)
    user: dict[int, Any] = {i: resolve_constant(c, optimizer) for i, c in traced.user_constants.items()}
    for slot, value in zip(step.outputs, values):
        if slot.kind == "user":
            user[slot.index] = wrap(slot, value)
            if slot.index in traced.host_numbers:  # loss.item() returned by the step: a number again
                user[slot.index] = traced.host_numbers[slot.index](pt.local_tensor(user[slot.index]).item())
            if slot.index in traced.host_attributes:  # model.last_loss = loss.item() in the step
                owner, attr = traced.host_attributes[slot.index]
                module = traced.model.get_submodule(owner.removeprefix("model").removeprefix("."))
                setattr(module, attr, user.pop(slot.index))
        elif slot.kind == "grad":
            state.params[slot.name].grad = wrap(slot, value)
        elif slot.name in state.params:
            optimizer.state[state.params[slot.name]][slot.key] = wrap(slot, value)
        elif missing is not None:
            missing(slot)
        else:
            raise AssertionError(f"output for optimizer state of {slot.name!r}, which the optimizer does not hold")
    if traced.mode_writes:  # model.train() / .eval() in the step ran once, at the trace: as on one device, every call
        modules = list(traced.model.modules())
        for i, mode in traced.mode_writes:
            modules[i].training = mode
    if traced.grads_left or traced.grads_in:
        kept = set(traced.grads_left)
        for name, p in state.params.items():  # zero_grad(set_to_none=True) in the step, as on one device
            if name not in kept:
                p.grad = None
    return pytree.tree_unflatten([user[i] for i in range(len(user))], traced.user_spec)
