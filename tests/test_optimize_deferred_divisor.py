"""defer_mean_divisor (spmd_compiler/optimize/deferred_divisor.py): the backward runs with a
mean cross entropy's count replaced by 1 and each reduced gradient is divided by the count
after its bucket's wait, so the [loss sum, count] pair rides in the first gradient bucket:
a DP step launches exactly its buckets. float64 results equal one device's at 1e-12; the
pass refuses (program unchanged) where a gradient is not provably proportional to 1/count."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.driver.fold import find_fold
from spmd_compiler.optimize import default_passes
from spmd_compiler.optimize.graph_utils import is_collective
from spmd_compiler.testing import assert_training_matches, fake_mesh
from spmd_compiler.testing.models import GPT

PASS = "defer_mean_divisor"


def ce_step(model, optimizer, ids, targets):
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())  # ignore_index -100, mean
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def regularized_step(model, optimizer, ids, targets):
    """A second term whose gradient is not scaled by 1/count: the pass must refuse."""
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()) + 0.01 * (model.head.weight ** 2).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def logit_penalty_step(model, optimizer, ids, targets):
    """A penalty on the (batch-sharded) logits: the logits' gradient adds, on each rank, a
    term scaled by 1/count and one that is not."""
    logits = model(ids).flatten(0, 1)
    loss = F.cross_entropy(logits, targets.flatten()) + 0.01 * (logits ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def clipped_step(model, optimizer, ids, targets):
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # a norm of the divided gradients
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _batch(i: int, rows: int, vocab: int = 32, seq: int = 8):
    g = torch.Generator().manual_seed(300 + i)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    targets = ids.roll(-1, 1)
    targets[: rows // 2, seq // 2 + i % 3:] = -100  # ranks count different numbers of targets
    targets[0] = -100  # rank 0's first row: every target ignored
    return ids, targets


def _passes(*off: str):
    """Small buckets: this GPT's ~10 KB of gradients make 2 buckets."""
    return [p for p in default_passes(bucket_mb=0.02, first_bucket_mb=0.01) if p.name not in off]


def _run(fn, world: int, *off: str, steps: int = 3):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double()
    batches = [_batch(i, 2 * world) for i in range(steps)]
    res = assert_training_matches(fn, model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), batches,
                                  fake_mesh((world,), ("dp",)), passes=_passes(*off), atol=1e-12, rtol=0)
    gm = res.sim.expansions[(0,)].gm
    return res, gm, [n for n in gm.graph.nodes if is_collective(n)]


def _ops(colls):
    return [n.meta["spmd_comm"].get("op") for n in colls]


@pytest.mark.parametrize("world", [2, 3])
def test_dp_gpt_launches_equal_buckets_and_matches_one_device(world):
    res, gm, colls = _run(ce_step, world)
    assert _ops(colls) == ["bucket", "bucket"], _ops(colls)  # no standalone collective: launches == buckets
    first = colls[0]
    riders = [m for m in first.meta["spmd_comm"]["bucket"] if m.get("rider")]
    assert len(riders) == 1 and "pair" in riders[0].get("value", "") + str(riders[0]), riders  # the [loss sum, count] pair
    assert not any(m.get("rider") for m in colls[1].meta["spmd_comm"]["bucket"])
    divisions = [n for n in gm.graph.nodes if (n.meta.get("spmd_origin") or {}).get("op") == PASS and n.target is torch.ops.aten.div.Tensor]
    assert len(divisions) == sum(len(c.meta["spmd_comm"]["bucket"]) for c in colls) - 1  # every gradient, not the pair
    point = find_fold(gm, world_size=world)  # the per-step check rides on the first bucket
    assert point is not None and point.collective == first.name
    _, _, before = _run(ce_step, world, PASS, steps=1)
    assert _ops(before) == ["mean_pair", "bucket", "bucket"], _ops(before)


