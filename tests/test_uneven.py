"""Uneven sharding: dims that do not divide by the mesh axis give correct results."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches
from spmd_compiler.testing.models import MLP


def mse_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def ce_step(model, optimizer, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


PLANS = {
    "dp": None,
    "fsdp": sc.Plan(params={"*": [sc.Shard(0)]}),
    "tp": sc.Plan(params={"l1.*": [sc.Shard(0)], "l2.weight": [sc.Shard(1)]}, default_input=[sc.Replicate()]),
}

SHARDED = {"dp": ["batch[0]", "batch[1]"], "fsdp": ["l1.weight", "l1.bias", "l2.weight", "l2.bias"], "tp": ["l1.weight", "l1.bias", "l2.weight"]}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("batch", [10, 3])  # 3 over 4 ranks: one rank holds an empty shard
def test_uneven_mse(mesh4, plan, batch):
    batches = [(torch.randn(batch, 16, dtype=torch.float64), torch.randn(batch, 16, dtype=torch.float64)) for _ in range(2)]
    # hidden 30 over 4 ranks: parameters shard 8, 8, 8, 6
    res = assert_training_matches(mse_step, MLP(16, 30).double(), lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh4, PLANS[plan])
    assert not res.sim.expansions[(0,)].rank_independent
    assert_distributed(res, sharded=SHARDED[plan])  # local shapes checked on every rank
    assert res.sim.expansions[(0,)] is not res.sim.expansions[(3,)]


def test_uneven_cross_entropy_mean(mesh4):
    batches = [(torch.randn(10, 16, dtype=torch.float64), torch.randint(0, 16, (10,))) for _ in range(2)]
    res = assert_training_matches(ce_step, MLP(16, 30).double(), lambda p: torch.optim.SGD(p, lr=0.1), batches, mesh4)
    assert_distributed(res, sharded=["batch[0]", "batch[1]"], collectives={"optimizer/all_reduce/dp": 1})  # the gradients, in one bucket


def test_mean_over_uneven_shards_is_weighted(mesh4):
    """Partial(avg) of unequal chunks would average the chunk means; the guard replicates."""
    batches = [(torch.arange(10, dtype=torch.float64).view(10, 1).repeat(1, 16), torch.zeros(10, 16, dtype=torch.float64))]
    res = assert_training_matches(mse_step, MLP(16, 4).double(), lambda p: torch.optim.SGD(p, lr=0.0), batches, mesh4)
    assert res.losses == pytest.approx(res.reference_losses, rel=1e-12)
    assert_distributed(res, sharded=["batch[0]"], collectives={"forward/all_gather/dp": 1})  # the guard's gather
