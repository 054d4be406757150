"""Expert parallelism by placement (spmd_compiler/expand/experts.py): stacked expert
weights split by expert over a mesh axis make each rank run its own experts on the rows
routed to them, forward and backward, equal to one device in float64; each MoE layer
exchanges its rows twice per direction and no more; the exchange runs on real gloo."""

from __future__ import annotations

import copy
import dataclasses

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


def _all_to_rank_0(cfg: MoEConfig) -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(cfg).double()
    with torch.no_grad():
        model.layers[0].moe.router.weight.zero_()
        model.layers[0].moe.router.weight[:2] = 5.0  # experts 0 and 1 win for every token whose mean is > 0
        model.embed.weight.abs_()  # every token's features positive: the two biased experts win everywhere
    return model


def test_every_token_to_one_expert_is_never_dropped():
    """Dropless: the router sends every token to experts 0 and 1 (both on rank 0), so rank
    0 receives every rank's rows: the bound (n x its own) holds them all, and the result
    is one device's."""
    cfg = MoEConfig()
    model = _all_to_rank_0(cfg)
    (shape, names), plan = moe_plan("ep")
    data = [(torch.randint(0, cfg.vocab, (4, cfg.seq)), torch.randint(0, cfg.vocab, (4, cfg.seq))) for _ in range(2)]
    chosen = []
    hook = model.layers[0].moe.router.register_forward_hook(lambda m, i, o: chosen.append(o.topk(2, -1)[1]))
    with float64_grouped_mm():
        model(data[0][0])
        hook.remove()
        assert chosen and bool((chosen[0] < 2).all())  # every token to experts 0 and 1: all rows to rank 0
        assert_training_matches(moe_train_step, model, lambda p: torch.optim.SGD(p, lr=0.01), data, fake_mesh(shape, names), plan)


class CheckpointedMoE(MoETransformer):
    """Every layer under ``torch.utils.checkpoint``: its routing, exchanges and experts are
    recomputed in backward."""

    def forward(self, ids):
        x = self.embed(ids)
        aux = x.new_zeros(())
        for layer in self.layers:
            x, a = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            aux = aux + a
        return self.head(self.norm(x)), aux


def test_expert_parallel_layer_under_activation_checkpointing():
    cfg = MoEConfig()
    (shape, names), plan = moe_plan("ep")
    torch.manual_seed(0)
    with float64_grouped_mm():
        res = assert_training_matches(moe_train_step, CheckpointedMoE(cfg).double(), lambda p: torch.optim.AdamW(p, lr=0.01),
                                      batches(cfg), fake_mesh(shape, names), plan)
    ex = exchanges(res)
    assert ex["forward/rows"] == 2 and ex["backward/rows"] >= 4, ex  # the recompute exchanges its rows again


def test_expert_parallel_under_bfloat16_autocast():
    """torch.autocast(bfloat16) around the step (float32 model): the experts' grouped
    matmuls run in bfloat16 on the dispatched rows; equal to one device under the same
    autocast within bfloat16's rounding."""
    cfg = MoEConfig()
    (shape, names), plan = moe_plan("ep")

    def step(model, opt, ids, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return moe_train_step(model, opt, ids, targets)

    torch.manual_seed(0)
    res = assert_training_matches(step, MoETransformer(MoEConfig(dim=16, hidden=16)), lambda p: torch.optim.AdamW(p, lr=0.01),
                                  batches(cfg), fake_mesh(shape, names), plan, atol=2e-2, rtol=2e-2)
    assert exchanges(res)["forward/rows"] == 2


def test_a_capacity_that_holds_the_rows_trains_as_one_device_and_checks_every_rank():
    """``Plan(expert_capacity=1.5)`` on 2 ranks: a receive buffer of 1.5 x a rank's own
    rows (instead of 2 x), equal to one device; one all_reduce(max) per layer tells every
    rank the most rows any rank receives (no such check without a capacity)."""
    (shape, names), plan = moe_plan("ep")
    torch.manual_seed(0)
    with float64_grouped_mm():
        res = assert_training_matches(moe_train_step, MoETransformer(CFG).double(), lambda p: torch.optim.AdamW(p, lr=0.01),
                                      batches(CFG), fake_mesh(shape, names), dataclasses.replace(plan, expert_capacity=1.5))
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    routed = 4 // 2 * CFG.seq * CFG.top_k
    rows = sorted({tuple(n.meta["val"].shape)[0] for n in e.collectives() if n.target is pt.ALL_TO_ALL_ROWS})
    assert rows == [routed, routed * 3 // 2], rows
    checks = [n for n in e.collectives() if "the most rows a rank's experts receive" in n.meta["spmd_comm"]["reason"]]
    assert len(checks) == 1 and checks[0].args[1] == "max", checks
    assert "the most rows" not in str([n.meta["spmd_comm"]["reason"] for n in train("ep").sim.expansions[
        next(iter(train("ep").sim.expansions))].collectives()])


def _overflow_on_gloo(rank: int, world: int) -> dict:
    cfg = MoEConfig()
    model = _all_to_rank_0(cfg)
    _, plan = moe_plan("ep")
    step = sc.compile(moe_train_step, mesh=(world,), plan=dataclasses.replace(plan, expert_capacity=1.0), progress=False)
    ids = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=torch.Generator().manual_seed(1))
    try:
        with float64_grouped_mm():
            step(model, torch.optim.SGD(model.parameters(), lr=0.01), ids.chunk(world)[rank], ids.chunk(world)[rank])
    except sc.ExpertCapacityError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.gloo
def test_an_exceeded_capacity_stops_every_rank_with_the_fix():
    """Every token to rank 0's experts under ``expert_capacity=1.0``: rank 0 would receive
    twice its buffer. Both ranks stop at the same exchange with ExpertCapacityError (rank
    1, which receives nothing, too; before, it met a peer that had gone: "Connection closed
    by peer"), naming the capacity the step needs."""
    for rank, res in enumerate(run_processes(_overflow_on_gloo, 2, timeout=300)):
        assert res["error"] is not None, (rank, res)
        assert "routes 64 rows to the experts of one rank" in res["error"] and "expert_capacity=...) of at least 2.00" in res["error"], res


def test_an_exceeded_capacity_is_an_error_in_the_simulator_too():
    """The same overflow with every rank simulated in one process: ExpertCapacityError
    (the simulator makes every rank's check at once), never a dropped row."""
    cfg = MoEConfig()
    (shape, names), plan = moe_plan("ep")
    data = [(torch.randint(0, cfg.vocab, (4, cfg.seq)), torch.randint(0, cfg.vocab, (4, cfg.seq)))]
    with float64_grouped_mm(), pytest.raises(sc.ExpertCapacityError, match=r"routes 64 rows .* of at least 2\.00"):
        assert_training_matches(moe_train_step, _all_to_rank_0(cfg), lambda p: torch.optim.SGD(p, lr=0.01), data,
                                fake_mesh(shape, names), dataclasses.replace(plan, expert_capacity=1.0))
