"""Marker ops that survive tracing and mark places in the step.

``torch.ops.spmd_compiler.marker(tag)`` is a no-op with a side effect, so ``make_fx``
records it and dead-code elimination keeps it. The tracer inserts ``"backward"`` before
``loss.backward()`` and ``"optimizer"`` / ``"optimizer_end"`` around
``optimizer.step()``; after tracing, each node is tagged with its phase
(``node.meta["spmd_phase"]``: forward, backward, optimizer) and the markers are removed.
Users place ``pipe_split`` markers (``tag="pipe_split"``) for pipeline stages.
While the step is traced, an LR scheduler's ``step()`` raises
(:func:`refuse_scheduler_steps`): inside the step it would run once, at the trace.

Activation checkpointing (``torch.utils.checkpoint``): a checkpointed region's forward is
bracketed by ``checkpoint:<i>`` / ``checkpoint_end:<i>`` markers, and its recomputation in
backward by ``recompute:<i>`` / ``recompute_end:<i>`` (:func:`recompute_markers`). The
nodes of the forward get ``node.meta[CHECKPOINTED] = i``, those of the recomputation
``node.meta[RECOMPUTE] = i``; the latter keep it through expansion, so passes can tell a
recomputation from the forward it repeats (they must not merge them).
"""

from __future__ import annotations

import contextlib
import enum
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import has_side_effect

from ..errors import HostSettingError, IncompleteStepError, user_frame_here

__all__ = ["marker", "MARKER", "phase_markers", "tag_phases", "PHASES", "pipe_split", "SplitPoint", "split_point_hooks", "PIPE_SPLIT",
           "refuse_scheduler_steps", "recompute_markers", "RECOMPUTE", "CHECKPOINTED"]

_lib = torch.library.Library("spmd_compiler", "DEF")
_lib.define("marker(str tag) -> ()")


def _marker_impl(tag: str) -> None:
    return None


_lib.impl("marker", _marker_impl, "CompositeExplicitAutograd")
_lib.impl("marker", _marker_impl, "Meta")
MARKER = torch.ops.spmd_compiler.marker.default
has_side_effect(MARKER)

PHASES = ("forward", "backward", "optimizer", "output")


def marker(tag: str) -> None:
    """Record ``tag`` at this point of the traced step (a no-op when run eagerly)."""
    MARKER(tag)


PIPE_SPLIT = "pipe_split"
# node.meta keys: the checkpointed region (an int) whose recomputation in backward computed
# the node / whose forward computed it
RECOMPUTE = "spmd_recompute"
CHECKPOINTED = "spmd_checkpointed"
_REGION_TAGS = {"checkpoint": CHECKPOINTED, "recompute": RECOMPUTE}


@contextlib.contextmanager
def recompute_markers() -> Iterator[None]:
    """While tracing: mark each checkpointed region's forward and recomputation (see module doc)."""
    from .. import _private_torch as pt

    with pt.marked_checkpoints(lambda what, i: marker(f"{what}:{i}")):
        yield


def pipe_split() -> None:
    """Mark a pipeline stage boundary inside ``forward``.

    Everything the forward computes after this call belongs to the next stage. A no-op
    when the model runs eagerly or when the step is compiled without a pipeline.
    """
    marker(PIPE_SPLIT)


class SplitPoint(enum.Enum):
    """Where a split spec cuts relative to a module: before its forward or after it."""

    BEGINNING = "beginning"
    END = "end"


@contextlib.contextmanager
def split_point_hooks(model: torch.nn.Module, split_points: dict[str, SplitPoint] | None) -> Iterator[None]:
    """While tracing: a ``pipe_split`` at the beginning or end of each named module."""
    handles = []
    for fqn, where in (split_points or {}).items():
        mod = model.get_submodule(fqn)
        if where is SplitPoint.BEGINNING:
            handles.append(mod.register_forward_pre_hook(lambda m, a: pipe_split()))
        else:
            handles.append(mod.register_forward_hook(lambda m, a, o: pipe_split()))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def phase_markers(optimizer: Any) -> Iterator[None]:
    """While tracing: mark the start of backward and the optimizer step."""
    orig_backward = torch.Tensor.backward
    orig_autograd_backward = torch.autograd.backward

    from .. import _private_torch as pt

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        marker("backward")
        pt.link_backward_to_forward(self)
        out = _with_autograd_checked(lambda: orig_backward(self, *args, **kwargs))
        marker("backward_end")
        return out

    def autograd_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        marker("backward")
        for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
            if isinstance(t, torch.Tensor):
                pt.link_backward_to_forward(t)
        out = _with_autograd_checked(lambda: orig_autograd_backward(tensors, *args, **kwargs))
        marker("backward_end")
        return out

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    torch.autograd.backward = autograd_backward  # type: ignore[assignment]
    patched_step = False
    if optimizer is not None:
        orig_step = optimizer.step
        # an LR scheduler wraps optimizer.step on the instance: put that wrapper back after
        had_own_step = "step" in vars(optimizer)

        def step(*args: Any, **kwargs: Any) -> Any:
            marker("optimizer")
            out = orig_step(*args, **kwargs)
            _check_some_gradient(optimizer)
            marker("optimizer_end")
            return out

        optimizer.step = step
        patched_step = True
    try:
        yield
    finally:
        torch.Tensor.backward = orig_backward  # type: ignore[method-assign]
        torch.autograd.backward = orig_autograd_backward  # type: ignore[assignment]
        if patched_step:
            if had_own_step:
                optimizer.step = orig_step
            else:
                del optimizer.step


