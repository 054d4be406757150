"""trace/state.py: the call signature follows what the model and optimizer are now.

Freezing or unfreezing parameters between calls (``requires_grad_``, as fine-tuning
schedules do) changes which gradients the step computes and which parameters the
optimizer updates; the cached state (StateCache) must notice and the step compile
again, never keep training with the old program. Float64, 1e-10 against one device."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.testing import SimulatedTraining, fake_mesh
from spmd_compiler.testing.models import MLP, mse_train_step


def _batches(n=3, rows=4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 16, generator=g, dtype=torch.float64), torch.randn(rows, 16, generator=g, dtype=torch.float64)) for _ in range(n)]


@pytest.mark.parametrize("freeze_later", [False, True], ids=["unfreeze", "freeze"])
def test_changing_requires_grad_between_calls_recompiles(freeze_later):
    torch.manual_seed(0)
    model = MLP(16, 32, 16).double()
    model.l1.requires_grad_(freeze_later)
    ref = copy.deepcopy(model)
    # the optimizer holds every parameter: one without a gradient is skipped (AdamW)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.05) for m in (model, ref))
    sim = SimulatedTraining(mse_train_step, model, opt, fake_mesh((2,), ("dp",)), sc.Plan())
    for i, batch in enumerate(_batches()):
        if i == 2:  # before the fix: the program of the first calls ran on
            for m in (model, ref):
                m.l1.requires_grad_(not freeze_later)
        torch.testing.assert_close(sim.step(*batch), mse_train_step(ref, ref_opt, *batch), atol=1e-10, rtol=1e-10)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    what = "frozen (requires_grad False)" if freeze_later else "unfrozen (requires_grad True)"
    assert f"model parameters {what}: l1.weight, l1.bias" in sim.reasons[-1], sim.reasons
