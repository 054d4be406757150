"""Every rank runs the same program every step, or every rank stops with the reason
(real gloo processes, 2 ranks; each case must end within a minute).

Tolerance: float64, 1e-10 on losses and parameters against one device.
"""

from __future__ import annotations

import copy
import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist

import spmd_compiler as sc
from spmd_compiler.runtime.launch import WorkerError, run_processes
from spmd_compiler.testing import assert_distributed
from spmd_compiler.testing.models import MLP
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


def _cases(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    # 1. partial last batch and per-rank divergent shapes: (rows on rank 0, rows on rank 1) per step
    splits = [(4, 4), (4, 3), (4, 4), (4, 3), (4, 4)]
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step = sc.compile(mse_step, mesh=(world,), cache_size=2)
    errs = []
    for i, split in enumerate(splits):
        x, y = _rows(i, sum(split))
        mine = slice(sum(split[:rank]), sum(split[: rank + 1]))
        loss = step(model, opt, x[mine], y[mine])
        assert_distributed(step, sharded=["batch[0]", "batch[1]"], collectives=1)
        errs.append(abs(loss.item() - mse_step(ref, ref_opt, x, y).item()))
    errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    out["uneven_error"], out["compiles"] = max(errs), step.compiles
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
        # (4,4) without optimizer state, then (4,3) and (4,4) with it; later calls reuse those two
        assert r["compiles"] == 3, r
        assert r["layout"].startswith("ValueError") and "coordinate 0: 3, coordinate 1: 4" in r["layout"] and "drop_last" in r["layout"], r


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


def _killed_peer(rank: int, world: int, report: str) -> None:
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
        step(model, opt, x[:4], y[:4])
        text = "no error"
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {e}"
    pathlib.Path(report).write_text(f"{time.monotonic() - start:.1f}\n{text}")
    os._exit(0)  # the group cannot be torn down cleanly without its peer


def test_killed_peer_is_named_on_the_survivor(tmp_path):
    report = tmp_path / "rank0.txt"
    with pytest.raises(WorkerError):
        run_processes(_killed_peer, 2, str(report), timeout=90)
    seconds, text = report.read_text().split("\n", 1)
    assert float(seconds) < 60, seconds
    assert text.startswith("CollectiveError"), text
    assert "'mse_train_step'" in text and "rank(s) [1] did not report" in text and "fix:" in text, text