@pytest.mark.parametrize("fn,reason", [(regularized_step, "mixes"), (logit_penalty_step, "mixes")])
def test_mixed_scaling_is_refused(caplog, fn, reason):
    """ce + 0.01 * |w|^2: the head weight's gradient adds a scaled (Partial, reduced first:
    a sum all_reduce keeps the scale) and an unscaled term; ce + a mean of the logits' squares: the logits' gradient does."""
    with caplog.at_level(logging.DEBUG, logger="spmd_compiler.optimize.deferred_divisor"):
        _, gm, colls = _run(fn, 2)
    assert _ops(colls)[0] == "mean_pair" and _ops(colls).count("bucket") == 2, _ops(colls)  # the pair stands alone
    assert not any((n.meta.get("spmd_origin") or {}).get("op") == PASS for n in gm.graph.nodes)
    reasons = [r.getMessage() for r in caplog.records if "left as it is" in r.getMessage()]
    assert reasons and all(reason in m for m in reasons), reasons


def test_clip_grad_norm_sees_the_divided_gradients():
    res, gm, colls = _run(clipped_step, 3)
    assert _ops(colls) == ["bucket", "bucket"], _ops(colls)


WINDOW = 2


def accumulating_step(model, optimizer, ids, targets, do_step):
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()) / WINDOW
    loss.backward()
    if do_step:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def test_defer_grad_sync_accumulation_is_refused(caplog):
    """Calls that accumulate keep local gradients across calls (each call has its own count):
    the program stays as it was, and the window matches one device."""
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double()
    batches = [(*_batch(i, 4), i % WINDOW == WINDOW - 1) for i in range(2 * WINDOW)]
    with caplog.at_level(logging.DEBUG, logger="spmd_compiler.optimize.deferred_divisor"):
        res = assert_training_matches(accumulating_step, model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), batches,
                                      fake_mesh((2,), ("dp",)), sc.Plan(defer_grad_sync=True), passes=_passes(), atol=1e-12, rtol=0)
    programs = list(res.sim.expansions.values())
    assert programs
    for step in programs:
        ops = _ops([n for n in step.gm.graph.nodes if is_collective(n)])
        assert ops[0] == "mean_pair", ops
    assert not any(n.meta.get("spmd_origin", {}).get("op") == PASS for s in programs for n in s.gm.graph.nodes)
    assert any("left as it is" in r.getMessage() for r in caplog.records)


def two_losses_step(model, optimizer, ids, targets):
    logits = model(ids).flatten(0, 1)
    loss = F.cross_entropy(logits, targets.flatten()) + F.cross_entropy(logits, targets.flatten(), label_smoothing=0.1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_two_losses_are_refused():
    _, gm, colls = _run(two_losses_step, 2, steps=2)
    assert not any((n.meta.get("spmd_origin") or {}).get("op") == PASS for n in gm.graph.nodes)
    assert len(colls) > 2, _ops(colls)


def weighted_step(model, optimizer, ids, targets):
    weight = torch.linspace(0.5, 1.5, 32, dtype=torch.float64)
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), weight=weight)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_class_weights_are_refused():
    """With class weights, a zero weight sum makes one device's gradients NaN, which no
    division after the reduction reproduces: the pass keeps the program."""
    _, gm, colls = _run(weighted_step, 2, steps=2)
    assert not any((n.meta.get("spmd_origin") or {}).get("op") == PASS for n in gm.graph.nodes)
    assert _ops(colls)[0] == "mean_pair", _ops(colls)


def test_every_target_ignored_leaves_zero_gradients_as_one_device():
    """C = 0: one device's loss is NaN and its gradients exactly 0 (nll_loss_backward writes
    nothing); the deferred division divides by 1 there instead of 0/0 = NaN."""
    assert_all_ignored_matches_one_device(GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double(), fake_mesh((2,), ("dp",)),
                                          rows=4, ignored_at=1)


