"""The suite's gloo launches: ``run_processes`` with one rerun after a native crash.

A worker killed by a signal before it reports (glibc's heap check aborting inside torch's
C++ code, seen once in about 200 launches of CI, in a test that passed 34 times in a row
here) is most likely torch's own (the code under test runs Python and torch ops only): the
launch runs once more, with a warning in pytest's summary that carries the crash message
(faulthandler printed the worker's Python stacks to stderr). An exception, a wrong number or a timeout is never rerun.
"""

from __future__ import annotations

import warnings
from typing import Any

from spmd_compiler.runtime.launch import WorkerError
from spmd_compiler.runtime.launch import run_processes as _run_processes

__all__ = ["run_processes", "WorkerError"]


def run_processes(fn: Any, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`spmd_compiler.runtime.launch.run_processes`, run again once if a rank crashed."""
    try:
        return _run_processes(fn, world_size, *args, **kwargs)
    except WorkerError as e:
        if not e.crashed:
            raise
        warnings.warn(f"a gloo launch of {getattr(fn, '__qualname__', fn)} crashed natively and runs again: {e}", stacklevel=2)
        return _run_processes(fn, world_size, *args, **kwargs)
