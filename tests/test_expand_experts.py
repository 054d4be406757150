"""Expert parallelism by placement (spmd_compiler/expand/experts.py): stacked expert
weights split by expert over a mesh axis make each rank run its own experts on the rows
routed to them, forward and backward, equal to one device in float64; each MoE layer
exchanges its rows twice per direction and no more; the exchange runs on real gloo."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_compiler as sc
import spmd_compiler._private_torch as pt
from gloo_launch import run_processes
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.kernels import float64_grouped_mm
from spmd_compiler.testing.moe import MoEConfig, MoETransformer, moe_plan, moe_train_step

CFG = MoEConfig(shared_expert=True, aux_loss=0.01)


def batches(cfg: MoEConfig, n: int = 3, rows: int = 4) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, cfg.vocab, (rows, cfg.seq), generator=g), torch.randint(0, cfg.vocab, (rows, cfg.seq), generator=g)) for _ in range(n)]


def train(plan_name: str, cfg: MoEConfig = CFG):
    (shape, names), plan = moe_plan(plan_name)
    torch.manual_seed(0)
    with float64_grouped_mm():
        return assert_training_matches(moe_train_step, MoETransformer(cfg).double(), lambda p: torch.optim.AdamW(p, lr=0.01),
                                       batches(cfg), fake_mesh(shape, names), plan)


def exchanges(res) -> dict[str, int]:
    """Per phase, how many row exchanges (``all_to_all_rows``) and count swaps rank 0 makes."""
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    out: dict[str, int] = {}
    for n in e.collectives():
        if n.target is pt.ALL_TO_ALL_ROWS:
            key = f"{n.meta['spmd_phase']}/rows"
        elif "expert parallelism" in n.meta["spmd_comm"]["reason"]:
            key = f"{n.meta['spmd_phase']}/counts"
        else:
            continue
        out[key] = out.get(key, 0) + 1
    return out


@pytest.mark.parametrize("plan_name", ["ep", "ep_fsdp", "ep_tp"])
def test_experts_split_by_expert_equal_one_device(plan_name):
    res = train(plan_name)
    # one count swap, rows to the experts and back, in forward and in backward
    assert exchanges(res) == {"forward/counts": 1, "forward/rows": 2, "backward/rows": 2}, exchanges(res)
    assert_distributed(res, sharded=["layers.0.moe.experts.w1", "layers.0.moe.experts.w2"])
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    gathers = [n.meta["spmd_comm"]["reason"] for n in e.collectives() if "all_gather" in str(n.target)]
    assert all(r.startswith("FSDP") for r in gathers), gathers  # no token, no expert weight gathered
    assert all("experts" not in r for r in gathers), gathers


def test_two_layers_exchange_per_layer_and_keep_rows_at_their_experts_between_matmuls():
    """w1, w3, the SwiGLU and w2 all run on the dispatched rows: two exchanges per layer."""
    res = train("ep", MoEConfig(layers=2))
    assert exchanges(res) == {"forward/counts": 2, "forward/rows": 4, "backward/rows": 4}, exchanges(res)


def test_dispatched_rows_are_the_bound_and_gradients_skip_expert_weights():
    """Each rank receives at most every rank's routed rows (n x its own: no token is ever
    dropped); the expert weights' gradients are complete on their rank, so the data
    parallel gradient reduction carries only the other parameters."""
    res = train("ep")
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    rows = [n for n in e.collectives() if n.target is pt.ALL_TO_ALL_ROWS]
    routed = 4 // 2 * CFG.seq * CFG.top_k  # this rank's routed rows
    assert sorted({tuple(n.meta["val"].shape)[0] for n in rows}) == [routed, 2 * routed]
    buckets = [n for n in e.collectives() if n.meta.get("spmd_phase") == "optimizer"]
    expert_numel = sum(p.numel() for n, p in MoETransformer(CFG).named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in MoETransformer(CFG).parameters())
    assert sum(n.meta["val"].numel() for n in buckets) <= total - expert_numel + 2


def _ep_on_gloo(rank: int, world: int) -> dict:
    cfg = CFG
    torch.manual_seed(0)
    model = MoETransformer(cfg).double()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    _, plan = moe_plan("ep")
    step = sc.compile(moe_train_step, mesh=(world,), plan=plan)
    errs = []
    with float64_grouped_mm():
        for ids, targets in batches(cfg):
            loss = step(model, opt, ids.chunk(world)[rank], targets.chunk(world)[rank])
            errs.append(abs(loss.item() - moe_train_step(ref, ref_opt, ids, targets).item()))
    errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    local = model.layers[0].moe.experts.w1.to_local().shape[0]
    return {"err": max(errs), "local_experts": local}


@pytest.mark.gloo
def test_expert_parallel_step_on_gloo_equals_one_device():
    for rank, res in enumerate(run_processes(_ep_on_gloo, 2, timeout=300)):
        assert res["err"] < 1e-9, (rank, res)
        assert res["local_experts"] == CFG.experts // 2
