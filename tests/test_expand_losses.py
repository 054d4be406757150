"""Loss rules (spmd_compiler/expand/rules/losses.py): mean losses over sharded targets
are exact whatever each rank holds, padding (ignore_index) included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from spmd_compiler.testing import assert_distributed, assert_spmd_matches, assert_training_matches, distribution_of
from spmd_compiler.testing.models import GPT, gpt_2d_plan


def _collectives(run):
    step = next(iter(run.steps.values()))
    return [n.meta["spmd_comm"]["kind"] for n in step.collectives()]


@pytest.mark.parametrize("rows,ignored", [(16, 5), (16, 4), (14, 6)])  # rank 0 partly / fully ignored; uneven shards
def test_cross_entropy_with_ignored_targets(mesh4, rows, ignored):
    logits = torch.randn(rows, 10, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 10, (rows,))
    target[:ignored] = -100

    def loss_and_grad(x, t):
        with torch.enable_grad():  # the single-device reference runs under no_grad
            x = x.detach().requires_grad_(True)
            loss = F.cross_entropy(x, t)
            loss.backward()
        return loss.detach(), x.grad

    run = assert_spmd_matches(loss_and_grad, [logits, target], mesh4, [[Shard(0)], [Shard(0)]], atol=1e-12)
    # the count of kept targets and the loss's sum are reduced together in forward (optimize/mean_reductions.py; the
    # loss rides in no gradient bucket here); the gradient stays sharded
    assert_distributed(run, sharded=["batch[0]", "batch[1]"], collectives={"forward/all_reduce": 1})


def test_weighted_cross_entropy(mesh4):
    logits = torch.randn(16, 6, dtype=torch.float64)
    target = torch.randint(0, 6, (16,))
    target[3:9] = -100
    weight = torch.rand(6, dtype=torch.float64) + 0.5
    run = assert_spmd_matches(
        lambda x, t, w: F.cross_entropy(x, t, weight=w), [logits, target, weight], mesh4,
        [[Shard(0)], [Shard(0)], [Replicate()]], atol=1e-12,
    )
    assert_distributed(run, sharded=["batch[0]", "batch[1]"], collectives={"forward/all_reduce": 1})  # count and loss together


def test_replicated_target_keeps_dtensor_rule(mesh4):
    logits = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randint(0, 6, (8,))
    run = assert_spmd_matches(lambda x, t: F.cross_entropy(x, t), [logits, target], mesh4, [[Replicate()], [Replicate()]])
    assert _collectives(run) == []
    assert distribution_of(run).sharded == ()  # a replicated plan by design: every rank holds and computes everything


def padded_lm_step(model, optimizer, ids, targets):
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _padded_batches(rows, n=2, vocab=32, seq=8):
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, seq))
        targets = ids.roll(-1, 1)
        targets[: rows // 2, seq // 2 :] = -1  # the first half of the batch is half padding
        out.append((ids, targets))
    return out


def test_padded_language_model_data_parallel(mesh4):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double()
    res = assert_training_matches(padded_lm_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), _padded_batches(8), mesh4)
    assert_distributed(res, sharded=["batch[0]", "batch[1]"], collectives={"optimizer/all_reduce/dp": 1})  # every gradient, in one bucket


@pytest.mark.slow
def test_padded_language_model_2d(mesh2x2):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double()
    res = assert_training_matches(padded_lm_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), _padded_batches(4), mesh2x2, gpt_2d_plan())
    assert_distributed(res, sharded=["batch[0]", "blocks.0.fc.weight"], collectives={"forward/all_reduce/tp": 2})  # Megatron: one per sub-layer
