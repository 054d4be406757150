"""Memory layouts (stride orders) of local values.

A collective returns a contiguous tensor whatever layout the traced value had. Most ops
do not care, but some do: ``view`` refuses a layout it cannot reinterpret, and ops whose
output takes its input's layout (``empty_like`` in SDPA's CPU kernel) pass the change on.
``x.transpose(1, 2).reshape(b, t, d)`` after attention is traced as a ``view`` because the
traced attention output was laid out (batch, seq, heads, dim); computed on a gathered,
contiguous query it is laid out (batch, heads, seq, dim), and the traced ``view`` fails.

:func:`restride_like` gives a local value the stride order the trace saw, so every op
that follows sees the layout it was traced with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from .. import _private_torch as pt
from .builder import SubgraphBuilder

aten = torch.ops.aten

__all__ = ["stride_order", "has_stride_order", "restride_like"]


def stride_order(shape: Sequence[int], stride: Sequence[int]) -> list[int] | None:
    """Dims from outermost to innermost for a dense, non-overlapping layout (``None``
    when the layout is not dense: expanded, overlapping or with gaps)."""
    shape = [pt.size_hint(s) for s in shape]
    stride = [pt.size_hint(s) for s in stride]
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    expect = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expect:
            return None
        expect *= shape[d]
    return order


def has_stride_order(t: torch.Tensor, order: Sequence[int]) -> bool:
    """True when ``t`` is laid out densely with dims nested as ``order`` (size-1 dims,
    whose strides are arbitrary, excepted)."""
    expect = 1
    for d in reversed(list(order)):  # symbolic sizes (dynamic=True): "not proven" counts as differing
        if pt.true_unless_proven_false(t.shape[d] != 1) and pt.true_unless_proven_false(t.stride(d) != expect):
            return False
        expect *= t.shape[d]
    return True


def restride_like(b: SubgraphBuilder, x: fx.Node, traced_shape: Sequence[int], traced_stride: Sequence[int]) -> fx.Node:
    """``x`` laid out in the stride order of a traced value of ``traced_shape`` /
    ``traced_stride`` (a copy only when the order differs; no-op for contiguous traces)."""
    val = x.meta.get("val")
    order = stride_order(traced_shape, traced_stride)
    if not isinstance(val, torch.Tensor) or order is None or val.dim() != len(order) or has_stride_order(val, order):
        return x
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    dense = b.call(aten.clone.default, b.call(aten.permute.default, x, list(order)), memory_format=torch.contiguous_format)
    out = b.call(aten.permute.default, dense, inverse)
    out.meta["spmd_layout"] = f"restrided to the traced stride order {order}"
    return out
