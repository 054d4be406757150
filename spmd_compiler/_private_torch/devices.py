"""Tracing for a target device: what a trace on ``meta`` must do differently to give the
program the target device runs.

A trace on ``meta`` for a target device type enters :func:`meta_trace_for`: autograd
of composite ops, foreach gradient clipping and SDPA's kernel as that device has them.

Touches ``OpOverload.py_kernels`` and ``OpOverload._dispatch_cache`` (the Python
dispatcher's per-op kernels and their cache) ``torch._decomp.global_decomposition_table`` and ``torch.nn.utils.clip_grad``'s
foreach support checks.
Checked against torch 2.13.0.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch._C import DispatchKey

from .sdpa import run_sdpa, sdpa_choice

__all__ = ["composite_autograd_on_meta", "shadowed_composites", "foreach_on_meta", "sdpa_for_device", "meta_trace_for"]


@functools.lru_cache(maxsize=1)
def shadowed_composites() -> tuple[torch._ops.OpOverload, ...]:
    """The ops whose autograd a trace on ``meta`` loses: a CompositeImplicitAutograd op
    (``aten.nll_loss``, ``aten.dropout``, ``aten.var``...) for which torch registers a
    Python meta kernel. Under make_fx's Python dispatcher that kernel makes the op look
    like a Meta backend op, so the ``AutogradMeta`` key resolves to autograd's
    "not implemented" fallback instead of the decomposition: the output has no
    ``grad_fn``, and ``backward()`` only warns. On CPU and CUDA (no Python kernel) and
    on ``meta`` in eager (the C++ dispatcher knows no such kernel) the op decomposes."""
    from torch._decomp import global_decomposition_table

    ops = set()
    for table in global_decomposition_table.values():
        ops.update(op for op in table if isinstance(op, torch._ops.OpOverload))
    return tuple(sorted(
        (op for op in ops if DispatchKey.Meta in op.py_kernels
         and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")),
        key=str,
    ))


@contextlib.contextmanager
def composite_autograd_on_meta(enabled: bool = True) -> Iterator[None]:
    """While it is open, the ops of :func:`shadowed_composites` have no Python meta
    kernel: a trace on ``meta`` decomposes them before autograd, as CPU and CUDA traces
    do, so their backward is traced. Put back on exit."""
    if not enabled:
        yield
        return
    removed = []
    for op in shadowed_composites():
        kernel = op.py_kernels.pop(DispatchKey.Meta, None)
        if kernel is not None:
            removed.append((op, kernel))
            op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in removed:
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


@contextlib.contextmanager
def foreach_on_meta(enabled: bool = True) -> Iterator[None]:
    """While it is open, ``clip_grad_norm_`` / ``clip_grads_with_norm_`` take ``meta``
    tensors for a device with foreach kernels (CPU and CUDA have them; torch refuses
    ``foreach=True`` on ``meta`` and picks the per-tensor loop for ``foreach=None``), so
    a trace on ``meta`` gives the program the target device runs."""
    if not enabled:
        yield
        return
    from torch.nn.utils import clip_grad

    device_has, has = clip_grad._device_has_foreach_support, clip_grad._has_foreach_support

    def device_has_meta(device: torch.device) -> bool:
        return device.type == "meta" or device_has(device)

    def has_meta(tensors: list, device: torch.device) -> bool:
        return has(tensors, device) or device.type == "meta" and all(t is None or type(t) is torch.Tensor for t in tensors)

    clip_grad._device_has_foreach_support, clip_grad._has_foreach_support = device_has_meta, has_meta
    try:
        yield
    finally:
        clip_grad._device_has_foreach_support, clip_grad._has_foreach_support = device_has, has


_SDPA = "scaled_dot_product_attention"


@contextlib.contextmanager
def sdpa_for_device(device_type: str | None) -> Iterator[None]:
    """While it is open, ``F.scaled_dot_product_attention`` on ``meta`` tensors is traced
    as the kernel ``device_type`` ("cpu" or "cuda") runs for those inputs, not as the
    math decomposition ``meta`` falls back to (which materializes sequence x sequence
    scores no fused kernel holds). See :func:`sdpa_choice`. Other devices: unchanged."""
    if device_type not in ("cpu", "cuda"):
        yield
        return
    op = getattr(torch.ops.aten, _SDPA).default
    composite = op.decompose

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
        choice = sdpa_choice(device_type, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return run_sdpa(choice, device_type, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, composite)

    had = op.py_kernels.get(DispatchKey.AutogradMeta)
    op.py_kernels[DispatchKey.AutogradMeta] = kernel
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        if had is None:
            op.py_kernels.pop(DispatchKey.AutogradMeta, None)
        else:
            op.py_kernels[DispatchKey.AutogradMeta] = had
        op._dispatch_cache.clear()


@contextlib.contextmanager
def meta_trace_for(device_type: str | None, enabled: bool = True) -> Iterator[None]:
    """All of the above, for a trace of ``meta`` tensors (``enabled``) whose program is
    for ``device_type`` ("cpu", "cuda"; None: only what every device has in common:
    autograd of composite ops, foreach clipping)."""
    if not enabled:
        yield
        return
    with composite_autograd_on_meta(), foreach_on_meta(), sdpa_for_device(device_type):
        yield
