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
  the dtype ``as_tensor`` would give it;
* ``dynamic=True`` only: ``cumsum``'s backward without torch's one-row shortcut, and
  ``contiguous()`` without its one-row question (:func:`symbolic_size_rewrites`);
* BatchNorm with ``momentum=None`` (a cumulative average of the batch statistics,
  weighted ``1 / float(num_batches_tracked)`` in Python) computes that weight as a tensor
  and updates its running statistics with the same formula its kernel uses.

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
import torch.nn.functional as F

from .. import _private_torch as pt

__all__ = ["SYM_BUILTIN_MODULES", "traceable_scalars", "symbolic_size_rewrites", "contiguous_copies_written"]

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


_BatchNorm = pt.batchnorm_base()
_bn_forward = _BatchNorm.forward


def _cumulative_bn_forward(self: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``_BatchNorm.forward`` for ``momentum=None`` in training: the batch statistics come
    from ``F.batch_norm`` with momentum 1 on copies of the running buffers, then
    ``running = f * batch + (1 - f) * running`` with ``f = 1 / num_batches_tracked``, the
    kernel's own update, in the buffers' dtype."""
    if self.momentum is not None or not self.training or not self.track_running_stats or self.num_batches_tracked is None:
        return _bn_forward(self, input)
    self._check_input_dim(input)
    self.num_batches_tracked.add_(1)
    batch_mean, batch_var = self.running_mean.clone(), self.running_var.clone()
    out = F.batch_norm(input, batch_mean, batch_var, self.weight, self.bias, True, 1.0, self.eps)
    with torch.no_grad():
        f = 1.0 / self.num_batches_tracked.to(torch.float64)  # Python's 1.0 / float(n)
        for running, batch in ((self.running_mean, batch_mean), (self.running_var, batch_var)):
            running.copy_(batch * f.to(running.dtype) + running * (1 - f).to(running.dtype))
    return out


@contextlib.contextmanager
def traceable_scalars() -> Iterator[None]:
    """Install the symbolic ``max`` / ``min`` / ``torch.as_tensor`` and the BatchNorm
    cumulative average for the trace."""
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
        saved.append((_BatchNorm, "forward", _BatchNorm.__dict__["forward"]))
        _BatchNorm.forward = _cumulative_bn_forward
        yield
    finally:
        for module, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(module, attr)
            else:
                setattr(module, attr, old)


class _CumSum(torch.autograd.Function):
    """``torch.cumsum`` with torch's backward minus its shortcut: ``cumsum_backward``
    returns the gradient itself when the dim has one element (``grad.sym_size(dim) == 1``
    in C++), a guard that fixes a symbolic batch dim to "one row" or "not one row" (a
    second program at the first one-row batch). The reversed cumsum it computes
    otherwise (flip, cumsum, flip) is the same numbers for one row, so it serves both."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, dtype: Any) -> torch.Tensor:
        ctx.dim, ctx.in_dtype = dim, x.dtype
        return torch.cumsum(x, dim, dtype=dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        g = grad.to(ctx.in_dtype)
        return g.flip(ctx.dim).cumsum(ctx.dim).flip(ctx.dim), None, None


class _SymbolicSizesMode(torch.overrides.TorchFunctionMode):
    """``dynamic=True``'s trace-time rewrites of ops whose torch implementation asks a
    question of the batch size that the answer does not depend on:

    * ``cumsum`` (:class:`_CumSum`);
    * ``x.contiguous()`` of a tensor that is contiguous only when the batch has one row
      (``labels[..., 1:]`` of a padded ``(B, T+1)``: torch asks ``Eq(s3, 1)``, a guard
      per answer): a copy (``clone``) unless torch can prove it contiguous for every
      size, the same values. Only the aliasing differs, for one-row batches: the clones
      are listed in ``copies`` and the trace checks that no op writes them or their
      source in place (``check_contiguous_copies``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0  # contiguous() calls answered with a copy

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.contiguous and len(args) == 1 and kwargs.get("memory_format", torch.contiguous_format) is torch.contiguous_format:
            x = args[0]
            if isinstance(x, torch.Tensor) and any(pt.is_symbolic(s) for s in x.shape):
                if pt.definitely_contiguous(x):
                    return x
                self.copies += 1
                return x.clone(memory_format=torch.contiguous_format)
        if func in (torch.cumsum, torch.Tensor.cumsum) and "out" not in kwargs and len(args) >= 1:
            x = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
            if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled() and isinstance(dim, int):
                return _CumSum.apply(x, dim, dtype)
        return func(*args, **kwargs)


def symbolic_size_rewrites(on: bool) -> Any:
    """While tracing with ``dynamic=True``: :class:`_SymbolicSizesMode` (``cumsum`` of a
    tensor that needs a gradient runs through :class:`_CumSum`, whose backward records no
    size guard; ``contiguous()`` copies). ``on=False``: a null context (the per-shape
    trace keeps torch's own code)."""
    return _SymbolicSizesMode() if on else contextlib.nullcontext()


def contiguous_copies_written(mode: Any, gm: Any) -> str | None:
    """Why the ``contiguous()`` copies of :class:`_SymbolicSizesMode` would differ from one
    device (an op writes a copy or its source in place, directly or through a view: for a
    one-row batch one device returns the source itself, so the write would show through),
    or None."""
    if not isinstance(mode, _SymbolicSizesMode) or not mode.copies:
        return None

    written = pt.written_storages(gm.graph)  # owners of storages some op writes, through views
    # the copies' nodes: make_fx keeps a snapshot of each value, so they are found by
    # form (a contiguous clone of a value torch cannot prove contiguous; a user's own such
    # clone counts too, which only costs the symbolic program)
    for node in gm.graph.nodes:
        if node.target is not torch.ops.aten.clone.default or node.kwargs.get("memory_format") is not torch.contiguous_format:
            continue
        source = node.args[0]
        if not hasattr(source, "op") or pt.definitely_contiguous(source.meta["val"]):
            continue
        for n in (source, node):
            if pt.storage_owner(n) in written:
                return f"an op writes in place into {n.name}, a contiguous() of a batch-sized view (one device aliases it for one row)"
    return None
