"""Ops decomposed while tracing, before expansion ever sees them.

DTensor's sharding rules for some composite ops are wrong on sharded inputs: on torch
2.13 ``mse_loss_backward`` with a ``Shard(0)`` input and mean reduction gives gradients
world-size times too large, and the mean-reduced pointwise losses give NaN on an uneven
``Shard(0)``. Their decompositions are plain pointwise ops and reductions, whose rules
are sound, so we trace those instead. The table is small on purpose: every entry is an
op whose DTensor rule we distrust; the OpInfo sweep (``benchmarks/op_coverage.py``) is
how new entries are found.
"""

from __future__ import annotations

import torch
from torch._decomp import get_decompositions

__all__ = ["DECOMPOSED_OPS", "decomposition_table"]

aten = torch.ops.aten

DECOMPOSED_OPS = [
    aten.mse_loss,
    aten.mse_loss_backward,
    aten.smooth_l1_loss,
    aten.smooth_l1_loss_backward,
    aten.huber_loss,
    aten.huber_loss_backward,
    aten.soft_margin_loss,
    aten.soft_margin_loss_backward,
    aten.binary_cross_entropy,
    aten.binary_cross_entropy_backward,
    aten.binary_cross_entropy_with_logits,
    aten.l1_loss,
]


def decomposition_table() -> dict:
    """The decomposition table passed to ``make_fx``."""
    return get_decompositions(DECOMPOSED_OPS)
