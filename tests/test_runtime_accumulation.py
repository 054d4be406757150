"""Gradient accumulation over calls with ``Plan(defer_grad_sync=True)``: the calls that
keep gradients store them unreduced (Partial on the data axes) and the call that steps
reduces them, once per bucket, as DDP under ``no_sync()``; against one device in float64
(1e-10 on parameters and losses), and against the default (a reduction at every call).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.dump.summary import comm_summary
from gloo_launch import run_processes
from spmd_compiler.testing import SimulatedTraining
from spmd_compiler.testing.models import MLP
from spmd_compiler.testing.models import accumulating_mse_step as accumulating_step

WINDOW = 5  # 4 calls that accumulate, then one that steps


def _batch(i: int):
    g = torch.Generator().manual_seed(300 + i)
    return torch.randn(8, 16, dtype=torch.float64, generator=g), torch.randn(8, 16, dtype=torch.float64, generator=g), i % WINDOW == WINDOW - 1


def _plan(kind: str, defer: bool) -> sc.Plan:
    if kind == "fsdp":
        return sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",), defer_grad_sync=defer)
    return sc.Plan(defer_grad_sync=defer)


def _gradient_comms(step) -> list:
    """The program's collectives other than the loss's own reduction (FSDP's parameter
    gathers included)."""
    comms = [n.meta["spmd_comm"] for n in step.collectives()]
    return [m for m in comms if m.get("bucket") or "step output" not in m["reason"]]


def _max_err(model, ref, grads: bool = False) -> float:
    errs = [0.0]
    for p, q in zip(model.parameters(), ref.parameters()):
        a, b = (p.grad, q.grad) if grads else (p, q)
        assert (a is None) == (b is None)
        if a is not None:
            errs.append((a - b).abs().max().item())
    return max(errs)


def _simulate(kind: str, defer: bool, mesh4, calls: int = 2 * WINDOW, **options):
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    sim = SimulatedTraining(accumulating_step, model, opt, mesh4, _plan(kind, defer), **options)
    per_call = []
    for i in range(calls):
        x, y, do_step = _batch(i)
        loss = sim.step(x, y, do_step)
        want = accumulating_step(ref, ref_opt, x, y, do_step)
        step = sim.expansions[(0,)]
        per_call.append({
            "do_step": do_step, "loss": abs(loss.item() - want.item()), "params": _max_err(model, ref),
            "grads": _max_err(model, ref, grads=True), "comms": _gradient_comms(step), "step": step,
        })
    return per_call


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_deferred_sync_reduces_once_per_window_and_matches_one_device(mesh4, kind):
    calls = _simulate(kind, True, mesh4)
    for i, c in enumerate(calls):
        assert c["loss"] < 1e-10 and c["params"] < 1e-10, (i, c)
        # the simulator assembles p.grad from the ranks' parts: Partial sums them, the global sum
        assert c["grads"] < 1e-10, (i, c)
        if c["do_step"]:
            kinds = {(m["kind"], m["axis_name"]) for m in c["comms"] if m["kind"] != "all_gather"}
            assert len(kinds) == 1 and next(iter(kinds))[1] == "dp", kinds  # the gradients, reduced once
            # one bucket holding every gradient (and the loss): one launch for the window
            grad_launches = [m for m in c["comms"] if m["kind"] != "all_gather"]
            assert len(grad_launches) == 1 and len(grad_launches[0].get("bucket") or ()) >= 4, (i, grad_launches)
        else:
            # no reduction of any gradient: only the loss (and FSDP's parameter gathers)
            assert all(m["kind"] == "all_gather" for m in c["comms"]), (i, c["comms"])
    step = next(c["step"] for c in calls[1:] if not c["do_step"])
    params = {i.name: s for i, s in zip(step.traced.inputs, step.input_specs) if i.kind == "param"}
    for inp, spec in zip(step.traced.inputs, step.input_specs):
        if inp.kind == "grad":  # Partial on dp, full size (FSDP: though the parameter is a shard)
            assert tuple(spec.placements) == (Partial(),), (inp.label, spec.placements)
            assert tuple(spec.shape) == tuple(params[inp.name].shape)
    kept = [s for s in step.outputs if s.kind == "grad"]
    assert not kept  # the grads came in and are written back in place
    first = calls[0]["step"]
    assert [tuple(s.spec.placements) for s in first.outputs if s.kind == "grad"] == [(Partial(),)] * 4


def test_deferred_sync_reduces_each_bucket_once_in_the_stepping_call(mesh4):
    """Small buckets: the stepping call makes one launch per bucket, the others none; by
    default every call makes as many."""
    options = {"bucket_mb": 0.002, "first_bucket_mb": None}  # 2 KB buckets for 8.5 KB of gradients
    deferred = _simulate("dp", True, mesh4, calls=WINDOW, **options)
    default = _simulate("dp", False, mesh4, calls=WINDOW, **options)
    buckets = {g.axis: g.buckets for g in comm_summary(deferred[-1]["step"].gm).groups}["dp"]
    assert buckets > 1
    assert [len(c["comms"]) for c in deferred] == [0] * (WINDOW - 1) + [buckets]
    # default: every call reduces its gradients (per call as many buckets, about)
    assert all(len(c["comms"]) >= buckets - 1 for c in default), [len(c["comms"]) for c in default]
    assert sum(len(c["comms"]) for c in default) >= WINDOW * (buckets - 1) > buckets
    assert max(c["params"] for c in deferred) < 1e-10 and max(c["loss"] for c in deferred) < 1e-10


def test_without_the_option_every_call_reduces_and_grads_equal_one_device(mesh4):
    calls = _simulate("dp", False, mesh4, calls=WINDOW)
    for i, c in enumerate(calls):
        assert c["loss"] < 1e-10 and c["params"] < 1e-10 and c["grads"] < 1e-10, (i, c)
        assert [m["kind"] for m in c["comms"]] == ["all_reduce"], (i, c["comms"])  # one bucket every call
    step = calls[1]["step"]
    for inp, spec in zip(step.traced.inputs, step.input_specs):
        if inp.kind == "grad":
            assert tuple(spec.placements) == (Replicate(),)


def test_plan_rejects_a_non_bool():
    with pytest.raises(TypeError, match="defer_grad_sync"):
        sc.Plan(defer_grad_sync="yes")


# ----------------------------------------------------------------------------- gloo

def _launches(prof) -> int:
    """Process-group calls in the profiled call: the program's collectives, the step check
    when it does not ride on one, and what switching programs costs (every window
    switches three times: no gradients, gradients in, stepping)."""
    return sum(1 for e in prof.events() if e.name.startswith("c10d::"))


def _gloo_accumulation(rank: int, world: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for defer in (False, True):
        torch.manual_seed(0)
        model = MLP().double()
        ref = copy.deepcopy(model)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
        # 2 KB buckets for 8.5 KB of gradients: more than one launch per reduction
        step = sc.compile(accumulating_step, mesh=(world,), plan=sc.Plan(defer_grad_sync=defer), bucket_mb=0.002, first_bucket_mb=None)
        launches, static, errs, grads = [], [], [], []
        for i in range(3 * WINDOW):  # the first two windows compile (without, then with momentum); the third is counted
            if i == 2 * WINDOW:
                before = dict(step.checks)
            x, y, do_step = _batch(i)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loss = step(model, opt, x.chunk(world)[rank], y.chunk(world)[rank], do_step).item()
            launches.append(_launches(prof))
            static.append(sum(g.launches for g in step.comm_summary().groups))
            errs.append(abs(loss - accumulating_step(ref, ref_opt, x, y, do_step).item()))
            g = model.l1.weight.grad
            if g is not None:  # what the user reads between calls
                errs.append((g.full_tensor() - ref.l1.weight.grad).abs().max().item())
                grads.append((str(g.placements), g.to_local().tolist()))
        for p, q in zip(model.parameters(), ref.parameters()):
            errs.append((p.full_tensor() - q).abs().max().item())
        checks = {k: v - before.get(k, 0) for k, v in step.checks.items() if v != before.get(k, 0)}
        out[defer] = {"err": max(errs), "launches": launches[2 * WINDOW:], "static": static[2 * WINDOW:], "grads": grads,
                      "checks": checks, "compiles": step.compiles}
    # a step compiled without the option refuses the unreduced gradient, naming it
    x, y = (t.chunk(world)[rank] for t in _batch(0)[:2])
    step(model, opt, x, y, False)  # leaves Partial gradients
    try:
        sc.compile(accumulating_step, mesh=(world,))(model, opt, x, y, False)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    # FSDP: the kept gradient is full size on every rank (the parameter a shard)
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    step = sc.compile(accumulating_step, mesh=(world,), plan=sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=(0,), defer_grad_sync=True))
    errs, kept = [], set()
    for i in range(WINDOW + 2):
        x, y, do_step = _batch(i)
        errs.append(abs(step(model, opt, x.chunk(world)[rank], y.chunk(world)[rank], do_step).item()
                        - accumulating_step(ref, ref_opt, x, y, do_step).item()))
        for p, q in zip(model.parameters(), ref.parameters()):
            errs.append((p.full_tensor() - q).abs().max().item())
            if p.grad is not None:
                errs.append((p.grad.full_tensor() - q.grad).abs().max().item())
                kept.add((str(p.placements), str(p.grad.placements), tuple(p.grad.to_local().shape) == tuple(q.shape)))
    out["fsdp"] = {"err": max(errs), "kept": kept}
    return out


@pytest.mark.gloo
def test_gloo_deferred_sync_launches_and_grads():
    results = run_processes(_gloo_accumulation, 2, timeout=300)
    for rank, res in enumerate(results):
        default, deferred = res[False], res[True]
        assert default["err"] < 1e-10 and deferred["err"] < 1e-10, (rank, res)
        # p.grad between calls: Partial, full_tensor() the global sum (checked in err)
        assert {p for p, _ in deferred["grads"]} == {"(Partial(sum),)"}, deferred["grads"]
        assert {p for p, _ in default["grads"]} == {"(Replicate(),)"}, default["grads"]
        # the programs: the calls that accumulate make one collective, the loss's (the
        # step check rides on it); the stepping call reduces every bucket, as by default
        assert deferred["static"][: WINDOW - 1] == [1] * (WINDOW - 1), deferred["static"]
        assert deferred["static"][-1] == default["static"][-1] == default["static"][0] > 1, (deferred["static"], default["static"])
        # at run time, the three program switches of a window exchange no signatures:
        # without the option every program's check rides on its first bucket (the same
        # collective in all three), so each call launches exactly its program's collectives
        assert default["launches"] == default["static"], default
        assert default["checks"] == {"folded": WINDOW, "switched (folded)": 3}, default["checks"]
        # with it, the stepping program writes the kept gradients before its only
        # collective: its check is standalone (1 launch, carrying the next program's id),
        # and the switch into it joins the accumulating program's fold naming it (1 launch)
        extra = [n - s for n, s in zip(deferred["launches"], deferred["static"])]
        assert extra == [1, 0, 0, 0, 1], deferred
        assert deferred["checks"] == {"folded": WINDOW - 1, "standalone": 1, "switched (folded)": 2, "switched (standalone)": 1}, deferred
        assert sum(deferred["launches"]) == (WINDOW - 1) + deferred["static"][-1] + 2, deferred
        assert default["compiles"] == deferred["compiles"] == 3, (default, deferred)  # 3 programs (momentum exists before the trace)
        assert "compile this step with the same option" in (res["refused"] or ""), res["refused"]
        assert res["fsdp"]["err"] < 1e-10, res["fsdp"]
        assert res["fsdp"]["kept"] == {("(Shard(dim=0),)", "(Partial(sum),)", True)}, res["fsdp"]["kept"]
    # the rank's own part: ranks hold different local gradients that sum to the global one
    a, b = (torch.tensor(r[True]["grads"][0][1]) for r in results)
    assert (a - b).abs().max() > 1e-3
