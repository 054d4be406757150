"""expand/rules/norms.py: clip_grad_norm_ under 2-D data x tensor parallelism reduces each
gradient's pending data-parallel sum and keeps its tensor-parallel shards (a number per
gradient moves on the tensor axis, never the gradient), equal to one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import MLP, megatron_mlp_plan


def _step(clip: bool = True, foreach: bool = True):
    def step(model, optimizer, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5, foreach=foreach)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def _batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randn(8, 16, generator=g, dtype=torch.float64)) for _ in range(3)]


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach_norm", "vector_norm"])
def test_clip_under_2d_keeps_tensor_parallel_gradients_sharded(foreach):
    torch.manual_seed(0)
    plan = megatron_mlp_plan(ndim=2, axis=1)
    plan = sc.Plan(params=plan.params, default_input=[sc.Shard(0), sc.Replicate()])
    res = assert_training_matches(_step(True, foreach), MLP(16, 32).double(), lambda p: torch.optim.AdamW(p, lr=0.05), _batches(),
                                  fake_mesh((2, 2), ("dp", "tp")), plan, atol=1e-12, rtol=1e-10)
    dist = assert_distributed(res, sharded=["l1.weight", "l2.weight"])
    # before the rule: DTensor's norm strategy gathered l1.weight, l1.bias and l2.weight's
    # gradients on tp (3 all_gathers); now only numbers (the per-gradient norms) move on tp
    assert dist.count("all_gather") == 0, dist.describe()
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    tp = [n for n in e.collectives() if n.meta["spmd_comm"].get("axis") == "tp" or "'tp'" in n.meta["spmd_comm"]["reason"]]
    assert all(n.args[0].meta["val"].numel() <= 4 for n in tp if n.meta.get("spmd_phase") == "optimizer"), [  # the 4 norms, stacked
        (n.meta["spmd_comm"]["reason"], n.args[0].meta["val"].shape) for n in tp]


def test_clip_under_data_parallel_keeps_one_gradient_all_reduce():
    """Plain DP: the gradients are reduced once (bucketed all_reduces), the norms local."""
    torch.manual_seed(0)
    res = assert_training_matches(_step(True, True), MLP(16, 32).double(), lambda p: torch.optim.AdamW(p, lr=0.05), _batches(),
                                  fake_mesh((2,), ("dp",)), sc.Plan(), atol=1e-12, rtol=1e-10)
    dist = assert_distributed(res)
    assert dist.count("all_gather") == 0 and dist.count("reduce_scatter") == 0, dist.describe()
