"""fuse_mean_reductions (spmd_compiler/optimize/mean_reductions.py): a mean cross entropy's
target count and loss value reduced in one all_reduce where the value rides in no
gradient bucket; float64 results equal one device's at 1e-12, ignored targets and uneven
shards included."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.driver.fold import find_fold
from spmd_compiler.testing import SimulatedTraining, assert_spmd_matches, fake_mesh
from spmd_compiler.testing.models import GPT, MLP, train_step

c10d = torch.ops._c10d_functional
OFF = ("fuse_mean_reductions",)
WINDOW = 3


def accumulating_lm_step(model, optimizer, ids, targets, do_step):
    """Gradient accumulation with a padded cross entropy (ignore_index=-1), the mean of
    the window's losses."""
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), ignore_index=-1) / WINDOW
    loss.backward()
    if do_step:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def _batch(i: int, rows: int, vocab: int = 32, seq: int = 8):
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    targets = ids.roll(-1, 1)
    targets[: rows // 2 + 1, seq // 2:] = -1  # padding: ranks count different numbers of targets
    targets[0] = -1  # the first rank's first row: every target ignored
    return ids, targets


def _all_reduces(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]


def _program(mesh, fn, args, passes_disabled=(), plan=None):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = sc.compile(fn, mesh=mesh, plan=plan, passes_disabled=passes_disabled)
    step(model, opt, *args)
    return step.last.gm


def test_accumulating_call_reduces_count_and_loss_once(mesh4):
    """Under defer_grad_sync a call that accumulates reduces no gradient: the count and the
    loss were two launches, now one (the step check still rides on it)."""
    ids, targets = _batch(0, 8)
    args = (ids[:2], targets[:2], False)
    plan = sc.Plan(defer_grad_sync=True)
    before = _all_reduces(_program(mesh4, accumulating_lm_step, args, OFF, plan))
    gm = _program(mesh4, accumulating_lm_step, args, plan=plan)
    after = _all_reduces(gm)
    assert len(before) == 2 and len(after) == 1, (before, after)
    (pair,) = after
    assert pair.meta["spmd_comm"]["op"] == "mean_pair" and pair.args[1] == "sum"
    assert pair.args[0].meta["val"].shape == (2,)  # [this rank's loss sum, its target count]
    assert "count" in pair.meta["spmd_comm"]["reason"]
    point = find_fold(gm, world_size=4)
    assert point is not None and point.collective == pair.name and point.shape == (2,)


def test_stepping_call_launches_as_many_and_starts_with_the_pair(mesh4):
    """Where the loss would ride in the gradient bucket the launches are the same (the pair
    instead of the count), and the program starts with the collective the accumulating
    calls start with, so a switch between them needs no standalone step check. (Without
    defer_mean_divisor: with it, the pair rides in the bucket, see below.)"""
    ids, _ = _batch(0, 8)
    before = _all_reduces(_program(mesh4, train_step, (ids[:2], ids[:2]), OFF))
    gm = _program(mesh4, train_step, (ids[:2], ids[:2]), ("defer_mean_divisor",))
    pair, bucket = _all_reduces(gm)
    assert len(before) == 2 and "target count" in before[0].meta["spmd_comm"]["reason"]
    assert any(m.get("rider") for m in before[1].meta["spmd_comm"]["bucket"])  # the loss rode in the bucket
    assert pair.meta["spmd_comm"]["op"] == "mean_pair" and bucket.meta["spmd_comm"]["op"] == "bucket"
    assert not any(m.get("rider") for m in bucket.meta["spmd_comm"]["bucket"])
    point = find_fold(gm, world_size=4)
    assert point.collective == pair.name and point.shape == (2,)
    (bucket,) = _all_reduces(_program(mesh4, train_step, (ids[:2], ids[:2])))  # defer_mean_divisor: the pair rides
    assert [m["value"] for m in bucket.meta["spmd_comm"]["bucket"] if m.get("rider")] == [pair.meta["spmd_comm"]["value"]]


def accumulating_classifier_step(model, optimizer, x, targets, do_step):
    loss = F.cross_entropy(model(x), targets, ignore_index=-1) / WINDOW
    loss.backward()
    if do_step:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def _classifier_batch(i: int, rows: int):
    g = torch.Generator().manual_seed(200 + i)
    x = torch.randn(rows, 16, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 6, (rows,), generator=g)
    targets[: 3 + i % 2] = -1  # rank 0 has its targets all or partly ignored
    return x, targets


# gpt: 3 rows a rank, rank 0's all or partly ignored, rank 1's partly, rank 2's none (a
# world of 2 checked a subset: its two ranks' rows all or partly ignored); mlp: 3, 2, 2 rows
@pytest.mark.parametrize("world,rows,kind", [(3, 9, "gpt"), (3, 7, "mlp")])
def test_accumulation_matches_one_device(world, rows, kind):
    torch.manual_seed(0)
    if kind == "gpt":
        model, fn, batch = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double(), accumulating_lm_step, _batch
    else:
        model, fn, batch = MLP(out=6).double(), accumulating_classifier_step, _classifier_batch
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref))
    mesh = fake_mesh((world,), ("dp",))
    sim = SimulatedTraining(fn, model, opt, mesh, sc.Plan(defer_grad_sync=True))
    fused = 0
    for i in range(2 * WINDOW):
        inputs, targets = batch(i, rows)
        assert (targets == -1).any() and (targets != -1).any()
        do_step = i % WINDOW == WINDOW - 1
        loss = sim.step(inputs, targets, do_step)
        want = fn(ref, ref_opt, inputs, targets, do_step)
        assert torch.allclose(loss, want, rtol=0, atol=1e-12), (i, loss.item(), want.item())
        fused += any(n.meta["spmd_comm"].get("op") == "mean_pair" for n in _all_reduces(sim.expansions[(0,)].gm))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=0, atol=1e-12), i
    assert fused == 2 * WINDOW  # every call: those that accumulate and those that step


@pytest.mark.parametrize("world,rows,ignored", [(2, 10, 3), (3, 10, 4)])  # 3 ranks: 4, 3, 3 rows; rank 0 partly / all ignored
def test_loss_only_matches_one_device(world, rows, ignored):
    """An evaluation loss (no backward), plain and with class weights: one all_reduce."""
    logits = torch.randn(rows, 6, dtype=torch.float64)
    target = torch.randint(0, 6, (rows,))
    target[:ignored] = -100
    weight = torch.rand(6, dtype=torch.float64) + 0.5
    mesh = fake_mesh((world,), ("dp",))
    for fn, inputs, placements in (
        (lambda x, t: F.cross_entropy(x, t), [logits, target], [[Shard(0)], [Shard(0)]]),
        (lambda x, t, w: F.cross_entropy(x, t, weight=w), [logits, target, weight], [[Shard(0)], [Shard(0)], [Replicate()]]),
    ):
        run = assert_spmd_matches(fn, inputs, mesh, placements, atol=1e-12)
        step = next(iter(run.steps.values()))
        kinds = [n.meta["spmd_comm"].get("op") for n in step.collectives()]
        assert kinds == ["mean_pair"], kinds