# torch's autograd fallback for an op with no autograd kernel: backward() goes on without
# that op's gradient and only warns (autograd_not_implemented_fallback.cpp)
_NO_AUTOGRAD = re.compile(r"^(\S+): an autograd kernel was not registered to the Autograd key")


def _with_autograd_checked(run: Callable[[], Any]) -> Any:
    """Run a traced ``backward()``; raise :class:`IncompleteStepError` naming the ops
    whose gradient it skipped (torch warns and leaves their inputs without one). Other
    warnings are issued again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run()
    missing = []
    for w in caught:
        m = _NO_AUTOGRAD.match(str(w.message))
        if m:
            missing.append(m.group(1))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if missing:
        ops = ", ".join(dict.fromkeys(missing))
        raise IncompleteStepError(
            f"backward() went through {ops}, which has no autograd kernel here (torch skips its gradient and only warns), "
            "so every gradient behind it would be missing and the compiled step would not train",
            user_frame_here(),
            "register an autograd formula for the op (torch.library.register_autograd), or trace on a device where it "
            "has one (a custom op's Meta kernel alone gives no backward)",
        )
    return out


def _check_some_gradient(optimizer: Any) -> None:
    """After a traced ``optimizer.step()``: some parameter it updates has a gradient,
    or raise :class:`IncompleteStepError` (a step that updates nothing)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if params and all(getattr(p, "grad", None) is None for p in params):
        raise IncompleteStepError(
            f"optimizer.step() found no gradient on any of its {len(params)} parameters, so it would update nothing "
            "(backward() was not called before it, or the loss does not depend on the parameters)",
            user_frame_here(),
            "call loss.backward() before optimizer.step() in the step, on a loss computed from the model's parameters",
        )


def tag_phases(gm: fx.GraphModule) -> None:
    """Set ``node.meta["spmd_phase"]`` from the phase markers and erase them.

    ``backward`` holds what autograd computes inside ``loss.backward()``; user code on
    the gradients before the step (gradient clipping) and after it (``zero_grad``) counts
    as ``optimizer``: it runs once per step even when the batch is split into
    micro-batches. A step with several ``backward()`` calls (gradient accumulation
    within the step) computes the next micro-batch's forward between them: what lies
    between one backward's end and the next backward is ``forward``. The output node
    (and what rebuild adds for it, such as reducing a Partial loss) is ``output``.
    Nodes between ``checkpoint:<i>`` and ``checkpoint_end:<i>`` markers get
    ``meta[CHECKPOINTED] = i``, between ``recompute:<i>`` and ``recompute_end:<i>``
    ``meta[RECOMPUTE] = i`` (the innermost region of each kind: a region checkpointed
    inside another's recomputation is both); those markers are erased too.
    Other markers (pipe_split) are left in place.
    """
    phase = "forward"
    tags = {"backward": "backward", "backward_end": "optimizer", "optimizer": "optimizer", "optimizer_end": "optimizer"}
    since_backward: list[fx.Node] = []  # optimizer-phase nodes since the last marker
    regions: list[tuple[str, int]] = []  # (meta key, region) the node is in, innermost last
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is MARKER and node.args[0].split(":")[0].removesuffix("_end") in _REGION_TAGS:
            tag, _, region = node.args[0].partition(":")
            entry = (_REGION_TAGS[tag.removesuffix("_end")], int(region))
            if not tag.endswith("_end"):
                regions.append(entry)
            elif entry in regions:
                regions.remove(entry)
            gm.graph.erase_node(node)
            continue
        if regions and node.op == "call_function":
            for key, region in regions:  # the innermost region of each kind is written last
                node.meta[key] = region
        if node.op == "call_function" and node.target is MARKER and node.args[0] in tags:
            tag = node.args[0]
            if tag == "backward":
                for n in since_backward:  # the next micro-batch's forward
                    n.meta["spmd_phase"] = "forward"
            since_backward = []
            phase = tags[tag]
            gm.graph.erase_node(node)
            continue
        node.meta["spmd_phase"] = "output" if node.op == "output" else phase
        if phase == "optimizer":
            since_backward.append(node)


def _scheduler_classes() -> list[type]:
    """LRScheduler and every subclass (torch's and the user's) that defines its own step()."""
    base = torch.optim.lr_scheduler.LRScheduler
    out, todo = [], [base]
    while todo:
        cls = todo.pop()
        if "step" in vars(cls):
            out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


@contextlib.contextmanager
def refuse_scheduler_steps() -> Iterator[None]:
    """While the step is traced, an LR scheduler's ``step()`` raises
    :class:`~spmd_compiler.errors.HostSettingError` naming the user's line: it is Python
    that would run once, at the trace, and never again (trace/state.py's
    ``swapped_state`` catches any other change of a param group setting)."""
    patched = [(cls, vars(cls)["step"]) for cls in _scheduler_classes()]

    def step(self: Any, *args: Any, **kwargs: Any) -> None:
        raise HostSettingError(["the optimizer's learning rate (param_groups[*]['lr'])"], user_frame_here(),
                               f"{type(self).__name__}.step() inside the step")

    for cls, _ in patched:
        cls.step = step  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, original in patched:
            cls.step = original  # type: ignore[method-assign]
