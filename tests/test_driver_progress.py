"""Progress lines of a compile (driver/progress.py): on rank 0, with no logging set up,
a line per stage and a summary with the collectives and the static peak; silent for a
compile shorter than the threshold, off or verbose by ``compile(progress=...)`` or
``SPMD_COMPILER_LOGS``. Compile-only, on a fake process group (explain mode)."""

from __future__ import annotations

import io
import re
import time

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.driver import progress as pg
from spmd_compiler.testing import fake_mesh
from spmd_compiler.testing.models import GPT, gpt_fsdp_plan, train_step


def _compile(monkeypatch, **options):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, dim=32, heads=4, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = sc.compile(train_step, mesh=fake_mesh((4,), ("dp",)), plan=gpt_fsdp_plan(), symbolic="none", **options)
    ids = torch.zeros(8, 16, dtype=torch.long)
    step(model, opt, ids, ids)
    step(model, opt, ids, ids)
    return step


def _lines(text: str) -> list[str]:
    return [line.removeprefix(pg.PREFIX + " ") for line in text.splitlines() if line.startswith(pg.PREFIX)]


def test_verbose_prints_every_stage_and_a_summary_once(monkeypatch, capsys):
    step = _compile(monkeypatch, progress="verbose")
    lines = _lines(capsys.readouterr().err)
    assert step.compiles == 1  # AdamW's state is created before the trace: one compile, one block of lines
    assert lines[0] == "compiling train_step for 4 ranks (dp=4): first call", lines
    stages = [line.split()[0] for line in lines[1:-1] if not line.startswith("    pass ")]
    assert stages == ["trace", "expand", "passes"], lines
    assert any(line.startswith("    pass ") for line in lines), lines  # verbose: one line per pass
    assert re.fullmatch(r"  trace +\d+\.\d\d s   [\d,]+ nodes", lines[1]), lines[1]
    comm = step.comm_summary()
    peak = sc._format.format_bytes(step.memory_trace().peak_bytes)
    assert lines[-1].startswith("compiled train_step in ") and f": {comm.total_count} collectives per step (" in lines[-1], lines
    assert "all_gather" in lines[-1] and "reduce_scatter" in lines[-1] and lines[-1].endswith(f"static peak {peak} per rank"), lines


def test_off_by_option_and_by_environment(monkeypatch, capsys):
    _compile(monkeypatch, progress=False)
    assert _lines(capsys.readouterr().err) == []
    monkeypatch.setenv("SPMD_COMPILER_LOGS", "-progress")
    monkeypatch.setattr(pg, "THRESHOLD", 0.0)
    _compile(monkeypatch)
    assert _lines(capsys.readouterr().err) == []


def test_default_shows_a_compile_longer_than_the_threshold_only(monkeypatch, capsys):
    monkeypatch.setattr(pg, "THRESHOLD", 1e9)  # never reached: a quick compile prints nothing
    _compile(monkeypatch)
    assert _lines(capsys.readouterr().err) == []
    monkeypatch.setattr(pg, "THRESHOLD", 0.0)
    _compile(monkeypatch)
    lines = _lines(capsys.readouterr().err)
    assert lines[0].startswith("compiling train_step") and lines[-1].startswith("compiled train_step"), lines
    assert not any(line.startswith("    pass ") for line in lines), lines  # per-pass lines only when verbose


def test_the_first_line_appears_while_the_compile_still_runs():
    out = io.StringIO()
    p = pg.Progress("compiling slow_step", "on", out=out, threshold=0.05)
    p.stage("trace", 0.01)  # held: under the threshold
    assert out.getvalue() == ""
    deadline = time.monotonic() + 5
    while "compiling slow_step" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _lines(out.getvalue()) == ["compiling slow_step", "  trace        0.01 s"]  # by the timer, held line after it
    p.stage("expand", 1.5, "10 nodes")
    p.finish("compiled slow_step")
    assert _lines(out.getvalue())[-2:] == ["  expand       1.50 s   10 nodes", "compiled slow_step"]


def test_a_quick_compile_prints_nothing_at_all():
    out = io.StringIO()
    p = pg.Progress("compiling quick_step", "on", out=out, threshold=5.0)
    p.stage("trace", 0.01)
    p.finish("compiled quick_step")
    time.sleep(0.01)
    assert out.getvalue() == "" and p.lines == ["  trace        0.01 s", "compiled quick_step"]


@pytest.mark.parametrize("option, env, mode", [
    (None, "", "on"), (None, "-progress", "off"), (None, "+progress", "verbose"), (None, "+all", "verbose"),
    (None, "other,-progress", "off"), (True, "-progress", "on"), (False, "", "off"), ("verbose", "-progress", "verbose"),
])
def test_mode_from_option_then_environment(option, env, mode):
    assert pg.progress_mode(option, env=env) == mode


def test_a_bad_option_is_refused_at_compile():
    with pytest.raises(ValueError, match=r"progress='loud'.*expected True, False, 'verbose' or None"):
        sc.compile(train_step, mesh=(2,), progress="loud")


def test_backend_line_in_the_mode_of_the_running_call():
    out = io.StringIO()
    pg.backend_done("inductor: seg0", 9.0, out=out)  # outside a call: nothing
    with pg.running("on"):
        pg.backend_done("inductor: seg0", 0.5, out=out)  # under the threshold: nothing
        pg.backend_done("inductor: seg1", 9.0, out=out)
    with pg.running("verbose"):
        pg.backend_done("inductor: seg2", 0.5, out=out)
    assert _lines(out.getvalue()) == ["  backend      9.00 s   inductor: seg1", "  backend      0.50 s   inductor: seg2"]
