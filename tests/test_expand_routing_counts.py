"""Expert counts as torchtitan's MoE makes them (expand/rules/routing.py ``_sum_counts``):
a one-hot routing map summed over the tokens, ``routing_map.sum(dim=(0, 1))``, is each
rank's own counts (a restricted ``Partial``), also when a replicated counter buffer adds
them up (``tokens_per_expert.add_(counts)`` reduces them for the buffer only): the experts'
offsets stay the rank's, and the routing runs on each rank's own tokens, no gather."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.testing import assert_training_matches, fake_mesh
from spmd_compiler.testing.kernels import float64_grouped_mm

E, K, D, H = 4, 2, 8, 6


class OneHotMoE(nn.Module):
    """torchtitan's routing, written out: one-hot map -> counts; argsort of the chosen
    experts; rows gathered by ``perm // K``; grouped experts; scatter_add back."""

    def __init__(self, counter: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, D) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, D, H) * 0.3)
        self.counter = counter
        self.register_buffer("tokens_per_expert", torch.zeros(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        scores = F.softmax(self.gate(x), dim=-1)
        top_scores, ids = torch.topk(scores, K, dim=-1)
        counts = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=(0, 1))
        if self.counter:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        perm = torch.argsort(ids.view(-1), stable=True)
        sorted_scores = top_scores.view(-1)[perm]
        rows = perm // K
        xt = x.view(b * s, D)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(xt[rows], self.w1.transpose(-2, -1), offs=offs))
        y = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs) * sorted_scores[:, None]
        out = torch.zeros_like(xt).scatter_add(0, rows[:, None].expand(-1, D), y)
        return x + out.view(b, s, D)


def step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _gathers(res):
    return [n.meta["spmd_comm"]["reason"] for e in res.sim.expansions.values() for n in e.collectives() if "all_gather" in str(n.target)]


@pytest.mark.parametrize("counter", [False, True], ids=["counts", "counts+counter-buffer"])
def test_one_hot_counts_are_each_ranks_own(counter):
    torch.manual_seed(0)
    model = OneHotMoE(counter).double()
    batches = [(torch.randn(4, 3, D, dtype=torch.float64), torch.randn(4, 3, D, dtype=torch.float64)) for _ in range(2)]
    with float64_grouped_mm():
        res = assert_training_matches(step, model, lambda p: torch.optim.AdamW(p, lr=0.01), batches, fake_mesh((2,), ("dp",)), sc.Plan())
    assert _gathers(res) == []  # no token is gathered: routing, experts and scatter on each rank's own rows
    if counter:  # the buffer holds the global counts, as on one device: one all_reduce of E numbers
        reduces = [n for e in res.sim.expansions.values() for n in e.collectives() if "all_reduce" in str(n.target) and n.meta["spmd_phase"] == "forward"]
        assert len(reduces) == len(res.sim.expansions), [n.meta["spmd_comm"]["reason"] for n in reduces]
