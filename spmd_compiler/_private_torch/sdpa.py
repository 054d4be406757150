"""Which SDPA kernel a device runs, for a trace on ``meta``.

``F.scaled_dot_product_attention`` is a composite op: at dispatch, each device picks a
fused kernel (``_fused_sdp_choice``) and calls it, and ``meta`` has no choice of its own
(it takes the math decomposition). To trace on ``meta`` the program a CPU or a CUDA
device runs, the choice is made here as that device makes it:

* CPU: torch's own choice function, asked with small CPU tensors of the same dtypes,
  heads, head dims, ``requires_grad``, mask and flags (the CPU checks read nothing else);
  flash (``_scaled_dot_product_flash_attention_for_cpu``) where it applies, math otherwise.
* CUDA (no GPU is needed): the checks of torch's ``sdp_utils.cpp`` for an sm80+ GPU, in
  torch's default priority (flash, memory-efficient, math; cuDNN is last and never
  reached), honouring ``torch.backends.cuda.enable_*_sdp``: flash for float16/bfloat16
  without a mask, head dim <= 256 and a multiple of 8 (torch pads other head dims; those
  are left to the efficient kernel), equal heads; the efficient kernel for those and
  float32, head dim a multiple of 8 (4 for float32), a mask allowed; math otherwise
  (float64, grouped-query ``enable_gqa`` with fewer key/value heads).

Touches ``aten._fused_sdp_choice``, ``torch.utils._python_dispatch._disable_current_modes``, the fused SDPA ops' signatures and
``torch._C._get_*_sdp_enabled``. Checked against torch 2.13.0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["sdpa_choice", "run_sdpa", "MATH", "FLASH", "EFFICIENT"]

MATH, FLASH, EFFICIENT = "math", "flash", "efficient"
_CHOICES = {0: MATH, 1: FLASH, 2: EFFICIENT}  # at::SDPBackend
_EFFICIENT_MASK_ALIGNMENT = 16  # attention.cpp's mem_eff_alignment: the bias rows padded to it


def _tiny(t: torch.Tensor, seq: int = 2) -> torch.Tensor:
    """A small CPU tensor like ``t`` for torch's CPU choice: batch 1, ``seq`` rows."""
    shape = [1] * (t.dim() - 2) + [seq, int(t.shape[-1])]
    if t.dim() >= 3:
        shape[-3] = int(t.shape[-3])  # heads (the GQA check reads them)
    return torch.empty(shape, dtype=t.dtype).requires_grad_(t.requires_grad)


def sdpa_choice(device_type: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> str:
    """"flash", "efficient" or "math": the kernel ``device_type`` runs SDPA with."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return MATH
    if device_type == "cpu":
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # real CPU tensors, asked outside the trace
            m = None if mask is None else torch.empty([1] * (mask.dim() - 2) + [2, 2], dtype=mask.dtype)
            choice = torch.ops.aten._fused_sdp_choice.default(_tiny(q), _tiny(k), _tiny(v), m, dropout_p, is_causal,
                                                             scale=scale, enable_gqa=enable_gqa)
        return _CHOICES.get(int(choice), MATH)
    dtype, e_qk, e_v = q.dtype, int(q.shape[-1]), int(v.shape[-1])
    heads_equal = int(q.shape[1]) == int(k.shape[1]) == int(v.shape[1])
    if not (dtype == k.dtype == v.dtype) or not heads_equal:
        return MATH
    if (torch._C._get_flash_sdp_enabled() and dtype in (torch.float16, torch.bfloat16) and mask is None
            and e_qk == e_v and e_qk <= 256 and e_qk % 8 == 0):
        return FLASH
    align = 4 if dtype == torch.float32 else 8
    if (torch._C._get_mem_efficient_sdp_enabled() and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and e_qk == int(k.shape[-1]) and e_qk % align == 0 and e_v % align == 0):
        return EFFICIENT
    return MATH


def _bool_mask_as_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """torch's ``convert_boolean_attn_mask``, op for op: True keeps (0), False is ``-inf``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    aten = torch.ops.aten
    neg = aten.scalar_tensor.default(-math.inf, dtype=dtype, device=mask.device)
    zero = aten.scalar_tensor.default(0.0, dtype=dtype, layout=torch.strided, device=mask.device)
    return aten.where.self(mask, zero, neg)


def _efficient_bias(bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """torch's ``preprocess_mask``: rows padded to the kernel's alignment (then sliced
    back), expanded to (batch, heads, query, key)."""
    aligned = bias.stride(-1) == 1 and all(s % _EFFICIENT_MASK_ALIGNMENT == 0 for s in bias.stride()[:-1])
    if not aligned:
        last = bias.shape[-1]
        pad = _EFFICIENT_MASK_ALIGNMENT - last % _EFFICIENT_MASK_ALIGNMENT
        bias = torch.nn.functional.pad(bias, (0, pad))[..., :last]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def run_sdpa(choice: str, device_type: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
             composite: Callable[..., Any]) -> torch.Tensor:
    """SDPA's output through the ``choice`` kernel, called as torch's composite calls it
    on ``device_type``; ``composite`` (the math decomposition) for "math"."""
    aten = torch.ops.aten
    if choice == MATH:
        return composite(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    mask = _bool_mask_as_bias(mask, q.dtype)
    if choice == FLASH and device_type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, dropout_p, is_causal, attn_mask=mask,
                                                                          scale=scale)[0]
    if choice == FLASH:
        og_scale = scale if scale is not None else 1.0 / math.sqrt(int(q.shape[-1]))
        return aten._scaled_dot_product_flash_attention.default(q, k, v, dropout_p, is_causal, False, scale=og_scale)[0]
    logsumexp = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    bias = None if mask is None else _efficient_bias(mask, q, k)
    return aten._scaled_dot_product_efficient_attention.default(q, k, v, bias, logsumexp, dropout_p, is_causal,
                                                                scale=scale)[0]
