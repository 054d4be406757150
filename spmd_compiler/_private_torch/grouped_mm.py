"""``torch._grouped_mm`` (mixture-of-experts layers) on fake tensors.

torch's meta kernel for ``aten._grouped_mm`` implements the CUDA kernel's checks: bfloat16
inputs and 16-byte aligned strides. The CPU kernel runs float32, bfloat16 and float16 of
any stride, so a float32 MoE model that trains on the CPU could not be traced: make_fx
stopped at ``Expected inputs of BF16 type`` inside torch, not the user's model. On CPU
fake tensors, :func:`grouped_mm_fake` gives the result's shape and dtype as the CPU
kernel does; on any other device torch's own meta kernel decides, and
:func:`explain_grouped_mm_error` turns its refusal into a message with the fix.

Layouts (``offs`` holds each group's end row, cumulative, int32):

* 2-D ``a`` (rows, k) x 3-D ``b`` (groups, k, n) -> (rows, n): the rows of group ``g``
  times ``b[g]`` (the experts' forward);
* 2-D x 2-D ``a`` (m, rows) x ``b`` (rows, n) -> (groups, m, n): each group's rows
  contracted (the experts' weight gradient);
* 3-D x 2-D -> (m, n) and 3-D x 3-D (a batched matmul, no ``offs``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses import fake_impls

__all__ = ["grouped_mm_out_shape", "explain_grouped_mm_error", "GROUPED_MM"]

GROUPED_MM = torch.ops.aten._grouped_mm.default


def grouped_mm_out_shape(a: Any, b: Any, offs: Any) -> list[Any]:
    """The result shape of ``_grouped_mm(a, b, offs)`` (sizes may be symbolic)."""
    if a.dim() == 2 and b.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)]
    if a.dim() == 2:
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        return [a.size(1), b.size(1)]
    return [a.size(0), a.size(1), b.size(-1)]


def _is_grouped_mm(func: Any) -> bool:
    return func is GROUPED_MM


def _fake_grouped_mm(mode: Any, func: Any, a: Any, b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
    tensors = [t for t in (a, b, offs, bias) if isinstance(t, torch.Tensor)]
    if any(t.device.type != "cpu" for t in tensors):
        return NotImplemented  # torch's meta kernel: the CUDA kernel's checks
    torch._check(a.dim() in (2, 3) and b.dim() in (2, 3), lambda: f"_grouped_mm multiplies 2-D or 3-D tensors, got {a.dim()}-D and {b.dim()}-D")
    torch._check(a.dtype == b.dtype, lambda: f"_grouped_mm needs one dtype, got {a.dtype} and {b.dtype}")
    if (a.dim() == 2 or b.dim() == 2):
        torch._check(offs is not None, lambda: "_grouped_mm of a 2-D multiplicand needs offs")
    with mode:
        return torch.empty(grouped_mm_out_shape(a, b, offs), dtype=out_dtype or a.dtype, device=a.device)


def explain_grouped_mm_error(error: BaseException) -> str | None:
    """A fix for torch's meta-kernel refusal of ``_grouped_mm`` (``error``), or None."""
    text = str(error)
    if "Expected inputs of BF16 type" in text or "stride along" in text and "multiple of 16 bytes" in text:
        return (
            "torch._grouped_mm (the experts' grouped matmul) on CUDA takes bfloat16 inputs with 16-byte aligned rows; "
            "the trace (not your model) stopped at torch's shape check for it. fix: run the experts in bfloat16 "
            "(torch.autocast('cuda', torch.bfloat16) around the step, or cast the expert weights and inputs), or pick a "
            "batched-matmul experts implementation (Hugging Face: experts_implementation='batched_mm')"
        )
    return None


if not any(check is _is_grouped_mm for check, _ in fake_impls.op_implementations_checks):
    fake_impls.op_implementations_checks.append((_is_grouped_mm, _fake_grouped_mm))
