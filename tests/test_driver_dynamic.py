"""compile(dynamic=True): one program per mesh serves every batch size, equal to one device
(simulated ranks); what cannot stay symbolic compiles per shape after one INFO log."""

from __future__ import annotations

import copy
import logging

import pytest
import sympy
import torch

from spmd_compiler.testing import SimulatedTraining, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import GPT, MLP, mse_train_step, train_step

SIZES = [10, *range(1, 34)]  # uneven, even, empty shards (1 row over 4 ranks), one row


@pytest.mark.parametrize("ranks", [3, 4])  # 2 ranks: the GPT and fallback tests below
def test_one_program_serves_batch_sizes_1_to_33_mlp(ranks):
    batches = [(torch.randn(b, 8, dtype=torch.float64), torch.randn(b, 8, dtype=torch.float64)) for b in SIZES]
    res = assert_training_matches(mse_train_step, MLP(8, 6).double(), lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                  fake_mesh((ranks,), ("dp",)), dynamic=True)
    assert res.sim.compiles == 1, res.sim.reasons
    first = res.sim.expansions[(0,)]
    assert [s.label for s in first.size_symbols] == ["batch[0]"]
    assert res.sim.last_sizes == [33]
    # no number that depends on the batch size is left in the program: 2 / (8 * B) and the
    # uneven gather's pad are integer nodes computed from the size_* input
    consts = [a for n in first.gm.graph.nodes for a in n.args if isinstance(a, float)]
    assert 2 / (8 * 10) not in consts and any(n.meta.get("spmd_size_expr") for n in first.gm.graph.nodes)
    # the loss mean is a local sum over the global count (rules/mean.py), not a gather of
    # every per-element loss: the same collectives as the per-shape program of an even size
    assert not [n for n in first.gm.graph.nodes if "all_gather" in str(n.target)]
    _assert_guards_compiled(res.sim)


def _assert_guards_compiled(sim):
    """Every rank's size guards are compiled into Python functions (expand/size_checks.py)
    that agree with sympy's evaluation of the guard as recorded, for sizes 0..40."""
    for coord, e in sim.expansions.items():
        checks = e.size_guards.checks()
        assert checks and all(c.fn is not None for c in checks), [c.expr for c in checks if c.fn is None]
        for v in range(41):
            values = {sym.symbol: v for sym in e.size_symbols}
            # the substitution SizeGuards made before: coordinates, sizes, and the batch dims
            # torch found equal to a size symbol (y's rows: s60 -> s3) take its value
            subs = {**e.size_guards.coordinates, **{k: sympy.Integer(x) for k, x in values.items()}}
            subs.update({k: subs[r] for k, r in e.size_guards._replaced.items() if r in subs})
            for c in checks:
                by_sympy = c.expr.xreplace(subs)
                assert (c.broken(values) is None) == bool(by_sympy), (coord, c.expr, v)


def test_one_program_serves_every_batch_size_gpt():
    torch.manual_seed(0)
    model = GPT(vocab=16, seq=4, dim=8, heads=2, layers=1).double()
    batches = [(torch.randint(0, 16, (b, 4)), torch.randint(0, 16, (b, 4))) for b in (5, 1, 2, 4, 33)]
    res = assert_training_matches(train_step, model, lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                  fake_mesh((2,), ("dp",)), dynamic=True, atol=1e-9)
    assert res.sim.compiles == 1, res.sim.reasons


def test_a_size_the_step_branches_on_compiles_per_shape_after_one_info_log(caplog):
    def step(model, optimizer, x, y):
        out = model(x)
        if x.shape[0] == 6:  # fixes the batch size of this trace: no symbolic program serves it
            out = out * 2
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    batches = [(torch.randn(b, 8, dtype=torch.float64), torch.randn(b, 8, dtype=torch.float64)) for b in (6, 5, 7, 9)]
    with caplog.at_level(logging.INFO, logger="spmd_compiler.driver.dynamic"):
        res = assert_training_matches(step, MLP(8, 6).double(), lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                      fake_mesh((2,), ("dp",)), dynamic=True)
    logs = [r.getMessage() for r in caplog.records if r.name == "spmd_compiler.driver.dynamic"]
    assert len(logs) == 1 and "test_driver_dynamic.py" in logs[0] and "Eq(" in logs[0], logs
    # 6: its own program (per shape); 5: a symbolic one whose guard (size != 6) serves 7 and 9
    assert res.sim.compiles == 2, res.sim.reasons
    assert res.sim.expansions[(0,)].size_guards.failing({res.sim.expansions[(0,)].size_symbols[0].symbol: 6})


