"""Cheaper user stack traces for make_fx, and cheaper optimizer arithmetic on symbols.

make_fx (``record_stack_traces=True``) captures the whole Python stack at every node it
records (``CapturedTraceback.extract().summary()``: every frame symbolized, its source
line read), about 60 frames deep inside the trace, and then keeps only the frames of
``forward`` methods and of the registered anchors (the training step): a sixth of a
70B step's trace. :func:`fast_stack_traces` walks the live frames instead and builds
only the frames that filter keeps, so ``node.meta["stack_trace"]`` is the same text.

:func:`unchecked_symbolic_pow` drops the ``torch._check(base >= 0)`` that
``SymFloat.__pow__`` records for every symbolic power (Adam's ``bias_correction2 **
0.5``, once per parameter): a deferred runtime assert that no stage of ours reads or
emits (torch inserts those only in export), at about 5 ms of sympy per parameter.

Touches ``torch.fx.proxy.CapturedTraceback`` and ``_STACK_TRACE_ANCHORS`` and
``torch.SymFloat.__pow__``. Checked against torch 2.13.0.
"""

from __future__ import annotations

import builtins
import contextlib
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["fast_stack_traces", "unchecked_symbolic_pow"]


class _LiveFrames:
    """What make_fx's node creation asks of ``CapturedTraceback``: ``extract()`` then
    ``summary()``, here with only the frames its forward-only filter can keep."""

    __slots__ = ("frames",)

    def __init__(self, frames: list[tuple[str, int, str]]) -> None:
        self.frames = frames

    @staticmethod
    def extract(*, script: bool = False, cpp: bool = False, skip: int = 0) -> "_LiveFrames":
        from torch.fx.proxy import _STACK_TRACE_ANCHORS

        keep = []
        f: Any = sys._getframe(1)
        while f is not None:
            code = f.f_code
            name, filename = code.co_name, code.co_filename
            if name == "forward" or filename.endswith("torch/__init__.py") or (filename, name) in _STACK_TRACE_ANCHORS:
                keep.append((filename, f.f_lineno, name))
            f = f.f_back
        keep.reverse()
        return _LiveFrames(keep)

    def summary(self) -> traceback.StackSummary:
        return traceback.StackSummary.from_list([traceback.FrameSummary(fn, line, name) for fn, line, name in self.frames])


@contextlib.contextmanager
def fast_stack_traces() -> Iterator[None]:
    """While it is open, make_fx's forward-only stack traces are captured from the live
    frames (see the module doc); the text recorded is the same."""
    import torch.fx.proxy as proxy

    original = proxy.CapturedTraceback
    proxy.CapturedTraceback = _LiveFrames  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        proxy.CapturedTraceback = original  # type: ignore[misc]


def _pow(self: torch.SymFloat, other: Any) -> Any:
    if not isinstance(other, (builtins.int, builtins.float, torch.SymInt, torch.SymFloat)):
        return NotImplemented
    return self.__float_pow__(other)


@contextlib.contextmanager
def unchecked_symbolic_pow() -> Iterator[None]:
    """While it is open, ``SymFloat ** x`` records no ``base >= 0`` runtime assert."""
    original = torch.SymFloat.__pow__
    torch.SymFloat.__pow__ = _pow  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.SymFloat.__pow__ = original  # type: ignore[method-assign]
