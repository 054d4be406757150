"""Lifting a model's parameters, buffers and an optimizer's state to graph inputs.

A training step reads three kinds of state besides its batch: the module's parameters
and buffers, and the optimizer's per-parameter state (``exp_avg``, ``momentum_buffer``,
``step``...). To trace the step as a pure function we swap each of them for a traced
tensor for the duration of the call, keyed by fully-qualified name (FQN), and restore
the originals afterwards.

Optimizer hyperparameters that schedulers change every step (``lr``, ``momentum``,
``betas``, see :data:`LIFTED_HPARAMS`) are inputs too: each param group's value is fed as
a float64 tensor and read with ``.item()`` inside the step, so the compiled program uses
the current value; a branch of the optimizer on one (``if momentum != 0``) is a value
guard (trace/value_guards.py). The others are part of the compiled step's cache key.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _private_torch as pt
from ..errors import DataDependentError, HostSettingError

log = logging.getLogger(__name__)

__all__ = ["ModelState", "StateCache", "collect_state", "unwrap_compiled", "swapped_state", "input_value", "hparam_tensor", "is_lifted", "LIFTED_HPARAMS"]

# per-group optimizer settings fed to the compiled step at every call (schedulers change
# them: OneCycleLR cycles ``momentum`` / ``betas[0]`` along with ``lr``)
LIFTED_HPARAMS = ("lr", "momentum", "betas")


# optimizer -> {(group, key)}: fused groups whose momentum / betas changed between calls
_CYCLING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_lifted(key: str, value: Any, group: dict[str, Any], cycling: bool = False) -> bool:
    """Whether param group setting ``key`` (= ``value``) is a graph input: a number, a 0-d
    tensor or (``betas``) a pair of numbers. A fused optimizer's kernel takes ``momentum``
    and ``betas`` as Python numbers, so for it they stay fixed (part of the cache key)
    until they are seen ``cycling`` (changing between calls): from then on they are
    inputs and the group is traced with its per-parameter update."""
    if key not in LIFTED_HPARAMS:
        return False
    if key != "lr" and group.get("fused") and not cycling:
        return False
    if key == "betas":
        return isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_number(v) for v in value)
    return _is_number(value) or isinstance(value, torch.Tensor) and value.dim() == 0


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class ModelState:
    """The named state of a (model, optimizer) pair, in a fixed order.

    ``params`` and ``buffers`` map FQN to tensor (tied parameters appear once, under the
    first FQN). ``optim`` maps ``(param FQN, state key)`` to the state value, tensor or
    Python scalar. ``param_groups`` lists, per optimizer group, the FQNs of its params.
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optim: dict[tuple[str, str], Any] = field(default_factory=dict)
    param_groups: list[list[str]] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # tied FQN -> canonical FQN
    hparams: dict[tuple[int, str], Any] = field(default_factory=dict)  # (group, key) -> value
    value_guards: dict[str, Any] = field(default_factory=dict)  # key -> ValueGuard (trace/value_guards.py)
    cycling: set[tuple[int, str]] = field(default_factory=set)  # fused settings seen changing (see is_lifted)
    modes: tuple[int, ...] = ()  # indices (in model.modules() order) of the modules in eval mode at this call

    def tensor_optim_keys(self) -> list[tuple[str, str]]:
        return [k for k, v in self.optim.items() if isinstance(v, torch.Tensor)]

    def lifted_hparams(self) -> list[tuple[int, str]]:
        """``(group index, key)`` of the hyperparameters fed as inputs (numbers or 0-d tensors)."""
        return [(g, k) for (g, k), v in self.hparams.items()
                if is_lifted(k, v, {"fused": self.hparams.get((g, "fused"))}, (g, k) in self.cycling)]

    def signature(self) -> tuple:
        """What a compiled step depends on besides the batch: optimizer state structure,
        parameter shapes, fixed hyperparameters (memoized; the state is not mutated)."""
        key = getattr(self, "_signature", None)
        if key is None:
            optim = tuple(sorted((n, k, (tuple(v.shape), v.device.type) if isinstance(v, torch.Tensor) else repr(v)) for (n, k), v in self.optim.items()))
            params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in self.params.items())
            key = (optim, params, self.fixed_hparams())
            self._signature = key
        return key

    def guard_outcomes(self) -> tuple:
        """Which way each branch the optimizer took on its own numbers goes now (part of
        the call signature: a flipped branch recompiles the step)."""
        return tuple(g.holds(self) for g in self.value_guards.values())

    def fixed_hparams(self) -> tuple:
        """The other hyperparameters, as a hashable record (a change recompiles the step)."""
        lifted = set(self.lifted_hparams())
        return tuple(
            (g, k, tuple(v.shape) if isinstance(v, torch.Tensor) else repr(v))
            for (g, k), v in sorted(self.hparams.items(), key=lambda kv: (kv[0][0], kv[0][1]))
            if (g, k) not in lifted
        )


