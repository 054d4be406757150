"""The zoo on real gloo processes (2 ranks, forked): Hugging Face GPT-2 with SDPA under
data parallel, under Megatron TP and with the sequence split (context parallel, ring
attention: its transfers are all_to_alls whose split sizes come from the coordinate), 3
AdamW steps against one device in each worker. Tolerance: float64, 1e-9 on loss and
parameters."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from test_zoo_hf import SDPA, batches, gpt2, megatron_params
from zoo_common import adamw, lm_step

import spmd_compiler as sc
from gloo_launch import run_processes

pytestmark = pytest.mark.gloo


def _gpt2(rank: int, world: int, plan_name: str) -> dict:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = gpt2("sdpa").double()
    ref = copy.deepcopy(model)
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())
    if plan_name == "dp":
        plan, feed = None, (lambda t: t.chunk(world)[rank])
    elif plan_name == "cp":
        cp = sc.ContextParallel(axis=0, attention="ring")
        plan, feed = sc.Plan(default_input=[sc.Shard(1)], context_parallel=cp), (lambda t: cp.shard(t, 1, rank, world))
    else:
        plan, feed = sc.Plan(params=megatron_params("gpt2", 1), default_input=[sc.Replicate()]), (lambda t: t)
    step = sc.compile(lm_step, mesh=(world,), plan=plan)
    errs = []
    for ids, targets in batches():
        loss = step(model, opt, feed(ids), feed(targets))
        errs.append(abs(loss.item() - lm_step(ref, ref_opt, ids, targets).item()))
    errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    gm = step.last.gm
    q_heads = [n.args[0].meta["val"].shape[1] for n in gm.graph.nodes if n.target is SDPA]
    comms = {(r.phase, r.kind) for r in step.comm_summary().rows}
    return {"err": max(errs), "q_heads": q_heads, "comms": comms}


def _gpt2_plans(rank: int, world: int, plan_names: list[str]) -> dict:
    return {name: _gpt2(rank, world, name) for name in plan_names}


@pytest.fixture(scope="module")
def results():
    """Both plans in one launch (one fork, one transformers import per rank)."""
    return run_processes(_gpt2_plans, 2, ["dp", "tp", "cp"], timeout=480)


@pytest.mark.parametrize("plan_name", ["dp", "tp", "cp"])
def test_gpt2_on_gloo(results, plan_name):
    for rank, res in enumerate(r[plan_name] for r in results):
        assert res["err"] < 1e-9, (rank, res)
        assert ("forward", "all_gather") not in res["comms"], res["comms"]
        # GPT-2 has 2 heads: whole under DP, one per rank under TP; under CP whole, in 5 blocks
        assert res["q_heads"] == {"dp": [2], "tp": [1], "cp": [2] * 5}[plan_name], res
        if plan_name == "cp":
            assert ("forward", "all_to_all") in res["comms"], res["comms"]
