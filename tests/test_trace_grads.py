"""Gradients as state of the step: several ``backward()`` calls in one step, and
gradients that a call leaves for the next (accumulation across calls).

Every test trains in float64 on all ranks simulated in one process and compares with
one device (atol 1e-9 / rtol 1e-7), and checks that the program is really distributed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmd_compiler.testing import assert_distributed, assert_training_matches
from spmd_compiler.testing.models import GPT, gpt_fsdp_plan, gpt_tp_plan


def two_backward_step(model, optimizer, ids, targets, ids2, targets2):
    """Gradient accumulation within the step: two micro-batches, two backward() calls."""
    first = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    first.backward()
    second = F.cross_entropy(model(ids2).flatten(0, 1), targets2.flatten())
    second.backward()
    optimizer.step()
    optimizer.zero_grad()
    return first + second


def _gpt():
    return GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double()


def _lm_batches(n=2, rows=8, tensors=2):
    return [tuple(torch.randint(0, 32, (rows, 8)) for _ in range(tensors)) for _ in range(n)]


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_two_backward_calls_in_one_step(mesh4, plan):
    plans = {"dp": None, "fsdp": gpt_fsdp_plan()}
    res = assert_training_matches(two_backward_step, _gpt(), lambda p: torch.optim.AdamW(p, lr=0.01), _lm_batches(tensors=4), mesh4, plans[plan])
    step = res.sim.expansions[(0,)]
    phases = {}
    for n in step.collectives():
        phases.setdefault(n.meta["spmd_phase"], []).append(n.meta["spmd_comm"]["kind"])
    if plan == "fsdp":
        # the second micro-batch's forward is forward: its parameters are gathered, not
        # used as shards; both backward's Partial gradients are summed, then reduce-scattered once
        assert_distributed(res, sharded=["batch[0]", "tok.weight", "blocks.0.fc.weight"])
        assert "all_gather" in phases["forward"], phases
        assert phases["optimizer"].count("reduce_scatter") == 1, phases
    else:
        # both backward's Partial gradients are summed locally and all-reduced once
        assert_distributed(res, sharded=["batch[0]", "batch[2]"], collectives={"optimizer/all_reduce/dp": 1})
        assert "all_gather" not in phases.get("forward", []), phases
