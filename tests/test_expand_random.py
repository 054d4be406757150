"""Random ops on shards: the RNG contract (docs/randomness.md) against one device.

rng="exact": the compiled step draws the numbers the single-device step draws, for every
element, on any mesh and plan (bit for bit in float64), and leaves the generator where one
device leaves it. rng="fast": Replicate values still agree across ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from spmd_compiler import Plan
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh, run_spmd
from spmd_compiler.testing.models import megatron_mlp_plan, mse_train_step


class NoisyMLP(nn.Module):
    """Dropout on a sharded and on a replicated activation, plus randn_like, a random
    factory sized by the batch and bernoulli: every kind of draw the rules handle."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, hidden)
        self.l2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.l1(x)))  # TP: sharded by hidden features
        y = self.drop(self.l2(h))  # TP: replicated after the row-parallel all_reduce
        noise = torch.randn_like(y) * 0.01 + torch.rand(x.shape[0], 1, dtype=x.dtype) * 0.01
        return y + noise * torch.bernoulli(torch.full_like(y, 0.5), 0.5)


def _batches(n: int = 3, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g, dtype=torch.float64), torch.randn(rows, 8, generator=g, dtype=torch.float64)) for _ in range(n)]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


PLANS = {
    "dp": ((2,), ("dp",), Plan(), 8),
    "dp-uneven": ((4,), ("dp",), Plan(), 6),
    "tp": ((2,), ("tp",), megatron_mlp_plan(), 8),
    "fsdp": ((2,), ("dp",), Plan(params={"*": [Shard(0)]}, default_input=[Shard(0)], fsdp_axes=(0,)), 8),
    "2d": ((2, 2), ("dp", "tp"), Plan(params=megatron_mlp_plan(2, 1).params, default_input=[Shard(0), Replicate()]), 8),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_dropout_and_draws_equal_one_device_bit_for_bit(name):
    shape, names, plan, rows = PLANS[name]
    torch.manual_seed(0)
    model = NoisyMLP().double()
    result = assert_training_matches(mse_train_step, model, _sgd, _batches(3, rows), fake_mesh(shape, names), plan, atol=1e-13, rtol=0)
    assert result.losses[0] == result.reference_losses[0]  # the first step's draws and loss: bit for bit
    assert result.max_param_error <= 1e-15  # later steps: only the all_reduce's summation order differs
    assert_distributed(result.sim, sharded=["batch[0]"] if name != "tp" else ["l1.weight"])


def test_replicated_dropout_draws_one_mask_whatever_the_shards():
    """Dropout of a replicated value and of a batch-sharded one in one program: the
    replicated result is identical on every rank (checked per rank by the simulator)
    and each shard gets the single-device mask's rows."""

    def f(x, r):
        return torch.nn.functional.dropout(x, 0.5), torch.nn.functional.dropout(r, 0.5)

    x, r = torch.randn(8, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    run = run_spmd(f, [x, r], fake_mesh((4,), ("dp",)), [[Shard(0)], [Replicate()]])
    for got, want in zip(run.outputs, run.reference):
        assert torch.equal(got, want)
    assert_distributed(run, sharded=["batch[0]"], collectives={"all_gather": 0, "all_reduce": 0})  # no communication


def test_fast_mode_keeps_replicas_equal_and_shards_different():
    """rng="fast": local draws only; Replicate values agree across ranks (asserted by the
    simulator for every output), shards of one value get different masks."""

    def f(x, r):
        return torch.nn.functional.dropout(x, 0.5), torch.nn.functional.dropout(r, 0.5)

    x, r = torch.ones(8, 64, dtype=torch.float64), torch.ones(4, 64, dtype=torch.float64)
    run = run_spmd(f, [x, r], fake_mesh((4,), ("dp",)), [[Shard(0)], [Replicate()]], rng="fast")
    sharded, replicated = run.outputs
    rows = sharded.view(4, 2, 64)
    assert not any(torch.equal(rows[0], rows[j]) for j in range(1, 4))  # shards draw different numbers
    assert set(sharded.unique().tolist()) == {0.0, 2.0}  # still dropout: kept values scaled by 1/(1-p)
    assert 0.3 < (replicated == 0).double().mean().item() < 0.7
    gm = run.steps[(0,)].gm
    rep = next(n for n in gm.graph.nodes if n.op == "output").args[0][1]  # the replicated dropout's local value
    per_rank = [run.envs[c][rep.name] for c in sorted(run.steps)]
    assert len(per_rank) == 4 and all(torch.equal(per_rank[0], v) for v in per_rank[1:])


def test_fast_mode_training_keeps_replicas_in_step():
    torch.manual_seed(0)
    result = assert_training_matches(mse_train_step, NoisyMLP().double(), _sgd, _batches(2), fake_mesh((2,), ("tp",)), megatron_mlp_plan(), rng="fast")
    assert len(result.losses) == 2 and all(l == l for l in result.losses)


def test_random_ops_are_effects_the_passes_keep_in_order():
    from spmd_compiler.driver.guard import first_effect
    from spmd_compiler.expand.rules.random import is_random

    def f(x):
        return torch.nn.functional.dropout(x * 2, 0.5).sum()

    run = run_spmd(f, [torch.randn(8, 4, dtype=torch.float64)], fake_mesh((2,), ("dp",)), [[Shard(0)]])
    gm = next(iter(run.steps.values())).gm
    draws = [n for n in gm.graph.nodes if is_random(n)]
    assert len(draws) == 1 and first_effect(gm) is draws[0]


def test_rng_option_is_validated():
    from spmd_compiler.driver import Options

    with pytest.raises(ValueError, match="rng='philox'.*exact"):
        Options(rng="philox")


def test_random_like_of_a_partial_value_draws_once():
    """``rand_like`` of a Partial(sum) matmul result (row-parallel): a replicated draw of
    the single-device numbers, not one per rank summed."""

    def f(x, w):
        return torch.rand_like(x @ w) + (x @ w)

    x, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    run = run_spmd(f, [x, w], fake_mesh((2,), ("tp",)), [[Shard(1)], [Shard(0)]])
    torch.testing.assert_close(run.outputs[0], run.reference[0], atol=1e-12, rtol=0)
