"""Token routing on each rank's own tokens (spmd_compiler/expand/orders.py,
expand/rules/routing.py, expand/rules/grouped_mm.py): a torchtitan-style MoE under data
parallel and FSDP moves no token, equals one device in float64, and a routing the rules
do not understand is expanded on gathered tokens, still exact."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.kernels import float64_grouped_mm
from spmd_compiler.testing.moe import MoEConfig, MoETransformer, moe_plan, moe_train_step


def batches(cfg: MoEConfig, n: int = 3, rows: int = 4) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, cfg.vocab, (rows, cfg.seq), generator=g), torch.randint(0, cfg.vocab, (rows, cfg.seq), generator=g)) for _ in range(n)]


def train(plan_name: str, cfg: MoEConfig = MoEConfig(), **tolerance: float):
    (shape, names), plan = moe_plan(plan_name)
    torch.manual_seed(0)
    model = MoETransformer(cfg).double()
    with float64_grouped_mm():
        return assert_training_matches(moe_train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), batches(cfg),
                                       fake_mesh(shape, names), plan, **tolerance)


def activation_collectives(res) -> list[str]:
    """Every collective of rank 0 that moves more than parameters, gradients and a few
    numbers: the forward/backward ones on tensors of at least a token's row per token."""
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    out = []
    for n in e.collectives():
        comm = n.meta["spmd_comm"]
        if n.meta.get("spmd_phase") in ("forward", "backward") and not comm["reason"].startswith("FSDP") and comm["bytes"] >= 64 * 8:
            out.append(f"{n.meta['spmd_phase']} {comm['kind']}: {comm['reason']}")
    return out


@pytest.mark.parametrize("plan_name", ["dp", "fsdp"])
def test_moe_tokens_stay_on_their_rank(plan_name):
    """Routing, experts and the scatter back run on each rank's own tokens: no token row
    moves, only parameters, gradients and per-expert counts."""
    res = train(plan_name, MoEConfig(shared_expert=True, aux_loss=0.01))
    assert activation_collectives(res) == []
    assert_distributed(res, sharded=["batch[0]"], collectives=1)


def test_sorted_rows_never_leave_the_restricted_program():
    """The expansion of the DP step tags the sort's outputs rank-local and never issues a
    collective on them: the per-rank program sorts only its own 16 routed rows."""
    res = train("dp")
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    sorts = [n for n in e.gm.graph.nodes if n.op == "call_function" and n.target in (torch.ops.aten.sort.stable, torch.ops.aten.sort.default)]
    # each rank: 2 of the 4 rows x 8 tokens x top 2 = 32 routed rows (of 64)
    assert sorts and all(tuple(n.meta["val"][0].shape) == (32,) for n in sorts)


class CumsumRouting(torch.nn.Module):
    """Routing whose sorted rows feed a running sum over the rows (positions in the sorted
    order, as a capacity computation would): no local form, so the sort runs on gathered
    tokens; the result must still be one device's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = self.w(x).sum(-1)
        values, order = torch.sort(key)
        running = torch.cumsum(values, 0)  # depends on every rank's rows
        return (running * values).sum() + x[order].pow(2).sum()


def test_routing_with_no_local_form_is_gathered_and_exact(caplog):
    def step(model, opt, x):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    torch.manual_seed(0)
    data = [(torch.randn(8, 4, dtype=torch.float64),) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"):
        res = assert_training_matches(step, CumsumRouting().double(), lambda p: torch.optim.SGD(p, lr=0.1), data,
                                      fake_mesh((2,), ("dp",)), sc.Plan())
    assert any("runs on gathered tokens" in r.getMessage() for r in caplog.records)
    assert any("all_gather" in c for c in activation_collectives(res) + [str(n.target) for e in res.sim.expansions.values() for n in e.collectives()])


def test_histc_of_split_values_is_each_ranks_counts():
    """``histc`` of a batch-split tensor is a Partial sum of each rank's histogram."""
    def step(model, opt, x):
        counts = torch.histc(model(x).argmax(-1).to(x.dtype), bins=4, min=0, max=4)
        loss = (counts * model.weight.sum(1)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    torch.manual_seed(0)
    data = [(torch.randn(8, 4, dtype=torch.float64),)]
    res = assert_training_matches(step, torch.nn.Linear(4, 4).double(), lambda p: torch.optim.SGD(p, lr=0.1), data,
                                  fake_mesh((2,), ("dp",)), sc.Plan())
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    assert [n for n in e.collectives() if "all_gather" in str(n.target)] == []
