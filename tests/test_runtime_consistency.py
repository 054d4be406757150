"""Every rank runs the same program every step, or every rank stops with the reason
(real gloo processes, 2 ranks, and 4 on a 2 x 2 mesh; each case must end within a minute).

Tolerance: float64, 1e-10 on losses and parameters against one device.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist

import spmd_compiler as sc
from gloo_launch import WorkerError, run_processes
from spmd_compiler.testing import assert_distributed
from spmd_compiler.testing.models import MLP, megatron_mlp_plan
from spmd_compiler.testing.models import accumulating_mse_step as accumulating_step
from spmd_compiler.testing.models import mse_train_step as mse_step

pytestmark = pytest.mark.gloo


def extra_step(model, optimizer, x, y, extra):
    loss = torch.nn.functional.mse_loss(model(x), y) + 0.0 * extra.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def interrupted_step(model, optimizer, x, y):
    if dist.get_rank() == 1:
        raise KeyboardInterrupt("simulated Ctrl-C on rank 1 while compiling")
    return mse_step(model, optimizer, x, y)


def _rows(i: int, n: int):
    g = torch.Generator().manual_seed(10 + i)
    return torch.randn(n, 16, dtype=torch.float64, generator=g), torch.randn(n, 16, dtype=torch.float64, generator=g)


def _error(fn) -> str:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(e).__name__}: {e}"
    return "no error"


def _mlp_pair() -> tuple:
    """A float64 MLP and its one-device copy (same seed), each with SGD with momentum."""
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    return model, ref, *(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))


@contextlib.contextmanager
def _counted_flags():
    """The standalone step checks run inside (three-element int64 all_reduces: flag, program id), counted."""
    flags, real = [], dist.all_reduce

    def spy(tensor, *args, **kwargs):
        if tensor.numel() == 3 and tensor.dtype == torch.int64:
            flags.append(1)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        yield flags
    finally:
        dist.all_reduce = real


def _uneven(rank: int, world: int, fold: bool) -> dict:
    """Partial last batch and per-rank divergent shapes: (rows on rank 0, rows on rank 1)
    per step, then steady steps; the per-step check folded into the program's first
    all_reduce (``fold``) or standalone. Counts the standalone check's all_reduces."""
    splits = [(4, 4), (4, 3), (4, 4), (4, 3), (4, 4), (4, 4), (4, 4)]
    model, ref, opt, ref_opt = _mlp_pair()
    step = sc.compile(mse_step, mesh=(world,), cache_size=2, dynamic=False)  # one program per split: the check's switches
    step.fold_guard = fold
    errs = []
    with _counted_flags() as flags:
        for i, split in enumerate(splits):
            x, y = _rows(i, sum(split))
            mine = slice(sum(split[:rank]), sum(split[: rank + 1]))
            loss = step(model, opt, x[mine], y[mine])
            assert_distributed(step, sharded=["batch[0]", "batch[1]"], collectives=1)
            errs.append(abs(loss.item() - mse_step(ref, ref_opt, x, y).item()))
    errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    folded = getattr(step.last, "folded_gm", None)
    count = lambda gm: sum(1 for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "_c10d_functional")  # noqa: E731
    kinds = sorted(getattr(getattr(p.step, "fold_point", None), "kind", "none") for p in step._programs.values())
    return {"error": max(errs), "compiles": step.compiles, "checks": dict(step.checks), "flag_all_reduces": len(flags), "kinds": kinds,
            "collectives": (count(step.last.gm), count(folded) if folded is not None else None)}


