"""The per-rank runner (spmd_compiler/runtime/executor.py) computes exactly what the
GraphModule computes, with values freed after their last use."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import spmd_compiler as sc
from spmd_compiler.testing.simulate import example_inputs
from spmd_compiler.optimize import default_passes, run_passes
from spmd_compiler.runtime.executor import compile_runner
from spmd_compiler.testing.models import GPT, gpt_fsdp_plan, gpt_tp_plan, train_step


@pytest.mark.parametrize("plan", ["dp", "fsdp", "tp"])
def test_runner_matches_graph_module(mesh4, plan):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 32, (8, 8))
    train_step(model, opt, ids, ids)
    traced = sc.trace(train_step, model, opt, ids, ids)
    plans = {"dp": sc.Plan(), "fsdp": gpt_fsdp_plan(), "tp": gpt_tp_plan()}
    step = sc.expand(traced, mesh4, plans[plan])
    gm, _ = run_passes(step.gm, default_passes())
    run = compile_runner(gm)
    a, b = example_inputs(gm, 0), example_inputs(gm, 0)  # the step updates state in place: one copy each
    with torch.no_grad():
        want, got = gm(*a), run(*b)
    assert len(want) == len(got)
    for x, y in zip(want, got):
        assert torch.equal(x, y)
    for x, y in zip(a, b):  # the in-place updates of parameters and optimizer state too
        assert (x == y) if not isinstance(x, torch.Tensor) else torch.equal(x, y)
    assert "del " in run.source  # intermediates are freed after their last use


def test_constants_that_are_not_literals():
    def f(x):
        y = torch.ops.aten.full.default([2], float("-inf"), dtype=torch.float64)
        return [torch.ops.aten.maximum.default(torch.ops.aten._to_copy.default(x, dtype=torch.float64), y), torch.ops.aten.add.Tensor(x, 1)]

    gm = fx.symbolic_trace(lambda x: f(x))
    run = compile_runner(gm)
    x = torch.tensor([1.0, -2.0])
    for p, q in zip(gm(x), run(x)):
        assert torch.equal(p, q)


def test_compiled_step_uses_the_runner(mesh4):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(train_step, mesh=mesh4)
    ids = torch.randint(0, 32, (2, 8))
    step(model, opt, ids, ids)
    assert callable(step.last.runner) and "def run(" in step.last.runner.source


def test_guarded_runner_checks_before_the_first_effect():
    """The step guard's check runs right before the first collective / write / random op,
    and a Resync raised there leaves the inputs untouched."""
    from spmd_compiler.driver.guard import Resync, first_effect

    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    w = g.call_function(torch.ops.aten.add_.Tensor, (x, y))
    g.output([w])
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert first_effect(gm) is w
    run = compile_runner(gm, guard=True, check_before=first_effect(gm))
    lines = run.source.splitlines()
    assert lines.index("    _check()") == next(i for i, line in enumerate(lines) if "add_" in line) - 1, run.source
    t = torch.ones(3)

    def resync() -> None:
        raise Resync()

    with pytest.raises(Resync):
        run(t, _check=resync)
    assert torch.equal(t, torch.ones(3))  # nothing was written
    run(t, _check=lambda: None)
    assert torch.equal(t, torch.full((3,), 3.0))
