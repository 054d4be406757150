"""A collective that fails (spmd_compiler/driver/failure.py): the roll call through the
rendezvous store names the dead rank as dead and a live rank blocked in the collective as
alive, never a live rank 0 as possibly dead (real gloo processes, 3 ranks)."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch

import spmd_compiler as sc
from gloo_launch import WorkerError, run_processes
from spmd_compiler.testing.models import MLP, mse_train_step

pytestmark = pytest.mark.gloo


def _late_survivor(rank: int, world: int, folder: str) -> None:
    """Rank 2 dies between steps; rank 1 comes to the next step 3 seconds late. In the
    ring all_reduce rank 1 fails at once (its neighbour is dead) while rank 0 waits for
    rank 1's data: rank 0 fails only when rank 1's process ends, after rank 1's roll call,
    which used to name it with the dead ("rank(s) [0, 2] did not report")."""
    torch.manual_seed(0)
    model = MLP().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(mse_train_step, mesh=(world,), timeout=30)
    torch.manual_seed(1 + rank)  # each rank its own rows
    x = torch.randn(4, 16, dtype=torch.float64)
    step(model, opt, x, x)
    if rank == 2:
        os._exit(3)
    if rank == 1:
        time.sleep(3)
    try:
        step(model, opt, x, x)
        text = "no error"
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {e}"
    pathlib.Path(folder, f"rank{rank}.txt").write_text(text)
    os._exit(0)  # the group cannot be torn down cleanly without its peer


def test_a_live_rank_0_is_not_named_as_possibly_dead(tmp_path):
    with pytest.raises(WorkerError):
        run_processes(_late_survivor, 3, str(tmp_path), timeout=120)
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert text.startswith("CollectiveError"), (rank, text)
        assert "rank(s) [2] did not report within 5s and their heartbeat stopped (dead, or hung)" in text, (rank, text)
        assert "may be the rank that died" not in text and "[0, 2]" not in text, (rank, text)
    # rank 1 reported before rank 0 could: rank 0 is named, as alive
    text = (tmp_path / "rank1.txt").read_text()
    assert "rank(s) [0] are alive (their heartbeat goes on) but did not report: blocked in a collective" in text, text
