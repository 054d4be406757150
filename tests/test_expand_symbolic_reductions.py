"""dynamic=True and reductions over the sharded batch dim that used to compile per shape
(docs/dynamic_shapes.md): ``var`` / ``std`` (DTensor hashed the SymFloat ``2 / (s3 - 1)``
of their backward: a float guard per size), ``amax`` / ``amin`` (no rule for a symbolic
size: an assertion, INFO fallback), ``max(0)`` and ``cumsum(0)`` (torch's backward asks
whether the dim has one row: a second program at the first one-row batch). One program
serves every batch size, uneven ones and one row included, equal to one device after
every step (float64, 1e-10)."""

from __future__ import annotations

import logging
import warnings
from collections import Counter

import pytest
import torch
import torch.fx as fx

from spmd_compiler.testing import fake_mesh
from spmd_compiler.testing.models import MLP

from test_expand_symbolic_plans import _comms, _train

aten = torch.ops.aten

SIZES = [5, 1, 2, 7, 33]  # uneven, one row (empty shards on 2 and 3 ranks), even

OPS = {
    "var_correction0_keepdim": lambda h: h.var(0, correction=0, keepdim=True),
    "amax": lambda h: h.amax(0),
    "amin_keepdim": lambda h: h.amin(0, keepdim=True),
    "max_dim": lambda h: h.max(0).values,
    "max_dim_keepdim": lambda h: h.max(0, keepdim=True)[0],
    "cumsum": lambda h: h.cumsum(0),
}
# a variance of N <= correction rows is NaN on one device (2 / (N - correction) in its backward):
# batches of at least 3 rows
UNBIASED = {
    "var": lambda h: h.var(0),
    "var_keepdim": lambda h: h.var(0, keepdim=True),
    "std": lambda h: h.std(0),
    "std_keepdim_correction2": lambda h: h.std(0, keepdim=True, correction=2),
}


def _step(f):
    def step(model, optimizer, x, y):
        h = model(x)
        loss = ((h - y) ** 2).mean() + 0.01 * (f(h) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def _batches(sizes):
    torch.manual_seed(0)
    return [(torch.randn(b, 8, dtype=torch.float64), torch.randn(b, 8, dtype=torch.float64)) for b in sizes]


def _one_program(name, f, sizes, ranks, caplog):
    with caplog.at_level(logging.INFO, logger="spmd_compiler.driver.dynamic"):
        sim = _train(_step(f), MLP(8, 6, 8).double(), _batches(sizes), fake_mesh((ranks,), ("dp",)), None, dynamic=True)
    fallbacks = [r.getMessage() for r in caplog.records if r.name == "spmd_compiler.driver.dynamic"]
    assert not fallbacks, fallbacks
    assert sim.compiles == 1, (name, sim.reasons)
    return sim.expansions[(0,)]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("name", list(OPS))
def test_reduction_over_the_batch_one_program_for_every_size(name, ranks, caplog):
    prog = _one_program(name, OPS[name], SIZES, ranks, caplog)
    if name.startswith(("amax", "amin")):
        # each rank's rows plus one identity row, combined with all_reduce(max/min): the
        # batch is never gathered, as in the per-shape program of an even size
        assert "all_gather" not in _comms(prog), _comms(prog)
        reduce_op = "max" if name.startswith("amax") else "min"
        (red,) = [n for n in prog.gm.graph.nodes if n.target in (aten.amax.default, aten.amin.default)]
        cat = red.args[0]
        assert cat.target is aten.cat.default, cat.format_node()
        fill = cat.args[0][1]
        assert fill.target is aten.new_full.default and fill.args[2] == (-1 if reduce_op == "max" else 1) * float("inf")


def test_cumsum_first_batch_of_one_row_one_program(caplog):
    """A program compiled on one row served 5, 2, 7 and 33 rows: before, torch's
    ``cumsum_backward`` (``grad.sym_size(dim) == 1``) fixed the trace to one row."""
    _one_program("cumsum", OPS["cumsum"], [1, 5, 2, 7, 33], 2, caplog)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("name", list(UNBIASED))
def test_variance_over_the_batch_one_program_for_every_size(name, ranks, caplog):
    prog = _one_program(name, UNBIASED[name], [5, 3, 7, 33, 4], ranks, caplog)
    # the backward's scale 2 / (s3 - correction) is an integer-size node of the program,
    # not the first batch's 0.5 (DTensor saw only its example value)
    scaled = [n for n in prog.gm.graph.nodes if n.target is aten.mul.Scalar and isinstance(n.args[1], fx.Node)]
    assert any(a.args[1].meta.get("spmd_size_expr") for a in scaled), [n.format_node() for n in scaled]
    assert not [n for n in prog.gm.graph.nodes if n.target is aten.mul.Scalar and n.args[1] == 2 / (5 - 1)]


@pytest.mark.parametrize("name", ["var", "std_keepdim_correction2"])
def test_variance_of_too_few_rows_is_nan_as_on_one_device(name, caplog):
    """A batch of at most ``correction`` rows: one device scales var's backward by
    ``2 / 0`` in C++ doubles (an infinity, NaN in the result); the program's size arithmetic
    gives the same instead of Python's ZeroDivisionError, still one program."""
    import copy

    from spmd_compiler.testing import SimulatedTraining

    model = MLP(8, 6, 8).double()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sim = SimulatedTraining(_step(UNBIASED[name]), model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fake_mesh((2,), ("dp",)), None, dynamic=True)
    for batch in _batches([5, 1]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # var(): degrees of freedom is <= 0
            loss = sim.step(*batch)
            ref_loss = _step(UNBIASED[name])(ref, ref_opt, *batch)
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-10, rtol=0, equal_nan=True)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-10, rtol=0, equal_nan=True)
    assert torch.isnan(loss) and sim.compiles == 1, sim.reasons