def test_batch_dims_compiled_as_one_size_are_checked_every_call():
    """x and y rows were one symbol at compile (mse_loss made them equal): a call where they
    differ (y broadcast from one row, as one device allows) compiles again, never reuses."""
    batches = [(torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)),
               (torch.randn(4, 4, dtype=torch.float64), torch.randn(1, 4, dtype=torch.float64))]
    with pytest.warns(UserWarning):  # mse_loss's broadcast warning, on one device
        res = assert_training_matches(mse_train_step, MLP(4, 3).double(), lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                      fake_mesh((2,), ("dp",)), dynamic=True)
    assert res.sim.compiles == 2 and "compiled as one size" in res.sim.reasons[1], res.sim.reasons


class DropoutMLP(torch.nn.Module):
    """nn.Dropout on the batch-sharded hidden activation, plus draws sized by the batch
    (randn_like, torch.rand(x.shape[0], 1)): every draw depends on the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.drop = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l2(self.drop(torch.relu(self.l1(x))))
        return y + 0.01 * torch.randn_like(y) + 0.01 * torch.rand(x.shape[0], 1, dtype=x.dtype)


def dropout_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss, torch.nn.functional.dropout(torch.ones_like(x), 0.5)  # the scaled mask itself, batch-sharded


@pytest.mark.parametrize("ranks", [2, 3])
def test_dropout_stays_symbolic_with_one_devices_masks_for_every_size(ranks):
    """The RNG contract (docs/randomness.md (b)): shards get the numbers one device drew for
    their rows, for every size, from one program: each rank keeps rows [min(s, k*c),
    min(s, (k+1)*c)) of the global draw, c = ceil(s/n), computed from the size input."""
    torch.manual_seed(0)
    model = DropoutMLP().double()
    ref = copy.deepcopy(model)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    opt, ref_opt = sgd(model), sgd(ref)
    sim = SimulatedTraining(dropout_step, model, opt, fake_mesh((ranks,), ("dp",)), dynamic=True)
    g = torch.Generator().manual_seed(3)
    for b in [8, 5, 3, 7, 1]:
        x, y = torch.randn(b, 8, generator=g, dtype=torch.float64), torch.randn(b, 8, generator=g, dtype=torch.float64)
        start = torch.get_rng_state()
        loss, mask = sim.step(x, y)
        after = torch.get_rng_state()
        torch.set_rng_state(start)
        ref_loss, ref_mask = dropout_step(ref, ref_opt, x, y)
        assert torch.equal(after, torch.get_rng_state()), b  # the generator ends where one device's does
        assert torch.equal(mask, ref_mask) and set(mask.unique().tolist()) <= {0.0, 2.0}, b  # bit for bit
        assert abs(loss.item() - ref_loss.item()) < 1e-10, (b, loss.item(), ref_loss.item())
        err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        assert err < 1e-10, (b, err)
    assert sim.compiles == 1, sim.reasons
    assert sim.last_sizes == [1]
    _assert_guards_compiled(sim)


def threshold_step(model, optimizer, x, y):
    out = model(x)
    if x.shape[0] > 4:  # a guard on the size, not a pin: each side is a symbolic program
        out = out * 2
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("cache_size, compiles", [(8, 2), (1, 4)])
def test_a_step_alternating_across_a_size_guard_keeps_one_program_per_side(cache_size, compiles):
    """8, 3, 2, 8, 3: the program of 8 (guard 4 < s) and the one of 3 (s <= 4) are both kept
    and picked again: 2 compiles (as compile() across processes, tests/test_driver_sizes.py);
    with room for one program, every switch compiles (2 reuses the program of 3)."""
    batches = [(torch.randn(b, 8, dtype=torch.float64), torch.randn(b, 8, dtype=torch.float64)) for b in (8, 3, 2, 8, 3)]
    res = assert_training_matches(threshold_step, MLP(8, 6).double(), lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                  fake_mesh((2,), ("dp",)), dynamic=True, cache_size=cache_size, atol=1e-10)
    assert res.sim.compiles == compiles and len(res.sim.reasons) == compiles, res.sim.reasons
    assert all("break a size guard" in r for r in res.sim.reasons[1:]), res.sim.reasons
