"""compile(dynamic=None), the default: static until the batch size changes, then one
symbolic program for every later size (spmd_compiler/driver/auto_dynamic.py); equal to one
device (simulated ranks, float64). dynamic=False and dynamic=True keep their behaviour."""

from __future__ import annotations

import logging

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.testing import assert_training_matches, fake_mesh
from spmd_compiler.testing.models import MLP, mse_train_step

SIZES = [8, 5, 3, 12, 1, 7, 2, 33, 4]  # 9 distinct sizes: uneven, one row, fewer rows than ranks


def _batches(sizes, features=8, dtype=torch.float64):
    return [(torch.randn(b, features, dtype=dtype), torch.randn(b, features, dtype=dtype)) for b in sizes]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("ranks", [2, 3])
def test_nine_batch_sizes_compile_at_most_twice_and_equal_one_device(ranks, caplog):
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        res = assert_training_matches(mse_train_step, MLP(8, 6).double(), _sgd, _batches(SIZES), fake_mesh((ranks,), ("dp",)),
                                      atol=1e-10, rtol=0)
    assert res.sim.compiles == 2, res.sim.reasons
    assert res.sim.expansions[(0,)].size_symbols  # the second program is the symbolic one
    assert max(abs(a - b) for a, b in zip(res.losses, res.reference_losses)) < 1e-10
    assert res.max_param_error < 1e-10
    switches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch size changed")]
    assert switches == ["batch size changed from 8 to 5: compiling once with the batch dims symbolic; later sizes reuse it "
                        "(dynamic=False to keep one program per size)"]


def test_dynamic_false_keeps_one_program_per_size():
    res = assert_training_matches(mse_train_step, MLP(8, 6).double(), _sgd, _batches(SIZES[:4]), fake_mesh((2,), ("dp",)),
                                  dynamic=False)
    assert res.sim.compiles == 4, res.sim.reasons
    assert not res.sim.expansions[(0,)].size_symbols


def test_dynamic_true_compiles_once():
    res = assert_training_matches(mse_train_step, MLP(8, 6).double(), _sgd, _batches(SIZES[:4]), fake_mesh((2,), ("dp",)),
                                  dynamic=True)
    assert res.sim.compiles == 1, res.sim.reasons
    assert res.sim.expansions[(0,)].size_symbols


def test_a_dtype_change_compiles_static():
    """The batch dtype is not a batch size: the program for it is static (then a size change
    at that dtype switches that signature to the symbolic program)."""
    model = MLP(8, 6)
    batches = _batches([4], dtype=torch.float32) + _batches([4, 6, 5])  # float32, then float64 at 4, 6, 5
    sim = sc.testing.SimulatedTraining(mse_train_step, model, _sgd(model.parameters()), fake_mesh((2,), ("dp",)))
    symbolic = []
    for i, (x, y) in enumerate(batches):
        if i == 1:
            model.double()
        sim.step(x, y)
        symbolic.append(bool(sim.expansions[(0,)].size_symbols))
    assert sim.compiles == 3, sim.reasons
    assert symbolic == [False, False, True, True]


# ------------------------------------------------------------------ compile() (fake process group: counts only)
def _compile_counts(sizes, **options):
    step = sc.compile(mse_train_step, mesh=fake_mesh((4,), ("dp",)), **options)
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    symbolic = []
    for rows in sizes:
        step(model, opt, torch.randn(rows, 16), torch.randn(rows, 16))
        symbolic.append(bool(step.last.size_symbols))
    return step, symbolic


def test_compile_default_switches_once(caplog):
    with caplog.at_level(logging.INFO, logger="spmd_compiler.driver.step"):
        step, symbolic = _compile_counts(SIZES)
    assert step.compiles == 2
    assert symbolic == [False] + [True] * (len(SIZES) - 1)
    assert sum(r.getMessage().startswith("batch size changed from 32 to 20") for r in caplog.records) == 1  # 4 fake ranks