def test_amax_on_dp_by_tp_one_program():
    """2 x 2: the batch on 'dp', the Megatron MLP on 'tp'; amax over the batch pads each
    dp rank's rows and all-reduces with max over 'dp' only."""
    import spmd_compiler as sc
    from torch.distributed.tensor import Replicate, Shard

    mesh = fake_mesh((2, 2), ("dp", "tp"))
    plan = sc.Plan(params={"l1.weight": [Replicate(), Shard(0)], "l1.bias": [Replicate(), Shard(0)],
                           "l2.weight": [Replicate(), Shard(1)]}, default_input=[Shard(0), Replicate()])
    sim = _train(_step(OPS["amax"]), MLP(8, 6, 8).double(), _batches(SIZES), mesh, plan, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    prog = sim.expansions[(1, 1)]
    assert "all_gather" not in _comms(prog), _comms(prog)
    maxes = [n for n in prog.gm.graph.nodes if n.meta.get("spmd_comm", {}).get("kind") == "all_reduce"
             and n.meta["spmd_comm"].get("axis_name") == "dp" and "max" in str(n.args)]
    assert maxes, Counter(str(n.args) for n in prog.gm.graph.nodes if "spmd_comm" in n.meta)


def test_dynamic_trace_of_cumsum_records_no_size_guard():
    """The dynamic trace's cumsum backward is the reversed cumsum (flip, cumsum, flip)
    for every size, with no guard on the batch size, and its nodes name the user's line;
    the per-shape trace keeps torch's own backward."""
    from spmd_compiler import _private_torch as pt
    from spmd_compiler.errors import user_source_line
    from spmd_compiler.expand.symbolic import trace_fake_mode
    from spmd_compiler.trace import trace

    def step(model, optimizer, x):
        loss = model(x).cumsum(0).pow(2).mean()
        loss.backward()
        return loss

    x = torch.randn(5, 8, dtype=torch.float64)
    traced = trace(step, MLP(8, 6, 8).double(), None, x, dynamic=True)
    guards = [str(g) for g, _ in pt.shape_env_guards(pt.shape_env_of(trace_fake_mode(traced)))]
    assert not [g for g in guards if ", 1)" in g], guards
    flips = [n for n in traced.gm.graph.nodes if n.target is aten.flip.default]
    assert len(flips) == 2 and all("loss.backward()" in user_source_line(n) for n in flips)
    (cumsum,) = [n for n in traced.gm.graph.nodes if n.target is aten.cumsum.default and n.meta.get("spmd_phase") != "backward"
                 and "cumsum(0).pow" in (user_source_line(n) or "")]
    assert "test_expand_symbolic_reductions.py" in user_source_line(cumsum)
