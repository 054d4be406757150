"""Gradient buckets carry the step's other compatible all_reduces (the loss): one launch
per bucket per process group, numerics equal to one device."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.dump.summary import comm_summary
from spmd_compiler.optimize import default_passes, run_passes
from spmd_compiler.optimize.graph_utils import is_collective
from spmd_compiler.testing import assert_training_matches
from spmd_compiler.testing.models import GPT, MLP, gpt_2d_plan, mse_train_step, train_step


def _groups(gm):
    return {g.axis: (g.launches, g.buckets) for g in comm_summary(gm).groups}


def _riders(gm):
    return [m for n in gm.graph.nodes if is_collective(n) for m in n.meta["spmd_comm"].get("bucket") or () if m.get("rider")]


def test_dp_mlp_one_launch_per_bucket_and_the_loss_rides(mesh4):
    """MSE (a mean: the loss is Partial(avg)) under DP: the loss rides in the first
    gradient bucket as a sum divided by the group size; float64 equal to one device."""
    batches = [(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)) for _ in range(3)]
    res = assert_training_matches(mse_train_step, MLP().double(), lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh4,
                                  passes=_without_pair(bucket_mb=0.004), atol=1e-12, rtol=1e-12)
    gm = res.sim.expansions[(0,)].gm
    assert _groups(gm) == {"dp": (2, 2)}  # 2 buckets (8.4 KB of gradients, 4 KB each), 2 launches
    riders = _riders(gm)
    assert len(riders) == 1 and riders[0]["transition"].startswith("P(avg)"), riders  # the mean loss
    first = min((n for n in gm.graph.nodes if is_collective(n)), key=lambda n: list(gm.graph.nodes).index(n))
    assert any(m.get("rider") for m in first.meta["spmd_comm"]["bucket"])  # the first bucket (last layer's gradients)


def test_fsdp_mlp_loss_rides_in_every_row_of_a_reduce_scatter(mesh4):
    """FSDP reduce_scatters gradients: the loss's mean rides in the bucket, every rank's
    value in its own slot of every row (n x n x 8 bytes in the buffer instead of an
    all_reduce of 8), summed by each rank in rank order: the same bits on every rank (the
    simulator sums each rank's reduce_scatter chunk in ring order, and the harness checks
    the Replicate loss bit for bit)."""
    batches = [(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)) for _ in range(3)]
    plan = sc.Plan(params={"*": [sc.Shard(0)]}, fsdp_axes=("dp",))
    res = assert_training_matches(mse_train_step, MLP().double(), lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh4, plan,
                                  passes=_without_pair(bucket_mb=0.004), atol=1e-12, rtol=1e-12)
    gm = res.sim.expansions[(0,)].gm
    (rs,) = [n for n in gm.graph.nodes if is_collective(n) and any(m.get("rider") for m in n.meta["spmd_comm"].get("bucket") or ())]
    assert rs.meta["spmd_comm"]["kind"] == "reduce_scatter"
    assert [m["bytes"] for m in rs.meta["spmd_comm"]["bucket"] if m.get("rider")] == [4 * 4 * 8]
    kinds = [n.meta["spmd_comm"]["kind"] for n in gm.graph.nodes if is_collective(n)]
    assert "all_reduce" not in kinds and kinds.count("reduce_scatter") == 2, kinds  # the loss has no launch of its own


def test_riders_can_be_turned_off(mesh4):
    from spmd_compiler.optimize import PassSpec, bucket_gradients_pass

    model = MLP()
    traced = sc.trace(mse_train_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16), torch.randn(8, 16))
    on = run_passes(sc.expand(traced, mesh4).gm, [PassSpec("b", bucket_gradients_pass)])[0]
    off = run_passes(sc.expand(traced, mesh4).gm, [PassSpec("b", bucket_gradients_pass, {"fuse_other_all_reduces": False})])[0]
    assert _groups(on) == {"dp": (1, 1)}
    assert _groups(off) == {"dp": (2, 1)}  # the loss is its own launch
    assert not _riders(off)


@pytest.fixture(scope="module")
def traced_gpt():
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 32, (8, 8))
    train_step(model, opt, ids, ids)
    return sc.trace(train_step, model, opt, ids, ids)


def _without_pair(**options):
    """The default passes without fuse_mean_reductions (which reduces the loss with the
    target count before bucketing: optimize/mean_reductions.py)."""
    return [p for p in default_passes(**options) if p.name != "fuse_mean_reductions"]


@pytest.mark.parametrize("plan", ["dp", "2d"])
def test_gpt_loss_rides_and_the_target_count_stays(traced_gpt, plan):
    """Cross entropy without fuse_mean_reductions: the loss (sum) rides in a dp gradient
    bucket; the target count does not (the forward divides by it at once): dp launches =
    buckets + 1. With it (the default), the count and the loss go in one all_reduce (a
    fused collective of two values): dp launches = buckets. TP's Megatron all_reduces have
    no bucket to ride in (each is needed by the next op)."""
    from spmd_compiler.testing import fake_mesh

    mesh = fake_mesh((4,), ("dp",)) if plan == "dp" else fake_mesh((2, 2), ("dp", "tp"))
    step = sc.expand(traced_gpt, mesh) if plan == "dp" else sc.expand(traced_gpt, mesh, gpt_2d_plan())
    gm = run_passes(step.gm, _without_pair(bucket_mb=0.01))[0]
    groups = _groups(gm)
    launches, buckets = groups["dp"]
    assert buckets >= 2 and launches == buckets + 1, groups
    singles = [n for n in gm.graph.nodes if is_collective(n) and n.meta["spmd_comm"]["axis_name"] == "dp" and not n.meta["spmd_comm"].get("bucket")]
    assert [n.meta["spmd_comm"]["reason"].split(":")[0] for n in singles] == ["target count of a mean loss (all ranks' targets)"]
    assert singles[0].meta.get("spmd_phase") == "forward"
    assert len(_riders(gm)) == 1
    if plan == "2d":
        assert groups["tp"] == (8, 0)
    step = sc.expand(traced_gpt, mesh) if plan == "dp" else sc.expand(traced_gpt, mesh, gpt_2d_plan())
    paired = run_passes(step.gm, [p for p in default_passes(bucket_mb=0.01) if p.name != "defer_mean_divisor"])[0]
    assert _groups(paired)["dp"] == (launches, launches) and not _riders(paired)  # as many launches, each a bucket
    pairs = [n for n in paired.graph.nodes if is_collective(n) and n.meta["spmd_comm"].get("op") == "mean_pair"]
    assert len(pairs) == 1 and pairs[0].meta.get("spmd_phase") == "forward"
    # with defer_mean_divisor (the default) the pair rides in the first dp bucket, under dp x
    # tp too (the backward's tp all_reduces sum values scaled by 1/count: LINEAR's collective rules)
    step = sc.expand(traced_gpt, mesh) if plan == "dp" else sc.expand(traced_gpt, mesh, gpt_2d_plan())
    deferred = run_passes(step.gm, default_passes(bucket_mb=0.01))[0]
    assert _groups(deferred)["dp"] == (buckets, buckets) and len(_riders(deferred)) == 1
    if plan == "2d":
        assert _groups(deferred)["tp"] == (8, 0)


def test_gpt_dp_with_the_loss_in_a_bucket_equals_one_device(mesh4):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double()
    batches = [(torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))) for _ in range(2)]
    res = assert_training_matches(train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh4,
                                  passes=_without_pair(bucket_mb=0.004), atol=1e-12, rtol=1e-12)
    gm = res.sim.expansions[(0,)].gm
    assert len(_riders(gm)) == 1
    launches, buckets = _groups(gm)["dp"]
    assert launches == buckets + 1  # the target count