def _dropout_rng(rank: int, world: int, fold: bool) -> tuple:
    """The CPU RNG state after the uneven steps of a model whose dropout runs before the
    step's first collective (the folded check restores the RNG when it resyncs)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.25), torch.nn.Linear(32, 16)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(mse_step, mesh=(world,), cache_size=2, dynamic=False)  # one program per split: the check's switches
    step.fold_guard = fold
    for i, split in enumerate([(4, 4), (4, 3), (4, 4), (4, 4)]):
        x, y = _rows(i, sum(split))
        mine = slice(sum(split[:rank]), sum(split[: rank + 1]))
        step(model, opt, x[mine], y[mine])
    return torch.get_rng_state(), dict(step.checks), getattr(step.last, "fold_point", "unset")


def _split_switch(rank: int, world: int, defer: bool) -> dict:
    """Gradient accumulation (windows of 3 calls) switches program without exchanging
    signatures (driver/step.py, _switch_target); then, at a window's second call, rank 0
    accumulates and rank 1 steps: each picks a cached program, their ids differ, and every
    rank must stop before either program changes anything (by default both programs' checks
    ride on their first bucket; with defer_grad_sync the stepping program's is standalone,
    so rank 1 joins the accumulating program's fold naming it)."""
    torch.manual_seed(0)
    model = MLP().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = sc.compile(accumulating_step, mesh=(world,), plan=sc.Plan(defer_grad_sync=defer))
    mine = slice(4 * rank, 4 * rank + 4)
    for i in range(7):  # two windows (the first compiles its 3 programs), and the next window's first call
        x, y = _rows(i, 8)
        step(model, opt, x[mine], y[mine], i % 3 == 2)
    state = [t.to_local().clone() for p in model.parameters() for t in (p, p.grad)]
    checks = dict(step.checks)
    x, y = _rows(7, 8)
    text = _error(lambda: step(model, opt, x[mine], y[mine], rank == 1))
    unchanged = all(torch.equal(a, t.to_local()) for a, t in zip(state, (t for p in model.parameters() for t in (p, p.grad))))
    return {"text": text, "unchanged": unchanged, "switched": checks.get("switched (folded)", 0) + checks.get("switched (standalone)", 0),
            "resyncs": sum(v - checks.get(k, 0) for k, v in step.checks.items() if k.startswith("resync")), "compiles": step.compiles}


def _cases(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    out["split_switch"] = {defer: _split_switch(rank, world, defer) for defer in (False, True)}
    # 1. partial last batch and per-rank divergent shapes, the check folded or standalone
    out["folded"], out["standalone"] = _uneven(rank, world, True), _uneven(rank, world, False)
    (rng_f, checks_f, point), (rng_s, checks_s, _) = _dropout_rng(rank, world, True), _dropout_rng(rank, world, False)
    out["dropout"] = {"same_rng": torch.equal(rng_f, rng_s), "checks": (checks_f, checks_s), "fold_point": point}
    out["uneven_error"], out["compiles"] = out["folded"]["error"], out["folded"]["compiles"]
    model = MLP().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = sc.compile(mse_step, mesh=(world,), cache_size=2)
    for i in range(2):  # steady: the next call's rank 1 runs the agreed program, rank 0 does not
        step(model, opt, *_rows(i + 2 * rank, 4))  # each rank its own rows (the same on every rank: a global batch, refused)
    # a split that is not torch.chunk's layout (3 rows on rank 0, 4 on rank 1): refused on every rank
    x, y = _rows(9, 7)
    mine = slice(0, 3) if rank == 0 else slice(3, 7)
    out["layout"] = _error(lambda: step(model, opt, x[mine], y[mine]))
    # 2. an unsharded dim that differs between ranks: refused on every rank
    step = sc.compile(extra_step, mesh=(world,))
    x, y = _rows(0, 8)
    extra = torch.zeros(4, 3 + rank)
    out["unsharded"] = _error(lambda: step(model, opt, x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4], extra))
    # 3. a dump that fails on rank 0 only (its dump folder is a file): every rank raises
    blocker = pathlib.Path(tmp) / "not_a_folder"
    blocker.write_text("x")
    step = sc.compile(mse_step, mesh=(world,), dump_dir=str(blocker))
    out["dump"] = _error(lambda: step(model, opt, x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4]))
    # 4. an interrupt on rank 1 during compile
    step = sc.compile(interrupted_step, mesh=(world,))
    out["interrupt"] = _error(lambda: step(model, opt, x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4]))
    # and the process group still works for the next step
    step = sc.compile(mse_step, mesh=(world,))
    out["after"] = float(step(model, opt, x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4]))
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    start = time.monotonic()
    results = run_processes(_cases, 2, str(tmp_path_factory.mktemp("consistency")), timeout=120)
    return results, time.monotonic() - start


def test_partial_and_divergent_batches_match_one_device(cases):
    results, seconds = cases
    assert seconds < 60, f"took {seconds:.0f}s"
    for r in results:
        assert r["uneven_error"] < 1e-10, r
        assert r["standalone"]["error"] < 1e-10, r
        # (4,4) and (4,3) (optimizer state exists before the first trace); later calls reuse those two
        assert r["compiles"] == 2, r
        assert r["layout"].startswith("ValueError") and "coordinate 0: 3, coordinate 1: 4" in r["layout"] and "drop_last" in r["layout"], r


