"""Optimizers that branch on their own numbers (trace/value_guards.py) and use Python
builtins on numbers read from tensors (trace/rewrites.py) train as on one device:
RAdam's ``if rho_t > 5``, ASGD's ``if mu.item() != 1``, SGD's ``if momentum != 0`` with
a scheduled momentum, Adafactor's ``max(eps2, param.norm().item() / n)``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import spmd_compiler as sc
from spmd_compiler.testing import SimulatedTraining, assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import MLP, gpt_fsdp_plan, megatron_mlp_plan, mse_train_step

PLANS = {
    "dp": (lambda: sc.Plan(), ["batch[0]"]),
    "fsdp": (lambda: gpt_fsdp_plan(), ["batch[0]", "l1.weight", "l2.weight"]),
    "tp": (lambda: megatron_mlp_plan(), ["l1.weight", "l2.weight"]),
}
OPTIMIZERS = {
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01, weight_decay=0.1),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.01, t0=2),  # its average starts at step 3: mu != 1 flips
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
}


def _batches(n, rows=4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, 16, generator=g, dtype=torch.float64), torch.randn(rows, 16, generator=g, dtype=torch.float64)) for _ in range(n)]


def _train(opt_name, plan_name, steps, model=None):
    """Train on 2 simulated ranks and on one device; parameters, losses (checked by
    assert_training_matches) and the optimizer state (ASGD's average ``ax``, RAdam's
    moments) must agree."""
    make_plan, sharded = PLANS[plan_name]
    model = model or MLP().double()
    ref = copy.deepcopy(model)
    try:
        res = assert_training_matches(mse_train_step, model, OPTIMIZERS[opt_name], _batches(steps),
                                      fake_mesh((2,), ("dp",)), make_plan())
    finally:
        dist.destroy_process_group()
    assert_distributed(res, sharded=sharded)
    ref_opt = OPTIMIZERS[opt_name](ref.parameters())
    for batch in _batches(steps):
        mse_train_step(ref, ref_opt, *batch)
    got, want = res.sim.optimizer.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        assert got[i].keys() == want[i].keys()
        for k in want[i]:
            torch.testing.assert_close(got[i][k], want[i][k], atol=1e-9, rtol=1e-7, msg=lambda m, i=i, k=k: f"state[{i}][{k!r}]: {m}")
    return res


@pytest.mark.parametrize("opt_name,plan_name", [("radam", "dp"), ("radam", "fsdp"), ("asgd", "tp"), ("adafactor", "dp"), ("adafactor", "fsdp"), ("adafactor", "tp")])
def test_optimizers_with_data_dependent_code_train_as_on_one_device(opt_name, plan_name):
    res = _train(opt_name, plan_name, steps=3)
    assert res.sim.compiles == 1  # the state is created before the first trace; nothing recompiles


def test_radam_recompiles_once_when_its_rectification_starts():
    """RAdam's ``rho_t > 5`` is False for the first five steps and True from the sixth: one
    program each, both equal to one device."""
    res = _train("radam", "dp", steps=8)
    assert res.sim.compiles == 2, res.sim.reasons
    assert "branch" in res.sim.reasons[-1]
    guards = res.sim.traced.value_guards
    assert len(guards) == 4 and all("['step']" in g.key for g in guards)  # one per parameter, on its step count


def test_asgd_recompiles_once_when_averaging_starts():
    res = _train("asgd", "tp", steps=5)
    assert res.sim.compiles == 2, res.sim.reasons  # the first call, mu != 1 from step 4


def test_optimizer_state_after_compiled_steps_loads_into_eager_optimizer():
    model = MLP().double()
    ref = copy.deepcopy(model)
    res = _train("radam", "fsdp", steps=3, model=copy.deepcopy(model))
    trained, opt = res.sim.model, res.sim.optimizer
    eager = copy.deepcopy(trained)
    eager_opt = torch.optim.RAdam(eager.parameters(), lr=0.01, weight_decay=0.1)
    eager_opt.load_state_dict(opt.state_dict())
    ref_opt = torch.optim.RAdam(ref.parameters(), lr=0.01, weight_decay=0.1)
    for x, y in _batches(4):  # the reference runs all four steps eagerly, the copy the last one
        mse_train_step(ref, ref_opt, x, y)
    mse_train_step(eager, eager_opt, *_batches(4)[3])
    assert eager_opt.state_dict()["state"][0]["step"].item() == 4.0
    for p, q in zip(eager.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-9, rtol=1e-7)


# ------------------------------------------------- hyperparameters schedulers change
def metrics_step(model, optimizer, x, y):
    loss = mse_train_step(model, optimizer, x, y)
    group = optimizer.param_groups[0]
    return {"loss": loss, "lr": group["lr"], "beta1": group["betas"][0]} if "betas" in group else \
        {"loss": loss, "lr": group["lr"], "momentum": group["momentum"]}


@pytest.mark.parametrize("make_opt,compiles", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), 1),
    (lambda p: torch.optim.AdamW(p, lr=0.01), 1),
    (lambda p: torch.optim.AdamW(p, lr=0.01, fused=True), 2),  # betas cycled: per-parameter update from call 2 on
], ids=["sgd", "adamw", "adamw-fused"])
def test_onecycle_momentum_cycling_compiles_twice_and_trains_as_on_one_device(make_opt, compiles):
    """OneCycleLR changes lr and momentum / betas[0] every step: they are inputs, so the
    step compiles once (the optimizer state is created before the first trace); a fused
    kernel's betas start as constants and become inputs once they change (one more); the
    returned values are the current ones, as on one device."""
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20) for o in (opt, ref_opt)]
    try:
        sim = SimulatedTraining(metrics_step, model, opt, fake_mesh((2,), ("dp",)))
        for x, y in _batches(10):
            out, want = sim.step(x, y), metrics_step(ref, ref_opt, x, y)
            for s in scheds:
                s.step()
            torch.testing.assert_close(out.pop("loss"), want.pop("loss").detach(), atol=1e-9, rtol=1e-7)
            assert out == want and type(next(iter(out.values()))) is float
    finally:
        dist.destroy_process_group()
    assert sim.compiles == compiles, sim.reasons
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-9, rtol=1e-7)


def test_momentum_switched_off_recompiles_once():
    """``if momentum != 0`` in SGD is a value guard: setting momentum to 0 takes the other
    branch (a recompile), values that keep it nonzero / zero do not."""
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    try:
        sim = SimulatedTraining(mse_train_step, model, opt, fake_mesh((2,), ("dp",)))
        for i, (x, y) in enumerate(_batches(6)):
            for o in (opt, ref_opt):
                o.param_groups[0]["momentum"] = [0.9, 0.8, 0.0, 0.0, 0.5, 0.6][i]
            torch.testing.assert_close(sim.step(x, y), mse_train_step(ref, ref_opt, x, y).detach(), atol=1e-9, rtol=1e-7)
    finally:
        dist.destroy_process_group()
    # first call (the momentum buffers created before it), momentum 0 (other branch), nonzero
    # again (the simulation keeps one program; compile() would find it in its cache)
    assert sim.compiles == 3, sim.reasons
    assert "branch" in sim.reasons[1] and "branch" in sim.reasons[2]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-9, rtol=1e-7)


def test_compile_keeps_one_program_per_branch(mesh4):
    """Through compile(): the outcome of ``momentum != 0`` is part of the call signature,
    known from the first compile on (no extra compile to learn it), and each branch's
    program is cached."""
    step = sc.compile(mse_train_step, mesh=mesh4)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compiles = []
    for momentum in (0.9, 0.8, 0.0, 0.7, 0.0, 0.6):
        opt.param_groups[0]["momentum"] = momentum
        step(model, opt, torch.randn(4, 16), torch.randn(4, 16))
        compiles.append(step.compiles)
    # first call (momentum buffers created before it); momentum 0: the other branch; then both cached
    assert compiles == [1, 1, 2, 2, 2, 2]
