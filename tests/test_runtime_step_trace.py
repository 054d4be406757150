"""A Chrome/Perfetto trace of one step from a real run (spmd_compiler/runtime/step_trace.py):
2 gloo ranks, a tiny MLP, ``step.trace_step(path)`` and ``SPMD_COMPILER_TRACE``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.runtime.executor import compile_runner
from spmd_compiler.testing.models import MLP, megatron_mlp_plan, mse_train_step

pytestmark = pytest.mark.gloo


def _traced_steps(rank: int, world: int, path: str, env_path: str) -> int:
    torch.manual_seed(0)
    model = MLP(16, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # tensor parallel: a forward all_reduce of the activations, for addmm_1
    step = sc.compile(mse_train_step, mesh=(world,), plan=sc.Plan(params=megatron_mlp_plan().params, default_input=[sc.Replicate()]))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    step(model, opt, x, y)
    step.trace_step(path)  # the next call
    step(model, opt, x, y)
    os.environ["SPMD_COMPILER_TRACE"] = env_path  # the first call that does not compile
    step(model, opt, x, y)
    step(model, opt, x, y)
    return step.compiles


def _check_trace(path: str, world: int) -> None:
    trace = json.load(open(path))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all({"name", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e) or e["tid"] == 0 for e in spans)
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in spans)
    assert {e["pid"] for e in spans} == set(range(world))  # one process per rank
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "collectives"} <= names
    for pid, tid in {(e["pid"], e["tid"]) for e in spans}:  # the spans of one thread nest (Perfetto's rule)
        ivals = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if (e["pid"], e["tid"]) == (pid, tid))
        assert all(b0 >= a1 - 1e-6 or b1 <= a1 + 1e-6 for (a0, a1), (b0, b1) in zip(ivals, ivals[1:]))
    for rank in range(world):
        mine = [e for e in spans if e["pid"] == rank]
        compute = [e for e in mine if e["tid"] == 1]
        comms = [e for e in mine if e["tid"] >= 2]
        assert any(e["name"] in ("aten.mm", "aten.addmm") for e in compute)  # the matmuls, named by op
        (allreduce,) = [e for e in comms if e["name"].startswith("all_reduce")]
        assert "Partial reduced" in allreduce["name"] and "addmm_1" in allreduce["args"]["collective"]  # and why
        assert allreduce["args"]["bytes"] == 8 * 16 * 4
        wait = next(e for e in compute if e["name"].startswith("wait all_reduce"))
        assert allreduce["ts"] <= wait["ts"] and allreduce["ts"] + allreduce["dur"] >= wait["ts"] + wait["dur"] - 1e-3


def test_trace_step_writes_perfetto_trace_of_every_rank(tmp_path):
    path, env_path = str(tmp_path / "step.json"), str(tmp_path / "env" / "step.json")
    assert run_processes(_traced_steps, 2, path, env_path, timeout=240) == [1, 1]
    _check_trace(path, 2)
    _check_trace(env_path, 2)


def test_timed_runner_records_a_span_per_node():
    gm = make_fx(lambda x: torch.relu(x) * 2)(torch.randn(3))
    run = compile_runner(gm, timed=True)
    out = run(torch.randn(3))
    assert out.shape == (3,)
    ops = [i for i, _, _ in run.spans]
    assert ops == [i for i, n in enumerate(gm.graph.nodes) if n.op == "call_function"]
    assert all(t1 >= t0 for _, t0, t1 in run.spans)
    assert compile_runner(gm).spans == []  # untimed: nothing recorded