def test_check_rides_on_the_first_all_reduce_without_a_round_trip(cases):
    """The first collective carries the check (the MLP's gradient bucket, the loss riding in it; with a 4/3 split
    the all_gather of the row counts): every step after the first went through the folded
    path, the 4 signature changes (the split, back and forth) resynced through it
    (the rank whose shapes changed joined that one collective, the other stopped at the
    check in the program), the training matched one device above, and no standalone flag
    all_reduce was issued; with the fold off, the standalone check issues one per step."""
    for r in cases[0]:
        folded, standalone = r["folded"], r["standalone"]
        assert folded["checks"] == {"folded": 6, "resync (folded)": 4}, folded
        assert folded["kinds"] == ["all_gather", "all_reduce"], folded  # the (4,3) and (4,4) programs kept
        assert folded["flag_all_reduces"] == 0, folded
        plain, variant = folded["collectives"]
        assert plain == variant == 2, folded  # 1 all_reduce (the gradient bucket, the loss riding in it) and its wait: the same with the check folded in
        assert standalone["checks"] == {"standalone": 6, "resync (standalone)": 4}, standalone
        assert standalone["flag_all_reduces"] == 6 and standalone["collectives"][1] is None, standalone


def test_a_program_that_draws_resyncs_through_the_standalone_check(cases):
    """Dropout before the first collective: the program keeps the standalone check (it
    agrees the generators too) even where folding is allowed, stops before the dropout
    when a rank's signature changed, and leaves the RNG where one device would."""
    for r in cases[0]:
        d = r["dropout"]
        assert d["fold_point"] is None and "folded" not in d["checks"][0], d
        assert d["checks"][0]["resync (standalone)"] == 2 and d["checks"][1]["resync (standalone)"] == 2, d
        assert d["same_rng"], d


def test_ranks_switching_to_different_cached_programs_stop_together(cases):
    """Each rank switches program by its own signature, with no exchange: when they pick
    different ones, every rank resyncs before any state changes, and the compile that
    follows refuses the differing graphs on every rank (no hang, nothing computed)."""
    for rank, r in enumerate(cases[0]):
        for defer, d in r["split_switch"].items():
            # the second window's three calls and the third window's first: cached programs, no exchange
            assert d["switched"] == 4, (defer, d)
            assert d["resyncs"] == 1 and d["unchanged"], (defer, d)
            assert d["text"].startswith("RankMismatchError") and "different graph" in d["text"], (defer, d)
            assert d["compiles"] == 3, (defer, d)


def test_differing_unsharded_dim_is_refused_on_every_rank(cases):
    for r in cases[0]:
        assert r["unsharded"].startswith("ValueError") and "only the sharded dims" in r["unsharded"], r["unsharded"]


def test_rank0_only_dump_failure_stops_every_rank(cases):
    rank0, rank1 = (r["dump"] for r in cases[0])
    assert "not_a_folder" in rank0 and rank0 != "no error", rank0
    assert rank1.startswith("RankMismatchError") and "rank 0 failed" in rank1, rank1


def test_interrupt_on_one_rank_stops_every_rank(cases):
    rank0, rank1 = (r["interrupt"] for r in cases[0])
    assert rank1.startswith("KeyboardInterrupt"), rank1
    assert rank0.startswith("RankMismatchError") and "rank 1 failed" in rank0 and "KeyboardInterrupt" in rank0, rank0
    assert cases[0][0]["after"] == cases[0][1]["after"]


def _killed_peer(rank: int, world: int, report: str, rows: int = 4) -> None:
    torch.manual_seed(0)
    model = MLP().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(mse_step, mesh=(world,), timeout=20)
    x, y = _rows(0, 8)
    step(model, opt, x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4])
    if rank == 1:
        os._exit(3)  # dies between steps, as a killed process does
    start = time.monotonic()
    try:
        step(model, opt, x[:rows], y[:rows])  # 3 rows: the survivor's signature changed, it joins only the check's collective
        text = "no error"
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {e}"
    pathlib.Path(report).write_text(f"{time.monotonic() - start:.1f}\n{text}")
    os._exit(0)  # the group cannot be torn down cleanly without its peer


