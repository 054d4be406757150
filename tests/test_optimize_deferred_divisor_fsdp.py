"""defer_mean_divisor under FSDP (spmd_compiler/optimize/deferred_divisor.py): the gradients
are reduce_scattered, each rank divides its reduced shard (padding included: 0 / C = 0) by
the count after the bucket's wait, and the [loss sum, count] pair rides in the first
reduce_scatter bucket, copied into every rank's row (optimize/bucketing.py): an FSDP step
launches exactly its buckets (parameter gathers and gradient reduce_scatters). float64
equal to one device at 1e-12, at world 2 and 3 (uneven shards), with per-rank target
counts that differ and a rank whose targets are all ignored; and on real gloo processes."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.driver.fold import find_fold
from spmd_compiler.expand.splice import RANK_SIZES
from spmd_compiler.optimize.graph_utils import is_collective
from spmd_compiler.testing import assert_training_matches, fake_mesh
from spmd_compiler.testing.models import GPT, gpt_fsdp_plan
from test_optimize_deferred_divisor import (  # the same step and passes as under DP
    PASS, _ops, _passes, assert_all_ignored_matches_one_device, ce_step, clipped_step)

aten = torch.ops.aten


def _batch(i: int, world: int, vocab: int = 32, seq: int = 8):
    """Two rows per rank; the first ``world`` rows lose a tail of targets (counts differ per
    rank); at step 1 rank 0's rows are all ignored (its count is 0), else its first row."""
    g = torch.Generator().manual_seed(500 + i)
    ids = torch.randint(0, vocab, (2 * world, seq), generator=g)
    targets = ids.roll(-1, 1)
    targets[:world, seq // 2 + i % 3:] = -100
    targets[: 2 if i == 1 else 1] = -100
    return ids, targets


def _model():
    return GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double()


def _run(world: int, *off: str, steps: int = 3, fn=ce_step):
    batches = [_batch(i, world) for i in range(steps)]
    res = assert_training_matches(fn, _model(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), batches,
                                  fake_mesh((world,), ("dp",)), gpt_fsdp_plan(), passes=_passes(*off), atol=1e-12, rtol=0)
    return res, [(coord, step.gm) for coord, step in sorted(res.sim.expansions.items())]


def _launches(gm):
    """Per process group: (collectives, buckets among them)."""
    colls = [n for n in gm.graph.nodes if is_collective(n)]
    per = Counter(n.args[-1] for n in colls)
    buckets = Counter(n.args[-1] for n in colls if n.meta["spmd_comm"].get("op") == "bucket")
    return {g: (per[g], buckets[g]) for g in per}


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_gpt_launches_equal_buckets_and_matches_one_device(world):
    res, programs = _run(world)
    for coord, gm in programs:  # every rank's program (uneven shards: each its own sizes)
        colls = [n for n in gm.graph.nodes if is_collective(n)]
        assert all(n == b for n, b in _launches(gm).values()), (coord, _launches(gm), _ops(colls))
        scatters = [n for n in colls if n.meta["spmd_comm"]["kind"] == "reduce_scatter"]
        assert len(scatters) == 2 and len(colls) == 5, (coord, _ops(colls))  # 3 unit gathers, 2 gradient buckets
        first = scatters[0]
        riders = [m for m in first.meta["spmd_comm"]["bucket"] if m.get("rider")]
        assert len(riders) == 1 and "count" in str(riders[0]), riders  # the [loss sum, count] pair, in every row
        assert riders[0]["bytes"] == world * world * 2 * 8, riders  # float64 pair: world slots in each of the world rows
        assert not any(m.get("rider") for m in scatters[1].meta["spmd_comm"]["bucket"])
        divisions = [n for n in gm.graph.nodes if (n.meta.get("spmd_origin") or {}).get("op") == PASS and n.target is aten.div.Tensor]
        grads = sum(len(s.meta["spmd_comm"]["bucket"]) for s in scatters) - 1
        assert len(divisions) == grads == len(list(_model().parameters())), (len(divisions), grads)
        # uneven shards (world 3): a padded shard is divided, padding and all, on every rank
        assert any(RANK_SIZES in d.meta for d in divisions) == (world == 3)
        point = find_fold(gm, world_size=world)  # the step check still rides on the first collective, a gather
        assert point is not None and point.collective == colls[0].name and point.kind == "all_gather", point
    _, before = _run(world, PASS, steps=2)
    colls = [n for n in before[0][1].graph.nodes if is_collective(n)]
    assert _ops(colls).count("mean_pair") == 1 and len(colls) == 6, _ops(colls)  # without the pass: buckets + the pair


def test_fsdp_clip_grad_norm_reads_the_divided_shards():
    """clip_grad_norm_ under FSDP takes shard-wise norms (one tiny all_reduce, which stays a
    launch of its own: the clipping needs it before the optimizer) of the divided shards."""
    _, programs = _run(3, steps=2, fn=clipped_step)
    gm = programs[0][1]
    colls = [n for n in gm.graph.nodes if is_collective(n)]
    assert any((n.meta.get("spmd_origin") or {}).get("op") == PASS for n in gm.graph.nodes)
    assert _ops(colls).count("mean_pair") == 0 and len(colls) == 6, _ops(colls)  # 5 buckets and the norm


def test_fsdp_every_target_ignored_leaves_zero_gradients_as_one_device():
    """C = 0 on every rank (world 3, uneven shards): one device's loss is NaN, its gradients 0;
    the divided shards are 0 / 1, not 0 / 0."""
    assert_all_ignored_matches_one_device(_model(), fake_mesh((3,), ("dp",)), gpt_fsdp_plan(), rows=3, ignored_at=2)


def _gloo_fsdp(rank: int, world: int, backend: str = "eager") -> dict:
    torch.manual_seed(0)
    model = _model()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    step = sc.compile(ce_step, mesh=(world,), plan=gpt_fsdp_plan(), passes=_passes(), backend=backend)
    errs, losses = [], []
    for i in range(3):
        ids, targets = _batch(i, world)
        loss = step(model, opt, ids.chunk(world)[rank], targets.chunk(world)[rank])
        losses.append(loss.item().hex())
        errs.append(abs(loss.item() - ce_step(ref, ref_opt, ids, targets).item()))
    errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    colls = [n for n in step.last.gm.graph.nodes if is_collective(n)]
    return {"err": max(errs), "ops": _ops(colls), "losses": losses,
            "riders": sum(bool(m.get("rider")) for n in colls for m in n.meta["spmd_comm"].get("bucket", ()))}


@pytest.mark.gloo
def test_fsdp_fused_program_runs_on_gloo():
    """World 3 (uneven shards) on real gloo: the pair rides in a reduce_scatter bucket, and
    every rank returns the same loss, bit for bit (each sums the ranks' values itself)."""
    results = run_processes(_gloo_fsdp, 3, timeout=300)
    for res in results:
        assert res["err"] < 1e-10, res
        assert res["ops"] == ["bucket"] * 5 and res["riders"] == 1, res
    assert len({tuple(r["losses"]) for r in results}) == 1, [r["losses"] for r in results]
