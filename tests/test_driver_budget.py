"""The memory plan (driver/budget.py, the compile summary): ``compile(memory_budget_gb=...)``
refuses a program whose static peak per rank exceeds the budget at compile time, naming
the peak, its largest contributors and a fix; the compile log states the static peak;
bfloat16 mixed precision and activation checkpointing both lower ``step.memory_trace()``.
Compile-only, on a fake process group (explain mode)."""

from __future__ import annotations

import logging

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler._format import format_bytes
from spmd_compiler.testing import fake_mesh
from spmd_compiler.testing.models import GPT, gpt_fsdp_plan, train_step


def _compiled(monkeypatch, *, checkpoint=None, **options):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=64, dim=32, heads=4, layers=2, checkpoint=checkpoint)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(train_step, mesh=fake_mesh((2,), ("dp",)), plan=gpt_fsdp_plan(), symbolic="none", **options)
    ids = torch.zeros(16, 64, dtype=torch.long)
    step(model, opt, ids, ids)
    return step


def test_a_plan_over_budget_fails_at_compile_with_its_peak_and_a_fix(monkeypatch):
    peak = _compiled(monkeypatch).memory_trace().peak_bytes
    with pytest.raises(sc.MemoryBudgetError) as info:
        _compiled(monkeypatch, memory_budget_gb=peak / 2**30 / 2)
    e, text = info.value, str(info.value)
    assert e.peak_bytes == peak and e.budget_bytes == peak // 2 and e.contributors, text
    assert f"train_step needs {format_bytes(peak)} per rank" in text
    assert "per rank at its static peak (node " in text and "nothing ran" in text
    assert "largest contributors at the peak:" in text and "forward" in text  # activations of this batch
    assert "\n  fix: checkpoint activations: torch.utils.checkpoint" in text  # activations dominate here
    assert _compiled(monkeypatch, memory_budget_gb=peak / 2**30 * 1.01).last.static_peak_bytes == peak


def test_compile_log_states_the_static_peak(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="spmd_compiler.driver.step"):
        step = _compiled(monkeypatch)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled train_step")]
    peak = format_bytes(step.memory_trace().peak_bytes)
    assert lines and lines[-1].endswith(f"collectives, static peak {peak} per rank"), lines


def test_bf16_and_checkpointing_lower_the_memory_trace(monkeypatch):
    bf16 = sc.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    peaks = {name: _compiled(monkeypatch, **kw).memory_trace().peak_bytes for name, kw in {
        "float32": {}, "bf16": {"mixed_precision": bf16}, "checkpoint": {"checkpoint": "full"},
        "both": {"checkpoint": "full", "mixed_precision": bf16}}.items()}
    assert peaks["both"] < peaks["bf16"] < peaks["float32"] and peaks["both"] < peaks["checkpoint"] < peaks["float32"], peaks


def test_budget_is_refused_for_a_pipeline():
    with pytest.raises(ValueError, match=r"memory_budget_gb=10\) is not checked for pipelined steps"):
        sc.compile(train_step, mesh={"pp": 2}, pipeline=sc.Pipeline(chunks=2), memory_budget_gb=10)