def test_compile_dynamic_false_and_true():
    step, symbolic = _compile_counts(SIZES[:4], dynamic=False)
    assert step.compiles == 4 and not any(symbolic)
    step, symbolic = _compile_counts(SIZES[:4], dynamic=True)
    assert step.compiles == 1 and all(symbolic)


def test_compile_a_feature_change_compiles_static():
    """A change of a non-batch dim (the features: another model) is a static program; the
    batch-size switch is per free signature."""
    step = sc.compile(mse_train_step, mesh=fake_mesh((4,), ("dp",)))
    small, large = MLP(16, 8), MLP(32, 8)
    opt_s, opt_l = torch.optim.SGD(small.parameters(), lr=0.1), torch.optim.SGD(large.parameters(), lr=0.1)
    step(small, opt_s, torch.randn(2, 16), torch.randn(2, 16))
    step(large, opt_l, torch.randn(2, 32), torch.randn(2, 32))
    assert step.compiles == 2 and not step.last.size_symbols
    step(small, opt_s, torch.randn(3, 16), torch.randn(3, 16))  # a size change of the first: symbolic
    assert step.compiles == 3 and step.last.size_symbols
    step(small, opt_s, torch.randn(5, 16), torch.randn(5, 16))
    step(large, opt_l, torch.randn(2, 32), torch.randn(2, 32))  # its static program, cached
    assert step.compiles == 3


def test_dynamic_option_is_validated():
    with pytest.raises(ValueError, match="expected None"):
        sc.compile(mse_train_step, mesh=fake_mesh((2,), ("dp",)), dynamic="auto")


def test_pipeline_default_switches_once():
    """A pipelined step behaves the same: static, then one symbolic program (its size_*
    inputs are micro-batch sizes, spmd_compiler/pipeline/sizes.py)."""
    from spmd_compiler.testing.models import GPT, train_step

    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = sc.compile(train_step, mesh=fake_mesh((2,), ["pp"]),
                      pipeline=sc.Pipeline(chunks=2, split={"blocks.1": sc.SplitPoint.BEGINNING}))
    symbolic = []
    for b in (8, 6, 4, 12):
        ids = torch.randint(0, 32, (b, 8))
        step(model, opt, ids, ids)
        symbolic.append(bool(step.last.size_symbols))
    assert step.compiles == 2 and symbolic == [False, True, True, True]


# ------------------------------------------------------------------ real processes (gloo)
def _gloo_default(rank: int, world: int) -> dict:
    """The default on 2 gloo ranks, each holding torch.chunk's piece: every rank takes the
    switch at the same call (the decision reads the payloads all ranks exchanged)."""
    import copy

    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: logs.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("spmd_compiler.driver.step").addHandler(handler)
    logging.getLogger("spmd_compiler.driver.step").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    step = sc.compile(mse_train_step, mesh=(world,))
    errs, symbolic = [], []
    for i, b in enumerate(SIZES):
        g = torch.Generator().manual_seed(100 + i)
        x, y = (torch.randn(b, 16, dtype=torch.float64, generator=g) for _ in range(2))
        c = -(-b // world)
        mine = slice(min(rank * c, b), min((rank + 1) * c, b))
        loss = step(model, opt, x[mine], y[mine])
        errs.append(abs(loss.item() - mse_train_step(ref, ref_opt, x, y).item()))
        errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
        symbolic.append(bool(step.last.size_symbols))
    return {"err": max(errs), "compiles": step.compiles, "symbolic": symbolic,
            "switches": [m for m in logs if m.startswith("batch size changed")]}


@pytest.mark.gloo
def test_gloo_default_switches_together_and_equals_one_device():
    from gloo_launch import run_processes

    for rank, r in enumerate(run_processes(_gloo_default, 2, timeout=300)):
        assert r["err"] < 1e-10, (rank, r)
        assert r["compiles"] == 2 and r["symbolic"] == [False] + [True] * (len(SIZES) - 1), (rank, r)
        assert r["switches"] == ["batch size changed from 8 to 5: compiling once with the batch dims symbolic; later sizes "
                                 "reuse it (dynamic=False to keep one program per size)"], (rank, r)
