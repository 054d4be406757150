"""Trace-time replacements that keep torch's own Python code traceable as it is.

Some optimizers compute with numbers read from tensors (``.item()``) using Python
builtins that must know the number: ``max(eps2, param.norm().item() / n)`` in Adafactor,
``max(1, step - t0)`` in ASGD, ``torch.as_tensor(lr / ...)`` of such a number. During
the trace these numbers are symbols; the builtins would compare or convert them and fail
(or fix the traced step to one value). While tracing we give them symbolic versions that
compute the same thing when the compiled step runs:

* ``max`` / ``min`` of two numbers, one symbolic, in the modules of
  :data:`SYM_BUILTIN_MODULES`, become ``torch.sym_max`` / ``torch.sym_min`` (a graph node
  that runs Python's ``max`` on the real numbers);
* ``torch.as_tensor(number)`` of a symbolic number becomes ``torch.scalar_tensor`` with
  the dtype ``as_tensor`` would give it.

Each is the same arithmetic as on one device (Python floats in float64), only deferred
to when the step runs. Add a module to :data:`SYM_BUILTIN_MODULES` when another
optimizer calls ``max`` / ``min`` on such numbers.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SYM_BUILTIN_MODULES", "traceable_scalars"]

SYM_BUILTIN_MODULES = ("torch.optim._adafactor", "torch.optim.asgd", "torch.optim.radam")

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
_MISSING = object()


def _sym_max(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 2 and not kwargs and any(isinstance(a, _SYM) for a in args):
        return torch.sym_max(*_same_kind(*args))
    return builtins.max(*args, **kwargs)


def _sym_min(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 2 and not kwargs and any(isinstance(a, _SYM) for a in args):
        return torch.sym_min(*_same_kind(*args))
    return builtins.min(*args, **kwargs)


def _same_kind(a: Any, b: Any) -> tuple[Any, Any]:
    """``sym_max(1, x)`` of an int and a float: both floats (Python's max would return
    the int 1, equal to 1.0 in any arithmetic that follows)."""
    floats = any(isinstance(v, (float, torch.SymFloat)) for v in (a, b))
    return (torch.sym_float(a), torch.sym_float(b)) if floats else (a, b)


_as_tensor = torch.as_tensor


def _sym_as_tensor(data: Any, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
    if isinstance(data, _SYM):
        if dtype is None:
            dtype = {torch.SymFloat: torch.get_default_dtype(), torch.SymInt: torch.int64, torch.SymBool: torch.bool}[type(data)]
        return torch.scalar_tensor(data, dtype=dtype, device=device)
    return _as_tensor(data, dtype=dtype, device=device)


@contextlib.contextmanager
def traceable_scalars() -> Iterator[None]:
    """Install the symbolic ``max`` / ``min`` / ``torch.as_tensor`` for the trace."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for name in SYM_BUILTIN_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:  # an older or newer torch without it
                continue
            for attr, fn in (("max", _sym_max), ("min", _sym_min)):
                saved.append((module, attr, module.__dict__.get(attr, _MISSING)))
                setattr(module, attr, fn)
        saved.append((torch, "as_tensor", torch.as_tensor))
        torch.as_tensor = _sym_as_tensor
        yield
    finally:
        for module, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(module, attr)
            else:
                setattr(module, attr, old)
