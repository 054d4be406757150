"""Activation checkpointing replays the forward's random numbers (trace/rng.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint

from spmd_compiler import Plan
from spmd_compiler.errors import SpmdError
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import mse_train_step
from spmd_compiler.trace import trace


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(torch.relu(self.l1(x))))


class Checkpointed(nn.Module):
    """Two checkpointed blocks with dropout inside, and one dropout outside."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Block(), Block()
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.a, x, use_reentrant=False)
        return checkpoint(self.b, self.drop(h), use_reentrant=False)


def _draws(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "_nondeterministic_seeded", False)]


def test_recompute_reuses_the_forward_draws():
    model = Checkpointed().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, dtype=torch.float64)
    traced = trace(mse_train_step, model, opt, x, x)
    draws = _draws(traced.gm)
    assert len(draws) == 3  # three dropouts drawn once each; without replay the recomputes add two more
    assert {n.meta.get("spmd_phase") for n in draws} == {"forward"}


@pytest.mark.parametrize("plan", [Plan(), Plan(params={"*.l1.weight": [Shard(0)], "*.l1.bias": [Shard(0)], "*.l2.weight": [Shard(1)]})],
                         ids=["dp", "tp"])
def test_checkpointed_dropout_trains_equal_to_one_device(plan):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64)) for _ in range(3)]
    result = assert_training_matches(mse_train_step, Checkpointed().double(), lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                     fake_mesh((2,), ("dp",)), plan, atol=1e-13, rtol=0)
    assert result.losses[0] == result.reference_losses[0]
    assert result.max_param_error < 1e-14  # gradients through the recompute equal one device's
    assert_distributed(result.sim)


def test_seeding_inside_the_step_is_refused():
    model = Block().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x):
        torch.manual_seed(0)
        loss = model(x).sum()
        loss.backward()
        return loss

    state = torch.get_rng_state()
    with pytest.raises(SpmdError, match=r"torch.manual_seed\(0\).*fix: seed before calling the compiled step"):
        trace(step, model, opt, torch.randn(4, 8, dtype=torch.float64))
    torch.set_rng_state(state)


def test_fused_attention_backward_is_no_draw():
    """torch tags the fused attention kernels, forward and backward, as seeded (for their
    dropout): the backward replays its forward's philox state and is no draw; the forward
    stays one (a checkpointed recompute reuses its outputs), as do ordinary random ops."""
    import torch.fx as fx

    from spmd_compiler.trace.rng import is_random_op

    aten = torch.ops.aten
    g = fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    fwd = g.call_function(aten._scaled_dot_product_efficient_attention.default, (q, k, v, None, True, 0.0, True))
    bwd = g.call_function(aten._scaled_dot_product_efficient_attention_backward.default,
                          (q, q, k, v, None, q, q, q, q, 0.0, [True, True, True, False], True))
    noise = g.call_function(aten.rand_like.default, (q,))
    tagged = [bool(getattr(n.target, "_nondeterministic_seeded", False)) for n in (fwd, bwd, noise)]
    assert [is_random_op(n) for n in (fwd, bwd, noise)] == [True, False, True] and tagged == [True, True, True], tagged
