"""Trace-time rewrites (trace/rewrites.py): BatchNorm(momentum=None)'s cumulative average
``1 / float(num_batches_tracked)`` is traced as tensor math and trains as on one device.
(The symbolic ``max`` / ``as_tensor`` of Adafactor and ASGD are tested with the optimizers
in test_trace_value_guards.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import mse_train_step
from spmd_compiler.trace.rewrites import traceable_scalars


def _batches(n, rows=8):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, 16, generator=g, dtype=torch.float64), torch.randn(rows, 16, generator=g, dtype=torch.float64)) for _ in range(n)]


class _Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16, momentum=None)  # cumulative average of the batch statistics
        self.l2 = nn.Linear(16, 16)

    def forward(self, x):
        return self.l2(self.bn(self.l1(x)))


BN_PLANS = {
    "dp": (lambda: sc.Plan(), ["batch[0]"]),
    "fsdp": (lambda: sc.Plan(params={"l*.weight": [Shard(0)]}, default_input=[Shard(0)], fsdp_axes=(0,)),
             ["batch[0]", "l1.weight", "l2.weight"]),
}


@pytest.mark.parametrize("plan_name", ["dp", "fsdp"])
def test_batchnorm_cumulative_average_trains_as_on_one_device(plan_name):
    model = _Norm().double()
    make_plan, sharded = BN_PLANS[plan_name]
    try:
        res = assert_training_matches(mse_train_step, model, lambda p: torch.optim.SGD(p, lr=0.1), _batches(3),
                                      fake_mesh((2,), ("dp",)), make_plan())
    finally:
        dist.destroy_process_group()
    assert_distributed(res, sharded=sharded)
    assert res.sim.compiles == 1  # num_batches_tracked is an input, not a constant of the program
    assert res.sim.model.bn.num_batches_tracked.item() == 3




def test_rewrites_are_undone_after_the_trace():
    before = (torch.as_tensor, nn.BatchNorm1d.forward, torch.optim._adafactor.__dict__.get("max"))
    with traceable_scalars():
        assert torch.as_tensor is not before[0] and torch.optim._adafactor.max is not max
    assert (torch.as_tensor, nn.BatchNorm1d.forward, torch.optim._adafactor.__dict__.get("max")) == before
