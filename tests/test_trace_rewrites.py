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


# ------------------------------------------------------------- dynamic=True: contiguous()

def _shift_step(write: bool):
    def step(model, optimizer, x, y):
        h = model(x)
        shifted = torch.nn.functional.pad(h, (0, 1))[..., 1:].contiguous()  # contiguous only for one row
        if write:
            shifted.mul_(2)  # in place into the copy: for one row, one device writes the padded tensor
        loss = ((shifted - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def _rows(sizes):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(b, 16, generator=g, dtype=torch.float64), torch.randn(b, 16, generator=g, dtype=torch.float64)) for b in sizes]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_contiguous_of_a_batch_view_keeps_one_program_for_one_row(caplog):
    """``x[..., 1:].contiguous()`` asks whether the batch has one row (a guard per
    answer: a second program at the first one-row batch). Traced with dynamic=True it is
    a copy for every size, the same values; one program serves 8, 5, 1, 3 rows."""
    import logging

    caplog.set_level(logging.INFO, logger="spmd_compiler.driver.dynamic")
    model = nn.Linear(16, 16).double()
    res = assert_training_matches(_shift_step(False), model, _sgd, _rows([8, 5, 1, 3]), fake_mesh((2,), ("dp",)), sc.Plan(), dynamic=True,
                                  atol=1e-12, rtol=1e-12)
    assert res.sim.compiles == 1 and not caplog.records, res.sim.reasons


def test_contiguous_copy_written_in_place_compiles_per_shape(caplog):
    """The copy is written in place: for one row one device would write through to its
    source, so the step keeps one program per shape (one INFO line) and equals one device."""
    import logging

    caplog.set_level(logging.INFO, logger="spmd_compiler.driver.dynamic")
    model = nn.Linear(16, 16).double()
    res = assert_training_matches(_shift_step(True), model, _sgd, _rows([8, 5]), fake_mesh((2,), ("dp",)), sc.Plan(), dynamic=True,
                                  atol=1e-12, rtol=1e-12)
    assert res.sim.compiles == 2, res.sim.reasons
    assert any("contiguous() of a batch-sized view" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