def input_value(inp: Any, state: ModelState, batch_leaves: list[Any]) -> torch.Tensor:
    """The tensor a compiled step's input ``inp`` (a GraphInput) takes from ``state`` and
    the flattened batch: parameters, buffers, optimizer state and gradients as they are
    (DTensors included), hyperparameters as 0-d float64 tensors."""
    kind = inp.kind
    if kind == "param":
        return state.params[inp.name]
    if kind == "buffer":
        return state.buffers[inp.name]
    if kind == "optim":
        return state.optim[(inp.name, inp.key)]
    if kind == "grad":
        return state.params[inp.name].grad
    if kind == "hparam":
        return hparam_tensor(state.hparams[(int(inp.name[len("param_groups[") : -1]), inp.key)])
    return batch_leaves[inp.index]


def hparam_tensor(value: Any) -> torch.Tensor:
    """A lifted setting as the graph input that carries it: a 0-d float64 tensor (a pair
    such as ``betas``: a 1-d one of two)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64)


_UNWRAPPED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def unwrap_compiled(model: Any) -> Any:
    """The module to trace for ``model``: a ``torch.compile``'d module's original one.

    The compiled step is traced with make_fx, which cannot run a dynamo-compiled forward;
    the original module holds the same parameters (the wrapper's ``_orig_mod.`` names are
    the original ones), so the plan's names match as written for the plain model. Logged
    once per model, with where compiled kernels come from instead."""
    original = pt.compiled_original(model)
    if original is None:
        return model
    if original not in _UNWRAPPED:
        _UNWRAPPED.add(original)
        log.warning(
            "the model passed to the step is wrapped by torch.compile; spmd_compiler traces the original module "
            "(model._orig_mod: the same parameters, plan names without the '_orig_mod.' prefix) and runs its own "
            "per-rank program. For compiled kernels use spmd_compiler.compile(..., backend=\"inductor\")"
        )
    return original


def collect_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> ModelState:
    """Name every parameter, buffer and optimizer state entry of ``model``/``optimizer``.

    Raises ValueError when the optimizer holds a parameter that is not in the model.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected the model (first argument of the step) to be a torch.nn.Module, got {type(model).__name__}")
    params = dict(model.named_parameters(remove_duplicate=True))
    aliases: dict[str, str] = {}
    by_id = {id(p): n for n, p in params.items()}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n not in params:
            aliases[n] = by_id[id(p)]
    buffers = dict(model.named_buffers(remove_duplicate=True))
    state = ModelState(params=params, buffers=buffers, aliases=aliases, modes=eval_modes(list(model.modules())))
    if optimizer is None:
        return state
    state.cycling = set(_CYCLING.get(optimizer, ()))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"expected the optimizer (second argument of the step) to be a torch.optim.Optimizer or None, "
            f"got {type(optimizer).__name__}"
        )
    refuse_unsupported_optimizer(optimizer)
    for gi, group in enumerate(optimizer.param_groups):
        names = []
        for pi, p in enumerate(group["params"]):
            name = by_id.get(id(p))
            if name is None:
                raise ValueError(
                    f"optimizer param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is not a parameter "
                    f"of the model; expected every optimized tensor to come from model.parameters(). "
                    f"fix: build the optimizer from model.parameters() of the model passed to the step."
                )
            names.append(name)
            for key, value in optimizer.state.get(p, {}).items():
                state.optim[(name, key)] = value
        state.param_groups.append(names)
        for key, value in group.items():
            if key != "params":
                state.hparams[(gi, key)] = value
    return state


