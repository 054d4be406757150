"""Mixed precision as trainers write it: ``torch.autocast("cpu", dtype=torch.bfloat16)``
around a Hugging Face model's forward, the loss in float32, float32 parameters and SGD.

The trace records autocast's casts as aten ops, so the per-rank program runs its matmuls
in bfloat16 like one device does. The numbers agree with one device to bfloat16's
rounding, not exactly: a rank's matmul sums fewer rows (DP) or features (TP) in
bfloat16 before the float32 reduction. Observed after 3 steps: losses within 6e-5
relative, parameters within 7e-4 absolute (lr 0.5). A float32 run's first loss differs
from the autocast one's by only 5e-6 (GPT-2) to 9e-6 (Llama) relative here, so what
proves autocast was kept is the program's matmul dtype, checked too.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_zoo_hf import MODELS, batches, megatron_params
from torch.distributed.tensor import Replicate

import spmd_compiler as sc
from spmd_compiler.testing import assert_training_matches, fake_mesh

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def autocast_step(model, optimizer, ids, targets):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("name,plan_name", [("gpt2", "dp"), ("llama", "tp")])
def test_bf16_autocast_runs_bf16_matmuls_and_trains_like_one_device(name, plan_name):
    torch.manual_seed(0)
    if plan_name == "tp":
        mesh, plan = fake_mesh((2,), ("tp",)), sc.Plan(params=megatron_params(name, 1), default_input=[Replicate()])
    else:
        mesh, plan = fake_mesh((2,), ("dp",)), sc.Plan()
    res = assert_training_matches(autocast_step, MODELS[name]("sdpa"), lambda p: torch.optim.SGD(p, lr=0.5), batches(), mesh, plan,
                                  atol=2e-3, rtol=1e-2)
    for got, want in zip(res.losses, res.reference_losses):
        assert abs(got - want) <= 1e-4 * abs(want), (res.losses, res.reference_losses)
    gm = res.sim.expansions[next(iter(res.sim.expansions))].gm
    dtypes = {n.meta["val"].dtype for n in gm.graph.nodes if n.target in MATMULS}
    assert dtypes == {torch.bfloat16}, dtypes  # autocast kept: every matmul of the step in bfloat16
