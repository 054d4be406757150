"""What a trace makes: :class:`TracedStep`, its graph's inputs and outputs by name, and
the flattening of the step's batch into named leaves (``batch[1]['ids']``) that the
tracer and the later stages share (:func:`flatten_batch`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .state import ModelState
from .value_guards import ValueGuard

__all__ = ["GraphInput", "GraphOutput", "TracedStep", "flatten_batch", "CONSTANT_LEAF_TYPES"]

CONSTANT_LEAF_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class GraphInput:
    """What a placeholder of the traced graph holds.

    ``kind`` is ``"param"``, ``"buffer"``, ``"optim"`` (optimizer state of parameter
    ``name`` under ``key``), ``"grad"`` (the ``.grad`` parameter ``name`` holds when the
    step is called: gradients accumulated by earlier calls), ``"hparam"`` (setting ``key`` of optimizer param group
    ``name``, e.g. ``param_groups[0]`` / ``lr``) or ``"batch"`` (leaf ``index`` of the flattened batch,
    ``name`` is its path such as ``batch[0]`` or ``batch[1]['ids']``). Shapes are global.
    """

    kind: str
    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    key: str | None = None
    index: int | None = None
    requires_grad: bool = False
    device: torch.device | None = None  # where the value lives (None: torch's default device)

    @property
    def label(self) -> str:
        if self.kind == "grad":
            return f"{self.name}.grad"
        return f"{self.name}[{self.key!r}]" if self.kind in ("optim", "hparam") else self.name


@dataclass(frozen=True)
class GraphOutput:
    """What an output of the traced graph is: a leaf of the step's return value
    (``kind="user"``, ``index`` into its flattened leaves) or updated state."""

    kind: str
    name: str = ""
    key: str | None = None
    index: int | None = None


@dataclass
class TracedStep:
    """A training step traced to one fx graph, with its inputs and outputs named.

    Attributes:
        gm: the traced graph (aten ops, symbolic sizes).
        inputs: one :class:`GraphInput` per placeholder, in order.
        outputs: one :class:`GraphOutput` per graph output, in order.
        user_spec: pytree spec of the step's return value; its tensor leaves are the
            ``user`` outputs, other leaves are in ``user_constants``.
        batch_spec: pytree spec of the batch ``(args, kwargs)``; ``batch_constants``
            holds its non-tensor leaves by leaf index.
        state: names of parameters, buffers and optimizer state.
        new_optim_keys: optimizer state entries the step created (lazy init).
        grads_in: parameters whose ``.grad`` was set when the step was traced (``grad``
            inputs; a call with other gradients set is another program).
        grads_left: parameters whose ``.grad`` the step leaves set (not None): their
            gradients are outputs (or written back into the ``grad`` inputs), and every
            other parameter's ``.grad`` is None after the call.
        trace_seconds: wall time of ``make_fx``.
    """

    gm: fx.GraphModule
    inputs: list[GraphInput]
    outputs: list[GraphOutput]
    user_spec: pytree.TreeSpec
    user_constants: dict[int, Any]
    batch_spec: pytree.TreeSpec
    batch_constants: dict[int, Any]
    state: ModelState
    new_optim_keys: list[tuple[str, str]] = field(default_factory=list)
    grads_in: tuple[str, ...] = ()
    grads_left: tuple[str, ...] = ()
    trace_seconds: float = 0.0
    model: Any = None
    value_guards: list[ValueGuard] = field(default_factory=list)  # optimizer branches on host scalars
    host_numbers: dict[int, type] = field(default_factory=dict)  # user leaves returned as Python numbers
    # outputs past the user leaves: numbers the step stored on the model / optimizer, by (owner, attribute)
    host_attributes: dict[int, tuple[str, str]] = field(default_factory=dict)
    # model.train() / model.eval() in the step: (index in model.modules(), mode) it leaves, set again after every call
    mode_writes: tuple[tuple[int, bool], ...] = ()

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    def input_by_name(self, kind: str, name: str, key: str | None = None) -> int:
        for i, inp in enumerate(self.inputs):
            if inp.kind == kind and inp.name == name and inp.key == key:
                return i
        raise KeyError((kind, name, key))


def flatten_batch(batch: tuple, kwargs: dict) -> tuple[list[Any], pytree.TreeSpec, list[str]]:
    leaves_with_path, spec = pytree.tree_flatten_with_path((batch, kwargs))
    leaves, paths = [], []
    for path, leaf in leaves_with_path:
        text = _path_text(path)
        if not isinstance(leaf, torch.Tensor) and not isinstance(leaf, CONSTANT_LEAF_TYPES):
            raise TypeError(
                f"batch argument {text} is a {type(leaf).__name__}; expected a tensor, a pytree "
                f"(tuple/list/dict) of tensors, or a Python scalar. fix: convert it to a tensor or "
                f"pass it through a closure instead of the step's arguments."
            )
        leaves.append(leaf)
        paths.append(text)
    return leaves, spec, paths


def _path_text(path: tuple) -> str:
    """``((0, 1), ...)`` pytree key path -> ``batch[1]['ids']``."""
    parts = list(path)
    head = parts.pop(0) if parts else None
    is_kw = getattr(head, "idx", 0) == 1
    text = "kwargs" if is_kw else "batch"
    for k in parts:
        text += k.__str__() if hasattr(k, "__str__") else f"[{k}]"
    return text
