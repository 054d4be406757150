"""dynamic=True beyond data parallel: one program per mesh serves every batch size for
FSDP plans and for the GPT's flatten of a sharded batch (docs/dynamic_shapes.md),
equal to one device after every step; the collectives are those of the per-shape
program of an even size."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Shard

import spmd_compiler as sc
from spmd_compiler.testing import SimulatedTraining, fake_mesh
from spmd_compiler.testing.models import GPT, MLP, gpt_fsdp_plan, mse_train_step, train_step

SIZES = [5, 1, 2, 4, 7, 33]  # uneven, smaller than the mesh, even, one row


def _comms(step) -> Counter:
    return Counter(n.meta["spmd_comm"]["kind"] for n in step.gm.graph.nodes if "spmd_comm" in n.meta)


def _train(step_fn, model, batches, mesh, plan, **options):
    """Steps on the simulated ranks and on one device; the parameters agree (1e-10) after
    every step. Returns the simulator."""
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sim_model = copy.deepcopy(model)
    sim = SimulatedTraining(step_fn, sim_model, torch.optim.SGD(sim_model.parameters(), lr=0.1), mesh, plan, **options)
    for i, batch in enumerate(batches):
        loss = sim.step(*batch)
        ref_loss = step_fn(ref, ref_opt, *batch)
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-10, rtol=0)
        for (name, p), q in zip(sim_model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-10, rtol=0,
                                       msg=lambda m, n=name: f"step {i} (batch {batch[0].shape[0]}): {n}: {m}")
    return sim


def _mlp_batches():
    torch.manual_seed(0)
    return [(torch.randn(b, 8, dtype=torch.float64), torch.randn(b, 8, dtype=torch.float64)) for b in SIZES]


def _gpt():
    torch.manual_seed(0)
    model = GPT(vocab=16, seq=4, dim=8, heads=2, layers=1).double()
    return model, [(torch.randint(0, 16, (b, 4)), torch.randint(0, 16, (b, 4))) for b in SIZES]


def _static_even(step_fn, model, batch, mesh, plan):
    """The per-shape program of one (even) batch: the collectives to match."""
    m = copy.deepcopy(model)
    sim = SimulatedTraining(step_fn, m, torch.optim.SGD(m.parameters(), lr=0.1), mesh, plan)
    sim.step(*batch)
    return sim.expansions[(0,) * len(mesh.shape)]


MLP_FSDP = sc.Plan(params={"*": [Shard(0)]}, default_input=[Shard(0)], fsdp_axes=("dp",))


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_fsdp_mlp_one_program_for_every_batch_size(ranks):
    mesh = fake_mesh((ranks,), ("dp",))
    model = MLP(8, 6).double()
    sim = _train(mse_train_step, model, _mlp_batches(), mesh, MLP_FSDP, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    prog = sim.expansions[(0,)]
    assert [s.label for s in prog.size_symbols] == ["batch[0]"]
    even = ranks * 4
    static = _static_even(mse_train_step, model, (torch.randn(even, 8, dtype=torch.float64),) * 2, mesh, MLP_FSDP)
    # parameters gathered once per phase, gradients reduce-scattered in one bucket: as per shape
    assert _comms(prog) == _comms(static) and _comms(prog)["reduce_scatter"] == 1, (_comms(prog), _comms(static))