@pytest.mark.parametrize("rows", [4, 3])
def test_killed_peer_is_named_on_the_survivor(tmp_path, rows):
    """The folded check's collective fails like any collective of the step: in the program
    (4 rows: named by its provenance) or joined alone by a rank whose signature changed (3 rows)."""
    report = tmp_path / "rank0.txt"
    with pytest.raises(WorkerError):
        run_processes(_killed_peer, 2, str(report), rows, timeout=90)
    seconds, text = report.read_text().split("\n", 1)
    assert float(seconds) < 60, seconds
    assert text.startswith("CollectiveError"), text
    assert "'mse_train_step'" in text and "rank(s) [1] did not report" in text and "fix:" in text, text
    if rows == 4:
        # the MSE loss's all_reduce rides in the gradient bucket (optimize/bucketing.py)
        assert "in all_reduce on mesh axis 'axis0' of bucket[" in text and "riding along" in text, text
    else:
        assert "the program's first all_reduce" in text and "carries the per-step check" in text, text


# ---------------------------------------------------------------- a 2 x 2 mesh: the check folded per axis


def _mesh2x2(rank: int, world: int) -> dict:
    """dp x tp = 2 x 2 (rank = 2 * dp + tp), the MLP split over tp, the batch over dp: no
    collective spans the 4 ranks, so the check rides on the first collective of each
    axis group (driver/fold.py, FoldChain). Steps whose dp groups get (4, 4) or (4, 3)
    rows (ranks 2 and 3 change shape, ranks 0 and 1 learn it in the dp fold), then a step
    where rank 3 alone gets 3 rows (its tp partner 4: a replicated input that differs)."""
    model, ref, opt, ref_opt = _mlp_pair()
    step = sc.compile(mse_step, mesh={"dp": 2, "tp": 2}, plan=megatron_mlp_plan(ndim=2, axis=1), cache_size=2,
                      dynamic=False)  # one program per split: the folded check's resyncs
    errs = []
    with _counted_flags() as flags:
        for i, split in enumerate([(4, 4), (4, 4), (4, 3), (4, 4), (4, 4)]):
            x, y = _rows(i, sum(split))
            dp = rank // 2
            mine = slice(sum(split[:dp]), sum(split[: dp + 1]))
            loss = step(model, opt, x[mine], y[mine])
            errs.append(abs(loss.item() - mse_step(ref, ref_opt, x, y).item()))
    errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    points = [getattr(getattr(prog.step, "fold_point", None), "points", ()) for prog in step._programs.values()]
    chains = sorted(tuple(f"{q.kind} on {q.world_size}" for q in ps) for ps in points)
    out = {"error": max(errs), "checks": dict(step.checks), "flag_all_reduces": len(flags), "chains": chains}
    x, y = _rows(9, 8)
    rows = 3 if rank == 3 else 4
    lo = 4 * (rank // 2)
    out["rank3_only"] = _error(lambda: step(model, opt, x[lo: lo + rows], y[lo: lo + rows]))
    out["checks_after"] = dict(step.checks)
    return out


@pytest.fixture(scope="module")
def mesh2x2_cases():
    start = time.monotonic()
    results = run_processes(_mesh2x2, 4, timeout=120)
    return results, time.monotonic() - start


def test_2d_check_folds_per_axis_and_resyncs_every_rank(mesh2x2_cases):
    """Every step after the first went through the folded check (no standalone flag
    all_reduce), the 2 signature changes (ranks 2 and 3's rows, there and back; the
    optimizer state exists before the first trace) resynced every rank through it, and
    training matched one device."""
    results, seconds = mesh2x2_cases
    assert seconds < 90, f"took {seconds:.0f}s"
    for r in results:
        assert r["error"] < 1e-10, r
        assert r["checks"] == {"folded": 4, "resync (folded)": 2}, r
        assert r["flag_all_reduces"] == 0, r
        assert all(len(c) == 2 for c in r["chains"]), r  # each kept program: one fold per axis


def test_2d_one_rank_s_different_batch_is_detected_on_every_rank(mesh2x2_cases):
    """Rank 3 alone changes shape: its tp partner (rank 2) reads the flag in the tp fold,
    rank 1 in the dp fold, and rank 0 from rank 2, which raised it again in the dp fold.
    Every rank resyncs (no hang) and refuses the differing replicated rows together."""
    texts = [r["rank3_only"] for r in mesh2x2_cases[0]]
    for r, text in zip(mesh2x2_cases[0], texts):
        assert r["checks_after"]["resync (folded)"] == r["checks"]["resync (folded)"] + 1, r
        assert text != "no error", texts
    assert len({t.split(":")[0] for t in texts}) == 1, texts  # the same error type on every rank