def refuse_unsupported_optimizer(optimizer: Any) -> None:
    """Raise :class:`~spmd_compiler.errors.DataDependentError` for an optimizer whose
    ``step()`` cannot be one program: ``LBFGS`` calls the step's closure (forward and
    backward) again until its line search and its tests on the loss and gradients are met,
    a number of times that depends on tensor values."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise DataDependentError(
            f"{type(optimizer).__name__}.step(closure) evaluates the closure (forward and backward) a number of times "
            "that depends on the loss and gradient values (line search, convergence tests with `if` on tensors), "
            "and one compiled program runs a fixed sequence of ops",
            None,
            "use a first-order optimizer in the compiled step (torch.optim.Adam, SGD, ...), or run the LBFGS "
            "step eagerly, without spmd_compiler.compile",
        )


def _fingerprint(modules: list[torch.nn.Module], optimizer: Any) -> tuple:
    """Identities of everything :func:`collect_state` reads, which parameters require a
    gradient, and the fixed settings."""
    mods = tuple(
        (id(m), tuple(m._modules), tuple(map(id, m._modules.values())), tuple(m._parameters),
         tuple(map(id, m._parameters.values())), tuple(m._buffers), tuple(map(id, m._buffers.values())),
         # freezing or unfreezing between calls (requires_grad_) changes which gradients
         # the step computes and the optimizer applies: part of the call signature
         tuple(p is not None and p.requires_grad for p in m._parameters.values()))
        for m in modules
    )
    if optimizer is None:
        return mods, None
    cycling = _CYCLING.get(optimizer, ())
    groups = tuple(
        (tuple(map(id, g["params"])),
         tuple((k, id(v) if isinstance(v, torch.Tensor) else v) for k, v in g.items()
               if k != "params" and not is_lifted(k, v, g, (i, k) in cycling)))
        for i, g in enumerate(optimizer.param_groups)
    )
    state = tuple((id(p), tuple(st), tuple(map(id, st.values()))) for p, st in optimizer.state.items())
    return mods, groups, state


class StateCache:
    """:func:`collect_state` for a step called again and again on the same model and
    optimizer: the named state is reused while a fingerprint of identities (modules,
    parameters, buffers, optimizer state entries, param groups and their fixed
    settings) is unchanged, about 30x cheaper than collecting it. Lifted settings
    (``lr``) are re-read on every call."""

    def __init__(self) -> None:
        self._refs: tuple[Any, Any] | None = None
        self._modules: list[torch.nn.Module] = []
        self._fp: Any = None
        self.state: ModelState | None = None
        self.value_guards: dict[str, Any] = {}

    def add_value_guards(self, guards: list[Any]) -> None:
        """Remember the value guards of a compiled step: every later call signature
        includes their outcomes."""
        for g in guards:
            self.value_guards.setdefault(g.key, g)

    def get(self, model: torch.nn.Module, optimizer: Any) -> ModelState:
        if self.state is not None and self._refs is not None and self._refs[0]() is model and self._refs[1]() is optimizer:
            if _fingerprint(self._modules, optimizer) == self._fp:
                for g, k in self.state.lifted_hparams():
                    self.state.hparams[(g, k)] = optimizer.param_groups[g][k]
                self.state.value_guards = self.value_guards
                self.state.modes = eval_modes(self._modules)
                return self.state
        state = collect_state(model, optimizer)
        same = self._refs is not None and self._refs[0]() is model and self._refs[1]() is optimizer
        if same and self.state is not None and optimizer is not None and _mark_cycling(self.state, state, optimizer):
            state = collect_state(model, optimizer)
        self._modules = list(model.modules())
        self._fp = _fingerprint(self._modules, optimizer)
        self._refs = (weakref.ref(model), weakref.ref(optimizer) if optimizer is not None else (lambda: None))
        self.state = state
        state.value_guards = self.value_guards
        state.modes = eval_modes(self._modules)
        return state


def eval_modes(modules: list[torch.nn.Module]) -> tuple[int, ...]:
    """The indices of ``modules`` in eval mode (``module.training`` False): part of the call
    signature, since dropout, batch norm and user code branch on it at the trace."""
    return tuple(i for i, m in enumerate(modules) if not m.training)


def _mark_cycling(old: ModelState, new: ModelState, optimizer: Any) -> bool:
    """Mark the fused groups' momentum / betas that changed since the last call (a
    scheduler cycles them) as inputs from now on (:func:`is_lifted`); True if any."""
    changed = {
        (g, k) for (g, k), v in new.hparams.items()
        if k in ("momentum", "betas") and new.hparams.get((g, "fused")) and (g, k) not in new.cycling
        and (g, k) in old.hparams and old.hparams[(g, k)] != v and is_lifted(k, v, {}, True)
    }
    if changed:
        log.info("%s of a fused optimizer change between calls: fed as inputs from now on, with the per-parameter "
                 "update instead of the fused kernel (no recompile per change)", ", ".join(f"param_groups[{g}][{k!r}]" for g, k in sorted(changed)))
        _CYCLING.setdefault(optimizer, set()).update(changed)
    return bool(changed)


@contextlib.contextmanager
def swapped_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: ModelState,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    optim: dict[tuple[str, str], Any],
    hparams: dict[tuple[int, str], Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """Run the body with ``model``/``optimizer`` reading the given tensors instead.

    ``hparams`` maps ``(group index, key)`` to a function returning the value the
    optimizer should read; it is called when ``optimizer.step()`` starts (a step
    pre-hook), so what it traces belongs to the optimizer step.

    Yields a dict ``{"optim_state": callable}``; calling it inside the body returns the
    optimizer state as it is now, keyed by ``(FQN, key)``, including entries the
    optimizer created lazily during the body.
    """
    swapped: dict[str, torch.Tensor] = {**params, **buffers}
    for alias, canonical in state.aliases.items():
        swapped[alias] = params[canonical]
    saved_groups = None
    saved_state = None
    with pt.reparametrize_module(model, swapped):
        if optimizer is not None:
            saved_groups = [g["params"] for g in optimizer.param_groups]
            saved_state = optimizer.state
            new_state: defaultdict = defaultdict(dict)
            for group, names in zip(optimizer.param_groups, state.param_groups):
                group["params"] = [params[n] for n in names]
            for (name, key), value in optim.items():
                new_state[params[name]][key] = value
            optimizer.state = new_state
            saved_hparams = {(g, k): optimizer.param_groups[g][k] for (g, k) in (hparams or {})}
            # every setting as the step should leave it: the step itself must not change them
            expected = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            original = [dict(e) for e in expected]
            written: list[str] = []

            def install(opt: Any, args: Any, kwargs: Any) -> None:
                written.extend(_changed_settings(opt, expected))  # an assignment before optimizer.step()
                for (g, k), make in (hparams or {}).items():
                    opt.param_groups[g][k] = expected[g][k] = make()

            hook = optimizer.register_step_pre_hook(install) if hparams else None

        def current_optim_state() -> dict[tuple[str, str], Any]:
            if optimizer is None:
                return {}
            out: dict[tuple[str, str], Any] = {}
            for names in state.param_groups:
                for n in names:
                    for key, value in optimizer.state.get(params[n], {}).items():
                        out[(n, key)] = value
            return out

        try:
            yield {"optim_state": current_optim_state}
            if optimizer is not None:
                written.extend(_changed_settings(optimizer, expected))
        finally:
            if optimizer is not None:
                for group, ps in zip(optimizer.param_groups, saved_groups):
                    group["params"] = ps
                if hook is not None:
                    hook.remove()
                for (g, k), value in saved_hparams.items():
                    optimizer.param_groups[g][k] = value
                optimizer.state = saved_state
    if optimizer is not None and written:
        for group, before in zip(optimizer.param_groups, original):  # put back what the step assigned
            for k in set(group) - {"params"} - set(before):
                del group[k]
            group.update(before)
        raise HostSettingError(sorted(set(written)), None, "an LR scheduler's step() or an assignment to a param group")


def _changed_settings(optimizer: Any, expected: list[dict[str, Any]]) -> list[str]:
    """The param group settings that differ from ``expected`` (the step assigned them)."""
    out = []
    for g, (group, before) in enumerate(zip(optimizer.param_groups, expected)):
        for k in set(group) - {"params"}:
            old, new = before.get(k, _MISSING), group[k]
            if new is old or _symbolic(new):  # a number read from a tensor: HostSnapshot's (host_values.py)
                continue
            if old is _MISSING or not (_plain(new) and _plain(old)) or new != old:
                out.append(f"optimizer.param_groups[{g}][{k!r}]")
    return out


_MISSING = object()


def _symbolic(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_symbolic(v) for v in value)
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _plain(value: Any) -> bool:
    """A Python value compared by ``!=`` without a graph guard (no tensor, no symbol)."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))