def assert_all_ignored_matches_one_device(model, mesh, plan=None, *, rows: int, ignored_at: int) -> None:
    """3 steps of ``ce_step`` in the simulator and on one device, every target of step
    ``ignored_at`` ignored: the same loss (NaN there), finite parameters equal at 1e-12,
    and the pass applied."""
    import copy

    from spmd_compiler.testing import SimulatedTraining

    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    opt, ref_opt = make(model), make(ref)
    sim = SimulatedTraining(ce_step, model, opt, mesh, plan, passes=_passes())
    for i in range(3):
        ids, targets = _batch(i, rows)
        if i == ignored_at:
            targets[:] = -100
        loss, want = sim.step(ids, targets), ce_step(ref, ref_opt, ids, targets)
        assert torch.isnan(want) == torch.isnan(loss) and (torch.isnan(want) or abs(loss - want) <= 1e-12), (i, loss, want)
        for p, q in zip(model.parameters(), ref.parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            assert torch.isfinite(full).all() and torch.allclose(full, q, rtol=0, atol=1e-12), i
    assert any((n.meta.get("spmd_origin") or {}).get("op") == PASS for n in next(iter(sim.expansions.values())).gm.graph.nodes)


def _autocast_step(dtype):
    def step(model, optimizer, ids, targets):
        with torch.autocast("cpu", dtype=dtype):
            logits = model(ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("dtype,applied", [(torch.float16, False), (torch.bfloat16, True)], ids=["fp16", "bf16"])
def test_float16_autocast_is_refused_bfloat16_is_not(caplog, dtype, applied):
    """Unscaled, a weight gradient is count times one device's: summed over many targets it
    can pass float16's 65504 where one device's does not. float16 autocast keeps the pair
    apart; bfloat16 (float32's range) does not need to."""
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1)
    batches = [tuple(t for t in _batch(i, 4)) for i in range(2)]
    with caplog.at_level(logging.DEBUG, logger="spmd_compiler.optimize.deferred_divisor"):
        res = assert_training_matches(_autocast_step(dtype), model, lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                      fake_mesh((2,), ("dp",)), passes=_passes(), atol=5e-3, rtol=5e-2)
    ops = _ops([n for n in res.sim.expansions[(0,)].gm.graph.nodes if is_collective(n)])
    assert ("mean_pair" not in ops) == applied, ops
    if not applied:
        assert any("float16" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def mlp_ce_step(model, optimizer, x, targets):
    loss = F.cross_entropy(model(x), targets)  # (B, C) logits: no flatten, uneven rows stay sharded
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _mlp_batch(i: int, rows: int):
    g = torch.Generator().manual_seed(500 + i)
    x = torch.randn(rows, 8, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 6, (rows,), generator=g)
    targets[: rows // 2 + i % 2] = -100  # the first ranks' rows all ignored on some steps: counts differ per rank
    return x, targets


@pytest.mark.parametrize("dynamic", [True, False], ids=["symbolic", "per-shape"])
def test_uneven_and_symbolic_batches_launch_buckets_and_match_one_device(dynamic):
    """Batches of 7, 4 and 5 rows over 3 ranks: uneven shards (the ranks' programs differ in
    sizes) and, with ``dynamic=True``, one program for every size (symbolic sizes). The
    argument does not depend on sizes: the pair rides in the first bucket, and float64
    results equal one device's at 1e-12. (Per shape, the GPT's flatten of an uneven batch
    gathers it, so the per-rank sizes are an MLP's.)"""
    if dynamic:
        fn, model, batches = ce_step, GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double(), [_batch(i, r) for i, r in enumerate((7, 4, 5))]
    else:
        from spmd_compiler.testing.models import MLP

        torch.manual_seed(0)
        fn, model, batches = mlp_ce_step, MLP(8, 16, 6).double(), [_mlp_batch(i, r) for i, r in enumerate((7, 4, 5))]
    res = assert_training_matches(fn, model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), batches,
                                  fake_mesh((3,), ("dp",)), passes=_passes(), atol=1e-12, rtol=0, dynamic=dynamic)
    programs = list(res.sim.expansions.values())
    assert programs
    for step in programs:
        ops = _ops([n for n in step.gm.graph.nodes if is_collective(n)])
        assert ops and set(ops) == {"bucket"}, ops  # the pair rides: launches == buckets
        assert any((n.meta.get("spmd_origin") or {}).get("op") == PASS for n in step.gm.graph.nodes)
    if dynamic:  # no size recompiles (momentum's state exists before the first trace): one program
        assert res.sim.compiles == 1, res.sim.reasons
