"""Numerics of expanded train steps: all ranks simulated in one process vs one device.

Tolerance: float64 models, atol 1e-9 / rtol 1e-7 on loss and every parameter after 3
steps (observed errors are ~1e-13; float32 Adam amplifies reduction-order rounding to
~1e-4, which is why these tests run in float64).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches
from spmd_compiler.testing.models import GPT, MLP, gpt_2d_plan, megatron_mlp_plan, train_step

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def mse_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def mlp_batches(n=3, batch=8, dim=16):
    return [(torch.randn(batch, dim, dtype=torch.float64), torch.randn(batch, dim, dtype=torch.float64)) for _ in range(n)]


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_mlp_data_parallel(mesh4, opt):
    res = assert_training_matches(mse_step, MLP().double(), OPTIMIZERS[opt], mlp_batches(), mesh4)
    assert_distributed(res, sharded=["batch[0]", "batch[1]"], collectives={"optimizer/all_reduce/dp": 1})  # one bucket
    step = res.sim.expansions[(0,)]
    comms = [n.meta["spmd_comm"] for n in step.collectives()]
    assert "all_gather" not in [c["kind"] for c in comms]
    # every parameter's gradient all_reduced once (bucketed, as compile() does; the loss rides along)
    grads = [g for c in comms if c["kind"] == "all_reduce" and "bucket" in c for g in c["bucket"] if not g.get("rider")]
    params = sum(p.numel() * p.element_size() for p in res.sim.model.parameters())
    assert len(grads) == 4 and sum(g["bytes"] for g in grads) == params, grads


def test_mlp_fsdp_style(mesh4):
    plan = sc.Plan(params={"*": [Shard(0)]})
    res = assert_training_matches(mse_step, MLP().double(), OPTIMIZERS["adamw"], mlp_batches(), mesh4, plan)
    step = res.sim.expansions[(0,)]
    by_phase = {}
    for n in step.collectives():
        by_phase.setdefault(n.meta["spmd_phase"], []).append(n.meta["spmd_comm"]["kind"])
    assert "all_gather" in by_phase["forward"], by_phase  # parameters gathered for use
    assert "reduce_scatter" in by_phase["optimizer"] + by_phase.get("backward", []), by_phase  # gradients reduce-scattered
    # every parameter stays sharded: on every rank its local shard is a quarter of it
    assert_distributed(res, sharded=["l1.weight", "l1.bias", "l2.weight", "l2.bias"])


def test_megatron_tp_mlp_one_forward_all_reduce(mesh4):
    plan = megatron_mlp_plan()
    batches = [(x, y) for x, y in mlp_batches()]
    res = assert_training_matches(mse_step, MLP().double(), OPTIMIZERS["sgd_momentum"], batches, mesh4, sc.Plan(params=plan.params, default_input=[Replicate()]))
    assert_distributed(res, sharded=["l1.weight", "l1.bias", "l2.weight"], collectives={"forward/all_reduce": 1})
    step = res.sim.expansions[(0,)]
    forward = [n for n in step.collectives() if n.meta["spmd_phase"] == "forward"]
    assert [n.meta["spmd_comm"]["kind"] for n in forward] == ["all_reduce"], [n.format_node() for n in forward]
    # the row-parallel matmul leaves a Partial sum; it is reduced where a non-linear op needs it
    assert "Partial" not in forward[0].meta["spmd_comm"]["reason"] or "P(sum)->R" in forward[0].meta["spmd_comm"]["reason"]


@pytest.mark.slow
def test_transformer_2d_adamw(mesh2x2):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2).double()
    batches = [(torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))) for _ in range(3)]
    res = assert_training_matches(train_step, model, OPTIMIZERS["adamw"], batches, mesh2x2, gpt_2d_plan())
    assert_distributed(res, sharded=["batch[0]", "blocks.0.attn.q.weight", "blocks.0.proj.weight"])
    step = res.sim.expansions[(0, 0)]
    axes = {n.meta["spmd_comm"]["axis_name"] for n in step.collectives()}
    assert axes == {"dp", "tp"}
    assert step.rank_independent


def test_transformer_tied_embeddings_dp(mesh4):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1, tie_embeddings=True).double()
    batches = [(torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))) for _ in range(2)]
    res = assert_training_matches(train_step, model, OPTIMIZERS["adam"], batches, mesh4)
    # one gradient all_reduce per parameter: the tied embedding / LM head counts once
    assert_distributed(res, sharded=["batch[0]", "batch[1]"], collectives={"optimizer/all_reduce/dp": 1})  # every gradient, in one bucket


def clipped_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # a 2-norm over sharded gradients
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_fsdp_style_with_gradient_clipping(mesh4):
    # the gradient norm of a Shard(0) gradient is a p-norm partial: x^2, sum over ranks, sqrt
    plan = sc.Plan(params={"*": [Shard(0)]})
    res = assert_training_matches(clipped_step, MLP().double(), OPTIMIZERS["sgd_momentum"], mlp_batches(), mesh4, plan)
    # the gradients are reduce_scattered to their parameters' shards before the norms read
    # them (one bucket), the norm partials of the 4 gradients all-reduced in one launch
    # (before expand/rules/norms.py used the parameters' layout: the gradients were all-reduced whole)
    assert_distributed(res, sharded=["l1.weight", "l2.weight"], collectives={"optimizer/all_reduce/dp": 1, "optimizer/reduce_scatter/dp": 1})


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("rows", [8, 5])  # even and uneven over 4 ranks
def test_vector_norm_of_a_shard(mesh4, p, rows):
    from spmd_compiler.testing import assert_spmd_matches

    x = torch.randn(rows, 3, dtype=torch.float64)
    run = assert_spmd_matches(lambda t: torch.linalg.vector_norm(t, p), [x], mesh4, [[Shard(0)]], symbolic="none")
    assert_distributed(run, sharded=["batch[0]"], collectives={"all_reduce/dp": 1})


def test_fill_and_like_ops_of_partial_values(mesh4):
    from spmd_compiler.testing import assert_spmd_matches

    def fn(a, b):
        s = (a * b).sum(1)  # Partial(sum) over the sharded dim 1
        return torch.ones_like(s) + torch.empty_like(s).fill_(2.0) - s, torch.full_like(s, 3.0) * s

    a, b = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    run = assert_spmd_matches(fn, [a, b], mesh4, [[Shard(1)], [Shard(1)]], symbolic="none")
    # two reductions (s for the subtraction, 3 * s at the output), independent: one launch
    # (optimize/fuse_all_reduces.py)
    assert_distributed(run, sharded=["batch[0]", "batch[1]"], collectives={"all_reduce/dp": 1})
    step = next(iter(run.steps.values()))
    assert [len(n.meta["spmd_comm"]["bucket"]) for n in step.collectives()] == [2]


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 6 * 6, 16)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        return self.fc(h.flatten(1))


def test_conv_net_data_parallel(mesh4):
    # convolution runs through DTensor's custom handler: batch-sharded it stays local
    batches = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        batches.append((torch.randn(8, 2, 6, 6, dtype=torch.float64, generator=g), torch.randn(8, 16, dtype=torch.float64, generator=g)))
    res = assert_training_matches(mse_step, SmallCNN().double(), OPTIMIZERS["adam"], batches, mesh4)
    kinds = [n.meta["spmd_comm"]["kind"] for n in res.sim.expansions[(0,)].collectives()]
    assert "all_gather" not in kinds  # no fallback gathered the batch
    assert_distributed(res, sharded=["batch[0]", "batch[1]"], collectives={"optimizer/all_reduce/dp": 1, "all_gather": 0})  # gradients in one bucket


@pytest.mark.parametrize("opt", ["sgd_momentum", "adamw"])
def test_lr_schedule_is_followed(mesh4, opt):
    # the learning rate is an input of the compiled step, read at every call: a scheduler
    # that changes it every step trains exactly as on one device, without recompiling
    warmup = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda i: (i + 1) / 4)  # noqa: E731
    import warnings

    with warnings.catch_warnings():  # the scheduler sees optimizer.step() as called, and its wrapper intact
        warnings.simplefilter("error")
        res = assert_training_matches(
            mse_step, MLP().double(), OPTIMIZERS[opt], mlp_batches(n=4), mesh4, sc.Plan(params={"*": [Shard(0)]}),
            make_scheduler=warmup,
        )
    assert res.sim.compiles == 1  # the state is created before the first trace; lr changes never recompile
    assert_distributed(res, sharded=["l1.weight", "l2.weight", "batch[0]"])


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
])
def test_foreach_optimizers_trace_their_per_parameter_update(mesh4, make_opt):
    res = assert_training_matches(mse_step, MLP().double(), make_opt, mlp_batches(), mesh4, sc.Plan(params={"*": [Shard(0)]}))
    assert_distributed(res, sharded=["l1.weight", "l2.weight", "batch[0]"])
    ops = {str(n.target) for n in next(iter(res.sim.expansions.values())).gm.graph.nodes}
    assert not any("_foreach_" in o for o in ops)


def test_written_arguments_redistributed_for_an_op_are_written_back():
    """BatchNorm under Megatron TP normalizes feature-sharded activations, so its
    replicated running statistics are narrowed to this rank's features for the kernel,
    which updates them in place: that write must reach the replicated buffers (it was
    lost: running_mean stayed 0 while parameters matched)."""
    import torch.nn as nn

    from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
    from spmd_compiler.testing.models import megatron_mlp_plan, mse_train_step

    class BNMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.bn, self.l2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 8)

        def forward(self, x):
            return self.l2(torch.relu(self.bn(self.l1(x))))

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64)) for _ in range(3)]
    res = assert_training_matches(mse_train_step, BNMLP().double(), lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                  fake_mesh((2,), ("tp",)), megatron_mlp_plan())  # compares buffers too
    dist = assert_distributed(res, sharded=["l1.weight"])
    assert dist.count("all_gather") >= 2, dist.describe()  # the updated statistics' shards, gathered into the buffers
