"""Reference kernels for float64 comparisons where torch's CPU kernel has no float64.

``torch._grouped_mm`` (the experts of Hugging Face and torchtitan MoE layers) runs
float32, bfloat16 and float16 on the CPU. A float64 comparison with one device (the
only one that tells a real difference from rounding) needs it in float64 on both sides:
:func:`float64_grouped_mm` replaces its CPU kernel, while open, with a loop of ``mm``
over the groups (the same arithmetic for every dtype). Autograd is torch's own: the
backward calls ``_grouped_mm`` again, so it runs here too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

__all__ = ["float64_grouped_mm", "grouped_mm_reference"]


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs)`` as a loop of matmuls (any dtype)."""
    if bias is not None:
        raise NotImplementedError("_grouped_mm with a bias")
    dtype = out_dtype or a.dtype
    if offs is None:  # 3-D x 3-D: a batched matmul
        return torch.bmm(a, b).to(dtype)
    ends = [int(e) for e in offs.tolist()]
    starts = [0] + ends[:-1]
    if a.dim() == 2 and b.dim() == 3:  # rows grouped: (rows, k) x (groups, k, n)
        out = a.new_zeros(a.size(0), b.size(-1), dtype=dtype)
        for g, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                out[s:e] = a[s:e] @ b[g]
        return out
    if a.dim() == 2 and b.dim() == 2:  # contraction grouped: (m, rows) x (rows, n)
        out = a.new_zeros(len(ends), a.size(0), b.size(1), dtype=dtype)
        for g, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                out[g] = a[:, s:e] @ b[s:e]
        return out
    if a.dim() == 3 and b.dim() == 2:  # (groups, m, k) x (k, cols): columns grouped
        out = a.new_zeros(a.size(1), b.size(1), dtype=dtype)
        for g, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                out[:, s:e] = a[g] @ b[:, s:e]
        return out
    raise NotImplementedError(f"_grouped_mm of {a.dim()}-D x {b.dim()}-D with offs")


@contextlib.contextmanager
def float64_grouped_mm() -> Iterator[None]:
    """While open, ``torch._grouped_mm`` on the CPU is :func:`grouped_mm_reference`."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib.impl("_grouped_mm", grouped_mm_reference, "CPU")
    try:
        yield
    finally:
        lib._destroy()
