"""dynamic=True and a reduction over the sharded batch dim: centering, ``h - h.mean(0,
keepdim=True)``. Its backward expands the mean's gradient (``Partial`` over dp, one row)
to the batch and adds it to the batch-sharded gradient: a ``Partial -> Shard(0)``
reduce_scatter of a batch-sized value, padded to ``n`` equal pieces for every size.
One program serves every batch size, equal to one device (docs/dynamic_shapes.md)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing import fake_mesh
from spmd_compiler.testing.models import MLP

from test_expand_symbolic_plans import SIZES, _comms, _train

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _center_step(model, optimizer, x, y):
    h = model(x)
    h = h - h.mean(0, keepdim=True)
    loss = ((h - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _issue_step(model, optimizer, x, y):  # issue #17's example: the model runs twice
    loss = ((model(x) - model(x).mean(0, keepdim=True)) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _batches():
    torch.manual_seed(0)
    return [(torch.randn(b, 8, dtype=torch.float64), torch.randn(b, 8, dtype=torch.float64)) for b in SIZES]


def _value(node, **symbols) -> int:
    """The integer an emitted size node computes (its sympy expression), for sizes given by name."""
    expr = node.meta["spmd_size_value"]
    assert {str(s) for s in expr.free_symbols} <= set(symbols), (expr, symbols)
    return int(expr.subs({s: symbols[str(s)] for s in expr.free_symbols}))


def _reduce_scatters(prog):
    return [n for n in prog.gm.graph.nodes if n.meta.get("spmd_comm", {}).get("kind") == "reduce_scatter"]


def _check_padding(prog, n: int, axis: str) -> None:
    """The reduce_scatter's input is padded with zeros to ``n`` pieces of ``max(1,
    ceil(s/n))`` rows and its output narrowed to this rank's torch.chunk rows: both sizes
    are integer nodes whose expressions (of the global size and the coordinate) agree with
    torch.chunk for every size 0..40 and every rank."""
    assert not [m for m in prog.gm.graph.nodes if m.target is aten.constant_pad_nd.default]
    (rs,) = _reduce_scatters(prog)
    assert rs.meta["spmd_comm"]["axis_name"] == axis
    contiguous = rs.args[0]
    cat = contiguous.args[0]
    assert cat.target is aten.cat.default, cat.format_node()
    zeros = cat.args[0][1]
    assert zeros.target is aten.new_zeros.default, zeros.format_node()
    pad = zeros.args[1][0]
    (wait,) = rs.users
    (narrow,) = wait.users
    assert narrow.target is aten.narrow.default and narrow.args[1:3] == (0, 0), narrow.format_node()
    local = narrow.args[3]
    for s in range(41):
        sizes = {str(size.symbol): s for size in prog.size_symbols}  # x's and y's rows (one size)
        assert _value(pad, **sizes) == n * max(1, -(-s // n)) - s, (s, pad.meta["spmd_size_value"])
        rows = [len(c) for c in torch.arange(s).chunk(n)] + [0] * n
        for k in range(n):
            assert _value(local, **sizes, **{f"coord_{axis}": k}) == rows[k], (s, k, local.meta["spmd_size_value"])


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("step", [_center_step, _issue_step], ids=["center", "issue"])
def test_centering_over_the_batch_one_program(step, ranks):
    """The mean's gradient is all-reduced nowhere: it is expanded to the batch as
    ``Partial`` and reduce-scattered into the batch's ``Shard(0)``, padded for every size
    (5 rows over 3 ranks: 2, 2, 1, the input padded to 6 rows). Before the fix, DTensor's
    fake run of the ``expand`` to ``[s3, 8]`` happened outside the trace's fake mode and
    recorded the guard ``Ne(s3, 1)``: a second program at the one-row batch."""
    mesh = fake_mesh((ranks,), ("dp",))
    sim = _train(step, MLP(8, 6, 8).double(), _batches(), mesh, None, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    prog = sim.expansions[(0,)]
    # the forward mean (one row), the mean's gradient into the batch, the gradient bucket
    want = Counter(all_reduce=2, reduce_scatter=1) + (Counter(all_gather=1) if step is _issue_step else Counter())
    assert _comms(prog) == want, _comms(prog)
    _check_padding(prog, ranks, "dp")


def test_centering_on_dp_by_tp_reduce_scatters_on_dp():
    """The Megatron MLP on 'tp', the batch on 'dp' (2 x 2): the mean's gradient is
    reduce-scattered along the batch over 'dp' (and already replicated on 'tp'), one
    program for every size."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    plan = sc.Plan(params={"l1.weight": [Replicate(), Shard(0)], "l1.bias": [Replicate(), Shard(0)],
                           "l2.weight": [Replicate(), Shard(1)]}, default_input=[Shard(0), Replicate()])
    sim = _train(_center_step, MLP(8, 6, 8).double(), _batches(), mesh, plan, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    for coord in [(0, 0), (1, 1)]:
        prog = sim.expansions[coord]
        assert _comms(prog) == Counter(all_reduce=3, reduce_scatter=1), _comms(prog)
        _check_padding(prog, 2, "dp")
