"""Scaled dot-product attention on shards (spmd_compiler/expand/rules/attention.py) and
the replicate fallback's layouts (spmd_compiler/expand/layout.py).

Every case trains 3 AdamW steps in float64 on all simulated ranks and compares loss and
parameters with one device (atol 1e-9, rtol 1e-7), then checks which collectives the
attention op caused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.expand import registry
from spmd_compiler.expand.layout import stride_order
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh

aten = torch.ops.aten
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class SelfAttention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4, causal: bool = True, mask: bool = False, seq: int = 8) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        # an additive float mask broadcast over batch and heads (padding-like)
        self.register_buffer("mask", torch.randn(seq, seq).double() if mask else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def batches(n=3, batch=4, seq=8, dim=16):
    return [(torch.randn(batch, seq, dim, dtype=torch.float64), torch.randn(batch, seq, dim, dtype=torch.float64)) for _ in range(n)]


def attention_collectives(res) -> list[str]:
    """Collectives emitted for the attention ops' inputs, on every rank."""
    out = []
    for e in res.sim.expansions.values():
        for n in e.collectives():
            reason = n.meta["spmd_comm"]["reason"]
            if "scaled_dot_product" in reason:
                out.append(f"{n.meta['spmd_comm']['kind']}: {reason}")
    return out


def sdpa_nodes(res, op=SDPA):
    step = res.sim.expansions[next(iter(res.sim.expansions))]
    return [n for n in step.gm.graph.nodes if n.target is op]


@pytest.mark.parametrize("causal,mask", [(True, False), (False, True)])
def test_batch_shard_stays_local(mesh4, causal, mask):
    model = SelfAttention(causal=causal, mask=mask).double()
    res = assert_training_matches(step, model, adamw, batches(), mesh4)
    assert attention_collectives(res) == []
    assert_distributed(res, sharded=["batch[0]"], collectives={"forward/all_gather": 0, "forward/all_reduce": 0})
    (fwd,) = sdpa_nodes(res)
    assert fwd.args[0].meta["val"].shape[0] == 1  # batch 4 over 4 ranks


def test_head_shard_stays_local():
    mesh = fake_mesh((2,), ("tp",))
    plan = sc.Plan(params={"[qkv].weight": [Shard(0)], "[qkv].bias": [Shard(0)], "out.weight": [Shard(1)]}, default_input=[Replicate()])
    res = assert_training_matches(step, SelfAttention().double(), adamw, batches(), mesh, plan)
    assert attention_collectives(res) == []
    assert_distributed(res, sharded=["q.weight", "out.weight"])
    (fwd,) = sdpa_nodes(res)
    assert fwd.args[0].meta["val"].shape[1] == 2  # 4 heads over 2 ranks
    (bwd,) = sdpa_nodes(res, SDPA_BACKWARD)
    assert bwd.args[1].meta["val"].shape[1] == 2


def test_batch_and_heads_on_a_2d_mesh(mesh2x2):
    plan = sc.Plan(params={"[qkv].weight": [Replicate(), Shard(0)], "[qkv].bias": [Replicate(), Shard(0)], "out.weight": [Replicate(), Shard(1)]})
    res = assert_training_matches(step, SelfAttention().double(), adamw, batches(), mesh2x2, plan)
    assert attention_collectives(res) == []
    (fwd,) = sdpa_nodes(res)
    assert tuple(fwd.args[0].meta["val"].shape[:2]) == (2, 2)


@pytest.mark.parametrize("causal,mask", [(False, False), (True, False), (False, True)])
def test_sequence_shard(causal, mask):
    """A query split by rows attends to gathered keys/values (a mask split by the same
    rows); with is_causal the rows' global positions matter, so the query is gathered too."""
    mesh = fake_mesh((2,), ("sp",))
    plan = sc.Plan(default_input=[Shard(1)])
    res = assert_training_matches(step, SelfAttention(causal=causal, mask=mask).double(), adamw, batches(), mesh, plan)
    gathered = attention_collectives(res)
    (fwd,) = sdpa_nodes(res)
    q_rows, k_rows = fwd.args[0].meta["val"].shape[2], fwd.args[1].meta["val"].shape[2]
    if causal:
        assert (q_rows, k_rows) == (8, 8)
        assert any("query of" in g for g in gathered), gathered
    else:
        assert (q_rows, k_rows) == (4, 8)  # rows stay split, keys whole
        assert gathered and not any("query of" in g for g in gathered), gathered
        assert all(g.startswith("all_gather") or "backward" in g for g in gathered), gathered
        assert not any("attn_mask" in g for g in gathered), gathered  # the mask's rows stay split


def test_fallback_keeps_traced_layout(mesh4, monkeypatch):
    """Without the attention rule the op falls back to whole tensors; the gathered
    query is contiguous, and the traced ``view`` after ``transpose(1, 2)`` needs the
    traced (batch, seq, heads, dim) layout of the output back (issue #16)."""
    for op in (SDPA, SDPA_BACKWARD):
        monkeypatch.delitem(registry._RULES, op)
    res = assert_training_matches(step, SelfAttention().double(), adamw, batches(), mesh4)
    fallback = [n for e in res.sim.expansions.values() for n in e.gm.graph.nodes if "spmd_fallback" in n.meta]
    assert {n.target for n in fallback} == {SDPA, SDPA_BACKWARD}
    assert attention_collectives(res)  # the fallback gathers


def test_stride_order():
    t = torch.empty(2, 3, 4, 5).transpose(1, 2)
    assert stride_order(t.shape, t.stride()) == [0, 2, 1, 3]
    assert stride_order((2, 3), (3, 1)) == [0, 1]
    assert stride_order((2, 3), (0, 1)) is None  # expanded: not dense
