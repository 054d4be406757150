"""Mixed precision in FSDP2's sense: parameters computed with (and gathered) in a narrow
dtype, gradients reduced in the parameters' own.

``compile(..., mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))`` traces
the step with every floating parameter cast to ``param_dtype`` while the model's forward
runs (the modules read the casts; outside the forward, ``model.parameters()`` are the
float32 parameters, which the optimizer updates and whose ``.grad`` is the cast's gradient
cast back, so ``clip_grad_norm_(model.parameters())`` sees them, as under FSDP2). Under an FSDP plan the cast is made on the shard, so each gather
carries ``param_dtype`` (half the bytes for bfloat16, ``expand/fsdp.py``). Floating tensors passed
to the model's ``forward`` are cast too (FSDP2's ``cast_forward_inputs=True``); under
``torch.autocast`` alone the same holds for the weights autocast casts. The gradient is
reduced after the cast back, in the parameters' dtype: ``reduce_dtype=torch.float32``
for float32 parameters, FSDP2's recommended setting (its default, reducing in
``param_dtype``, is not offered: the reduction would have to move before the cast).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Attributes:
        param_dtype: the dtype forward and backward compute with (None: the parameters' own).
        reduce_dtype: the dtype gradients are reduced in; must be the parameters' own dtype
            (float32, the default; None means the same), checked when the step is traced.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, torch.dtype) and v.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy({name}={v!r}): expected a floating torch.dtype such as "
                                 f"torch.bfloat16, or None")

    def check(self, params: dict[str, torch.Tensor]) -> None:
        """ValueError unless every floating parameter's dtype is ``reduce_dtype`` (or None)."""
        if self.reduce_dtype is None:
            return
        other = [f"{n} ({p.dtype})" for n, p in params.items() if p.is_floating_point() and p.dtype != self.reduce_dtype]
        if other:
            raise ValueError(
                f"MixedPrecisionPolicy(reduce_dtype={self.reduce_dtype}) reduces gradients in the parameters' own dtype, "
                f"but {len(other)} parameter(s) are not {self.reduce_dtype}: {', '.join(other[:3])}; fix: "
                f"reduce_dtype=None (each parameter's own dtype) or {self.reduce_dtype} parameters")

    def cast_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A forward pre-hook's result: floating tensors among ``forward``'s arguments cast."""
        from torch.utils import _pytree as pytree

        dtype = self.param_dtype

        def cast(x: object) -> object:
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

        return pytree.tree_map(cast, (args, kwargs)) if dtype is not None else (args, kwargs)

    def cast(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the modules read: each floating parameter cast to ``param_dtype``."""
        dtype = self.param_dtype
        if dtype is None:
            return dict(params)
        return {n: p.to(dtype) if p.is_floating_point() and p.dtype != dtype else p for n, p in params.items()}
