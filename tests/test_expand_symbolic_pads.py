"""dynamic=True and a reduction over the sharded batch dim: centering, ``h - h.mean(0,
keepdim=True)``. Its backward broadcasts the mean's gradient (``Partial`` over dp, one
row) to the batch and adds it to the batch-sharded gradient: the row is all-reduced
before its broadcast (a row, where a reduce_scatter of the broadcast would move the
batch). One program serves every batch size, equal to one device (docs/dynamic_shapes.md)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing import fake_mesh
from spmd_compiler.testing.models import MLP

from test_expand_symbolic_plans import SIZES, _comms, _train



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


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("step", [_center_step, _issue_step], ids=["center", "issue"])
def test_centering_over_the_batch_one_program(step, ranks):
    """The mean's gradient (one row) is all-reduced before it is broadcast over the
    batch, for every size. Before a fix, DTensor's fake run of the ``expand`` to
    ``[s3, 8]`` happened outside the trace's fake mode and recorded the guard
    ``Ne(s3, 1)``: a second program at the one-row batch."""
    mesh = fake_mesh((ranks,), ("dp",))
    sim = _train(step, MLP(8, 6, 8).double(), _batches(), mesh, None, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    prog = sim.expansions[(0,)]
    # the forward mean (one row), the mean's gradient (one row), the gradient bucket
    want = Counter(all_reduce=3)
    assert _comms(prog) == want, _comms(prog)
    broadcast = [n for n in prog.gm.graph.nodes if "broadcast over split rows" in n.meta.get("spmd_comm", {}).get("reason", "")]
    assert broadcast and all(n.meta["val"].shape[0] == 1 for n in broadcast)


def test_centering_on_dp_by_tp_all_reduces_the_row_on_dp():
    """The Megatron MLP on 'tp', the batch on 'dp' (2 x 2): the mean's gradient is
    all-reduced over 'dp' (one row; already replicated on 'tp') before its broadcast,
    one program for every size."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    plan = sc.Plan(params={"l1.weight": [Replicate(), Shard(0)], "l1.bias": [Replicate(), Shard(0)],
                           "l2.weight": [Replicate(), Shard(1)]}, default_input=[Shard(0), Replicate()])
    sim = _train(_center_step, MLP(8, 6, 8).double(), _batches(), mesh, plan, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    for coord in [(0, 0), (1, 1)]:
        prog = sim.expansions[coord]
        assert _comms(prog) == Counter(all_reduce=4), _comms(prog)
