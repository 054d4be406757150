"""Marker ops that survive tracing and mark places in the step.

``torch.ops.spmd_compiler.marker(tag)`` is a no-op with a side effect, so ``make_fx``
records it and dead-code elimination keeps it. The tracer inserts ``"backward"`` before
``loss.backward()`` and ``"optimizer"`` / ``"optimizer_end"`` around
``optimizer.step()``; after tracing, each node is tagged with its phase
(``node.meta["spmd_phase"]``: forward, backward, optimizer) and the markers are removed.
Users place ``pipe_split`` markers (``tag="pipe_split"``) for pipeline stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import has_side_effect

__all__ = ["marker", "MARKER", "phase_markers", "tag_phases", "PHASES"]

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


@contextlib.contextmanager
def phase_markers(optimizer: Any) -> Iterator[None]:
    """While tracing: mark the start of backward and the optimizer step."""
    orig_backward = torch.Tensor.backward
    orig_autograd_backward = torch.autograd.backward

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        marker("backward")
        return orig_backward(self, *args, **kwargs)

    def autograd_backward(*args: Any, **kwargs: Any) -> Any:
        marker("backward")
        return orig_autograd_backward(*args, **kwargs)

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    torch.autograd.backward = autograd_backward  # type: ignore[assignment]
    patched_step = False
    if optimizer is not None:
        orig_step = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            marker("optimizer")
            out = orig_step(*args, **kwargs)
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
            del optimizer.step


def tag_phases(gm: fx.GraphModule) -> None:
    """Set ``node.meta["spmd_phase"]`` from the phase markers and erase them.

    Nodes after ``optimizer_end`` (``zero_grad``, user code after the step) count as
    ``optimizer``; the output node (and what rebuild adds for it, such as reducing a
    Partial loss) is ``output``. Other markers (pipe_split) are left in place.
    """
    phase = "forward"
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is MARKER and node.args[0] in ("backward", "optimizer", "optimizer_end"):
            tag = node.args[0]
            phase = {"backward": "backward", "optimizer": "optimizer", "optimizer_end": "optimizer"}[tag]
            gm.graph.erase_node(node)
            continue
        node.meta["spmd_phase"] = "output" if node.op == "output" else phase
