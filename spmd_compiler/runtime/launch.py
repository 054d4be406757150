"""Run a function on N real processes of one machine (gloo on CPU).

For tests, examples and benchmarks; production launches use ``torchrun``. Each worker
initializes the default process group, calls ``fn(rank, world_size, *args)``, and sends
back its return value (picklable) or its traceback. Workers run with one intra-op
thread each.

Workers start from a fork server (``start_method="forkserver"``), never by forking the
caller: on CUDA builds of torch a process that has run autograd once (a fake-mode trace
is enough) has device threads, and every child forked from it fails ("Unable to handle
autograd's threading in combination with fork-based multiprocessing"). The fork server
is a fresh interpreter that imports torch and spmd_compiler once and forks the workers,
so they start about as fast as forked ones. ``fn`` and ``args`` are therefore pickled:
``fn`` must be importable (a module-level function), as with ``spawn``.

A worker killed by a signal (a native crash: glibc's heap checks abort with SIGABRT)
prints every thread's Python stack to stderr (:mod:`faulthandler`), and the
:class:`WorkerError` names the signal and lists the ranks in ``crashed`` (the test
suite reruns such a launch once, with a warning: tests/gloo_launch.py).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_processes", "free_port", "WorkerError"]


class WorkerError(RuntimeError):
    """A worker process raised, crashed or timed out; the message holds its rank and
    traceback. ``crashed``: the ranks killed by a signal before reporting."""

    def __init__(self, message: str, crashed: list[int] | None = None) -> None:
        super().__init__(message)
        self.crashed = list(crashed or [])


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return str(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any], args: tuple, queue: Any, threads: int) -> None:
    try:
        faulthandler.enable(all_threads=True)  # a native crash prints the Python stacks
        torch.set_num_threads(threads)
        if dist.is_initialized():  # inherited from the parent through fork (e.g. a fake group)
            dist.destroy_process_group()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # fn may have destroyed it (as a script's end does)
                dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    start_method: str = "forkserver",
    threads: int = 1,
    timeout: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns results by rank.

    Raises WorkerError with every failing rank's traceback. ``fn`` and ``args`` must
    pickle (``start_method="fork"`` lifts that, and is unsafe once autograd has run on a
    CUDA build of torch).
    """
    if start_method not in ("forkserver", "spawn", "fork"):
        raise ValueError(f"start_method must be 'forkserver', 'spawn' or 'fork', got {start_method!r}")
    if start_method != "fork" and getattr(fn, "__qualname__", "").count("<locals>"):
        raise TypeError(
            f"run_processes needs an importable function to send to its workers, got the local function "
            f"{fn.__qualname__!r}; fix: define it at module level"
        )
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "spmd_compiler"])
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue, threads), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if queue.empty():
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise WorkerError(f"timed out after {timeout:.0f}s waiting for ranks {sorted(set(range(world_size)) - set(results) - set(errors))}")
            if all(not p.is_alive() for p in procs) and queue.empty():
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                crashed = [r for r in missing if (procs[r].exitcode or 0) < 0]
                raise WorkerError(
                    f"ranks {missing} exited without reporting (exit codes {[_exit_text(p.exitcode) for p in procs]}"
                    f"{'; a native crash: its stack is on stderr above' if crashed else ''})", crashed=crashed)
            time.sleep(0.01)
            continue
        rank, status, value = queue.get()
        (results if status == "ok" else errors)[rank] = value
    for p in procs:
        p.join(timeout=30)
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise WorkerError(f"{len(errors)} of {world_size} ranks failed:\n{text}")
    return [results[r] for r in range(world_size)]
