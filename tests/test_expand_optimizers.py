"""Fused optimizers (spmd_compiler/expand/rules/optimizers.py): ``fused=True`` keeps its
one-kernel update in the per-rank program, each parameter's shard updated where it lives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import spmd_compiler as sc
import spmd_compiler.optimize  # noqa: F401
from spmd_compiler.optimize.graph_utils import is_collective
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import GPT, gpt_2d_plan, gpt_fsdp_plan, gpt_tp_plan, train_step

PLANS = {
    "fsdp-uneven": (gpt_fsdp_plan, (3,), ("dp",)),  # dims of 16 and 64 over 3 ranks: padded shards
    "tp": (gpt_tp_plan, (2,), ("tp",)),
    "2d": (gpt_2d_plan, (2, 2), ("dp", "tp")),
}
OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, amsgrad=True, fused=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),  # buffers made at step 1
}
SHARDED = {  # inputs each plan shards
    "fsdp-uneven": ["batch[0]", "tok.weight", "blocks.0.fc.weight"],
    "tp": ["blocks.0.fc.weight", "blocks.0.proj.weight"],
    "2d": ["batch[0]", "blocks.0.fc.weight"],
}
# data parallel alone: "2d" runs it on its dp axis (batch split, replicated parameters
# besides the tp-split ones, gradients all_reduced over dp)
CASES = [("fsdp-uneven", "adamw"), ("fsdp-uneven", "sgd-momentum"), ("tp", "sgd-momentum"),
         ("tp", "adam-amsgrad"), ("2d", "adamw")]


@pytest.fixture
def gpt():
    # one block: the fused update takes every parameter in one kernel whatever their number
    return GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double()


def _train(gpt, plan_name, opt_name, steps=3, **kw):
    make_plan, shape, names = PLANS[plan_name]
    mesh = fake_mesh(shape, names)
    batches = [(torch.randint(0, 32, (6 if shape == (3,) else 4, 8)),) * 2 for _ in range(steps)]
    try:
        return assert_training_matches(train_step, gpt, OPTIMIZERS[opt_name], batches, mesh, make_plan(),
                                       passes=sc.optimize.default_passes(), **kw)
    finally:
        dist.destroy_process_group()


def _fused(res):
    gm = res.sim.expansions[next(iter(res.sim.expansions))].gm
    return gm, [n for n in gm.graph.nodes if str(n.target).startswith("aten._fused_")]


@pytest.mark.parametrize("plan_name,opt_name", CASES)
def test_fused_optimizers_train_as_on_one_device(gpt, plan_name, opt_name):
    warmup = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1.0 / (i + 1))  # noqa: E731
    res = _train(gpt, plan_name, opt_name, make_scheduler=warmup)
    assert_distributed(res, sharded=SHARDED[plan_name])
    gm, fused = _fused(res)
    assert len(fused) == 1  # one kernel for all parameters, on local shards
    params = fused[0].args[0]
    assert len(params) == len(list(gpt.parameters()))
    assert res.sim.compiles == 1  # the state is created before the first trace; lr changes never recompile


def test_fsdp_gradients_are_reduce_scattered_to_their_parameter_shards(gpt):
    """Each gradient is laid out like its (sharded) parameter, not gathered: the
    reductions are reduce_scatters, and their provenance names the fused optimizer."""
    opt = OPTIMIZERS["adamw"](gpt.parameters())
    ids = torch.randint(0, 32, (6, 8))
    train_step(gpt, opt, ids, ids)  # the steady step: Adam state exists
    try:
        ex = sc.expand(sc.trace(train_step, gpt, opt, ids, ids), fake_mesh((3,), ("dp",)), gpt_fsdp_plan())
    finally:
        dist.destroy_process_group()
    fused = [n for n in ex.gm.graph.nodes if is_collective(n) and "_fused_adamw_" in n.meta["spmd_comm"]["why"]]
    assert len(fused) == len(list(gpt.parameters()))  # one reduce_scatter per gradient, for the optimizer
    assert {str(n.target).split(".")[1] for n in fused} == {"reduce_scatter_tensor"}


def test_fused_matches_the_per_parameter_update_of_the_same_optimizer(gpt):
    """fused=True and the for-loop AdamW are the same math: compiled, they agree to
    float64 rounding (a different kernel, not a different algorithm)."""
    make_plan, shape, names = PLANS["tp"]
    out = {}
    for fused in (False, True):
        model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double()
        model.load_state_dict(gpt.state_dict())
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
        step = sc.compile(train_step, mesh=fake_mesh(shape, names), plan=make_plan(), check_ranks=False)
        torch.manual_seed(1)
        for _ in range(3):
            ids = torch.randint(0, 32, (4, 8))
            step(model, opt, ids, ids)
        assert_distributed(step, sharded=SHARDED["tp"])
        out[fused] = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
        dist.destroy_process_group()
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
