"""runtime/launch.py: a worker that crashes natively is named with its signal, and the
suite's launcher (tests/gloo_launch.py) runs such a launch once more, never a failing one."""

from __future__ import annotations

import os

import pytest

import gloo_launch
from spmd_compiler.runtime.launch import WorkerError, run_processes

pytestmark = pytest.mark.gloo


def _abort_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        os.abort()  # what glibc does when its heap check fails
    return rank


def _abort_first_time(rank: int, world: int, marker: str) -> int:
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    return rank * 10


def _raise(rank: int, world: int, marker: str) -> int:
    with open(marker, "a") as f:
        f.write("x")
    raise RuntimeError("a plain failure")


def test_a_native_crash_names_its_signal_and_rank():
    with pytest.raises(WorkerError, match=r"ranks \[1\] exited without reporting .*SIGABRT.*native crash") as info:
        run_processes(_abort_on_rank1, 2, timeout=120)
    assert info.value.crashed == [1]


def test_the_suite_reruns_a_crashed_launch_once_with_a_warning(tmp_path):
    marker = str(tmp_path / "crashed")
    with pytest.warns(UserWarning, match="crashed natively and runs again"):
        assert gloo_launch.run_processes(_abort_first_time, 2, marker, timeout=120) == [0, 10]


def test_the_suite_never_reruns_an_exception(tmp_path):
    marker = tmp_path / "runs"
    with pytest.raises(WorkerError, match="a plain failure") as info:
        gloo_launch.run_processes(_raise, 2, str(marker), timeout=120)
    assert info.value.crashed == [] and marker.read_text() == "xx"  # one launch of 2 ranks
