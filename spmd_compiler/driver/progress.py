"""Progress of a compile, on rank 0, with no logging set up by the user.

A compile that takes more than a couple of seconds says so while it runs: one line when
it starts (printed once it has run for ``THRESHOLD`` seconds, so fast compiles stay
silent), one line per stage as it ends (trace, expand, passes, backend) and a last line
with the collectives per step and the static peak per rank::

    spmd_compiler: compiling train_step on 4 ranks (dp=4): first call
    spmd_compiler:   trace      3.10 s   1,204 nodes
    spmd_compiler:   expand     2.02 s
    spmd_compiler:   passes     0.81 s
    spmd_compiler: compiled train_step in 6.0 s: 8 collectives per step (all_reduce 8), 1.2 MiB per rank; static peak 45.1 MiB per rank

Lines go to stderr, on rank 0 only (every rank compiles the same program). The mode
comes from ``compile(progress=...)`` or, when that is left ``None``, from the
environment variable ``SPMD_COMPILER_LOGS`` in the style of ``TORCH_LOGS``: a comma
separated list where ``-progress`` turns the lines off, ``+progress`` makes them verbose
(every compile, however short, and one line per optimization pass), and ``progress`` is
the default.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

import torch.distributed as dist

__all__ = ["Progress", "progress_mode", "compiling", "stage_done", "current", "header_line", "summary_line", "running", "backend_done"]

THRESHOLD = 2.0  # seconds a compile runs before its lines appear (verbose: 0)
PREFIX = "spmd_compiler:"
_MODES = ("off", "on", "verbose")
_current: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("spmd_compiler_progress", default=None)
_running: contextvars.ContextVar[str] = contextvars.ContextVar("spmd_compiler_progress_run", default="off")


def progress_mode(option: Any = None, env: str | None = None) -> str:
    """``"off"``, ``"on"`` or ``"verbose"`` from ``compile(progress=...)`` (True, False,
    ``"verbose"`` or None) and ``SPMD_COMPILER_LOGS`` (read when the option is None)."""
    if option is not None:
        if option is True or option == "on":
            return "on"
        if option is False or option == "off":
            return "off"
        if option == "verbose":
            return "verbose"
        raise ValueError(f"compile(progress={option!r}): expected True, False, 'verbose' or None (SPMD_COMPILER_LOGS decides). "
                         f"fix: progress=False to silence the compile's progress lines")
    text = os.environ.get("SPMD_COMPILER_LOGS", "") if env is None else env
    mode = "on"
    for item in (t.strip() for t in text.split(",")):
        if item in ("-progress", "-all"):
            mode = "off"
        elif item in ("+progress", "+all"):
            mode = "verbose"
        elif item in ("progress", "all", ""):
            mode = "on" if item else mode
    return mode


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Progress:
    """The progress lines of one compile (see the module docstring)."""

    def __init__(self, header: str, mode: str, *, out: TextIO | None = None, threshold: float | None = None) -> None:
        assert mode in _MODES, mode
        self.header = header
        self.mode = mode
        self.out = out
        self.threshold = 0.0 if mode == "verbose" else THRESHOLD if threshold is None else threshold
        self.start = time.perf_counter()
        self.lines: list[str] = []  # every line, printed or not (tests read them)
        self._held: list[str] = []  # lines waiting for the threshold
        self._shown = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        if mode != "off" and self.threshold > 0:
            self._timer = threading.Timer(self.threshold, self._due)
            self._timer.daemon = True
            self._timer.start()

    @property
    def verbose(self) -> bool:
        return self.mode == "verbose"

    def _write(self, lines: list[str]) -> None:
        out = self.out if self.out is not None else sys.stderr
        out.write("".join(f"{PREFIX} {line}\n" for line in lines))
        out.flush()

    def _due(self) -> None:
        """The threshold passed: the header and the lines so far are printed."""
        with self._lock:
            if not self._shown and self.mode != "off":
                self._shown = True
                self._write([self.header, *self._held])
                self._held = []

    def line(self, text: str) -> None:
        """One line: printed now if the compile already shows, else held for the threshold."""
        self.lines.append(text)
        if self.mode == "off":
            return
        if time.perf_counter() - self.start >= self.threshold:
            self._due()
        with self._lock:
            if self._shown:
                self._write([text])
            else:
                self._held.append(text)

    def stage(self, name: str, seconds: float, detail: str = "") -> None:
        """A stage ended (``trace``, ``expand``, ``passes``, ``backend ...``)."""
        self.line(f"  {name:<10} {seconds:6.2f} s{('   ' + detail) if detail else ''}")

    def finish(self, text: str) -> None:
        """The last line; nothing is printed for a compile that stayed under the threshold."""
        if self._timer is not None:
            self._timer.cancel()
        self.lines.append(text)
        with self._lock:
            if self._shown:
                self._write([text])
            self._held = []

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def header_line(name: str, mesh: Any, reason: str) -> str:
    """The first line: the step, the mesh and why it compiles."""
    names = mesh.mesh_dim_names or [str(i) for i in range(mesh.ndim)]
    axes = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))
    return f"compiling {name} for {mesh.size()} ranks ({axes}): {reason}"


def summary_line(name: str, seconds: float, step: Any) -> str:
    """The last line: the collectives per step and the static peak per rank."""
    from .._format import format_bytes
    from ..dump.summary import comm_summary

    comm = comm_summary(step.gm)
    kinds: dict[str, int] = {}
    for r in comm.rows:
        kinds[r.kind] = kinds.get(r.kind, 0) + r.count
    what = f" ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})" if kinds else ""
    peak = getattr(step, "static_peak_bytes", None)
    return (f"compiled {name} in {seconds:.1f} s: {comm.total_count} collectives per step{what}, "
            f"{format_bytes(comm.total_bytes)} per rank" + (f"; static peak {format_bytes(peak)} per rank" if peak else ""))


def current() -> Progress | None:
    """The progress of the compile running in this context (None outside one)."""
    return _current.get()


def stage_done(name: str, seconds: float, detail: str = "") -> None:
    """Report the end of a stage of the running compile (a no-op outside one)."""
    p = _current.get()
    if p is not None:
        p.stage(name, seconds, detail)


@contextlib.contextmanager
def compiling(header: str, mode: str) -> Iterator[Progress | None]:
    """Context of one compile: its :class:`Progress` on rank 0 (None elsewhere, or off)."""
    if mode == "off" or not _is_rank0():
        token = _current.set(None)
        try:
            yield None
        finally:
            _current.reset(token)
        return
    p = Progress(header, mode)
    token = _current.set(p)
    try:
        yield p
    finally:
        p.close()
        _current.reset(token)


@contextlib.contextmanager
def running(mode: str) -> Iterator[None]:
    """Context of a call of a compiled program: a backend compiling on its first run
    (inductor) reports with :func:`backend_done` in this mode."""
    token = _running.set(mode)
    try:
        yield
    finally:
        _running.reset(token)


def backend_done(text: str, seconds: float, *, out: TextIO | None = None) -> None:
    """A backend compile ended during a call (one line on rank 0, if it took longer than
    the threshold or the mode is verbose)."""
    mode = _running.get()
    if mode == "off" or not _is_rank0() or (mode == "on" and seconds < THRESHOLD):
        return
    out = out if out is not None else sys.stderr
    out.write(f"{PREFIX}   backend    {seconds:6.2f} s   {text}\n")
    out.flush()
