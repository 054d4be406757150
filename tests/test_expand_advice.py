"""A plan that shards parameters on the data-parallel axis without fsdp_axes is warned about
once per compile, with the bytes it gathers and the fsdp_axes fix; FSDP and Megatron plans
are not."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing import assert_training_matches, fake_mesh
from spmd_compiler.testing.models import MLP, megatron_mlp_plan, mse_train_step

LOGGER = "spmd_compiler.expand.advice"


def _advice(plan, caplog, mesh=None):
    mesh = mesh or fake_mesh((4,), ("dp",))
    batches = [(torch.randn(16, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64)) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        res = assert_training_matches(mse_train_step, MLP().double(), lambda p: torch.optim.AdamW(p, lr=1e-2), batches, mesh, plan)
    return [r.getMessage() for r in caplog.records if r.name == LOGGER], res


def test_tutorial_plan_without_fsdp_axes_is_warned_once(caplog):
    msgs, res = _advice(sc.Plan(params={"*": [Shard(0)]}), caplog)
    assert len(msgs) == 1, msgs  # every simulated rank, two steps: one warning
    msg = msgs[0]
    assert "on mesh axis 'dp', where the batch is split along dim 0, but 'dp' is not in fsdp_axes" in msg
    assert "in_batch_0" in msg  # the batch itself is gathered
    assert "With 'dp' in fsdp_axes the parameters would be gathered instead (about 8.4 KiB in 4 all_gathers per step)" in msg
    assert "fix: for FSDP (parameters stored sharded, gathered for compute) write Plan(..., fsdp_axes=('dp',))" in msg


@pytest.mark.parametrize(
    "plan",
    [
        sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",)),
        sc.Plan(params=dict(megatron_mlp_plan().params), default_input=[Replicate()]),  # Megatron TP
        sc.Plan(),  # data parallel
    ],
    ids=["fsdp", "megatron", "dp"],
)
def test_fsdp_megatron_and_dp_plans_are_not_warned(plan, caplog):
    msgs, _ = _advice(plan, caplog)
    assert msgs == []


def test_2d_plan_warns_only_for_the_axis_without_fsdp(caplog):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    plan = sc.Plan(params={"*": [Shard(0), Replicate()]}, default_input=[Shard(0), Replicate()])
    msgs, _ = _advice(plan, caplog, mesh)
    assert len(msgs) == 1 and "mesh axis 'dp'" in msgs[0] and "default_input=[Replicate(), Replicate()]" in msgs[0]
    caplog.clear()
    msgs, _ = _advice(sc.Plan(params={"*": [Shard(0), Replicate()]}, default_input=[Shard(0), Replicate()], fsdp_axes=("dp",)), caplog, mesh)
    assert msgs == []


def test_2d_fsdp_on_one_axis_warns_for_the_other_with_both_in_the_fix(caplog):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    plan = sc.Plan(params={"*": [Shard(0), Shard(0)]}, default_input=[Shard(0), Shard(0)], fsdp_axes=("dp",))
    msgs, _ = _advice(plan, caplog, mesh)
    assert len(msgs) == 1 and "mesh axis 'tp'" in msgs[0], msgs
    assert "fsdp_axes=('dp', 'tp')" in msgs[0] and "default_input=[Shard(dim=0), Replicate()]" in msgs[0]
