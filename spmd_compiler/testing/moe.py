"""A small mixture-of-experts transformer, written the way torchtitan writes its MoE.

Token-choice top-k routing (softmax or sigmoid scores, ``topk``), per-expert counts by
``histc``, tokens sorted by expert (``argsort``), each expert a SwiGLU on its contiguous
group (``torch._grouped_mm`` over stacked weights ``w1``/``w3`` ``(experts, hidden, dim)``
and ``w2`` ``(experts, dim, hidden)``), results scattered back to the tokens
(``scatter_add``), an optional shared expert and the load-balancing auxiliary loss.

Plans (:func:`moe_plan`): ``"dp"``, ``"fsdp"``, ``"ep"`` (experts split over the data
axis), ``"ep_fsdp"`` (the same, the rest FSDP), ``"ep_tp"`` (a 2-D ``(dp, tp)`` mesh:
experts split over ``dp``, their hidden dim over ``tp``, attention Megatron on ``tp``).

``torch._grouped_mm`` has no float64 CPU kernel: compare in float64 inside
:func:`spmd_compiler.testing.kernels.float64_grouped_mm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from ..plan import Plan

__all__ = ["MoEConfig", "MoETransformer", "moe_train_step", "moe_plan", "MOE_PLANS"]


@dataclass(frozen=True)
class MoEConfig:
    vocab: int = 32
    seq: int = 8
    dim: int = 16
    heads: int = 2
    layers: int = 1
    experts: int = 4
    top_k: int = 2
    hidden: int = 8
    shared_expert: bool = False
    score: str = "softmax"
    aux_loss: float = 0.0


class GroupedExperts(nn.Module):
    """Stacked SwiGLU experts run on rows grouped by expert (``offs``: cumulative counts)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        e, h, d = cfg.experts, cfg.hidden, cfg.dim
        self.w1 = nn.Parameter(torch.randn(e, h, d) * d**-0.5)
        self.w3 = nn.Parameter(torch.randn(e, h, d) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, d, h) * h**-0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = GroupedExperts(cfg)
        self.shared = nn.Sequential(nn.Linear(cfg.dim, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, cfg.dim)) if cfg.shared_expert else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        logits = self.router(tokens)
        probs = torch.sigmoid(logits) if self.cfg.score == "sigmoid" else torch.softmax(logits, dim=-1)
        scores, ids = torch.topk(probs, self.cfg.top_k, dim=-1)
        scores = scores / scores.sum(dim=-1, keepdim=True)
        counts = torch.histc(ids.view(-1).to(x.dtype), bins=self.cfg.experts, min=0, max=self.cfg.experts)
        order = torch.argsort(ids.view(-1), stable=True)
        rows = order // self.cfg.top_k
        routed = self.experts(tokens[rows], counts)
        routed = routed * scores.view(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(tokens).scatter_add(0, rows.unsqueeze(-1).expand(-1, d), routed)
        if self.shared is not None:
            out = out + self.shared(tokens)
        # load balancing (Switch): experts' share of tokens times their mean probability
        aux = (counts / counts.sum() * probs.mean(dim=0)).sum() * self.cfg.experts
        return out.view(b, s, d), aux


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.qkv = nn.ModuleDict({n: nn.Linear(cfg.dim, cfg.dim, bias=False) for n in ("q", "k", "v")})
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (self.qkv[n](h).view(b, s, self.heads, -1).transpose(1, 2) for n in ("q", "k", "v"))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        out, aux = self.moe(self.norm2(x))
        return x + out, aux


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig = MoEConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(ids)
        aux = x.new_zeros(())
        for layer in self.layers:
            x, a = layer(x)
            aux = aux + a
        return self.head(self.norm(x)), aux


def moe_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits, aux = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    if model.cfg.aux_loss:
        loss = loss + model.cfg.aux_loss * aux
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


_ATTENTION_TP = {"*.qkv.*": [Shard(0)], "*.o.weight": [Shard(1)]}
_EXPERTS_TP = {"*.experts.w1": [Shard(1)], "*.experts.w3": [Shard(1)], "*.experts.w2": [Shard(2)]}


def moe_plan(name: str) -> tuple[tuple[tuple[int, ...], tuple[str, ...]], Plan]:
    """``((mesh shape, axis names), Plan)`` of a named plan (:data:`MOE_PLANS`)."""
    if name == "dp":
        return ((2,), ("dp",)), Plan()
    if name == "fsdp":
        return ((2,), ("dp",)), Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",))
    if name == "ep":
        return ((2,), ("dp",)), Plan(params={"*.experts.*": [Shard(0)]})
    if name == "ep_fsdp":
        return ((2,), ("dp",)), Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",), expert_axes=("dp",))
    if name in ("ep_tp", "tp_2d"):
        experts = {k: [Shard(0) if name == "ep_tp" else Replicate(), *v] for k, v in _EXPERTS_TP.items()}
        params = {**experts, **{k: [Replicate(), *v] for k, v in _ATTENTION_TP.items()}}
        return ((2, 2), ("dp", "tp")), Plan(params=params, default_input=[Shard(0), Replicate()])
    raise ValueError(f"unknown MoE plan {name!r}; expected one of {MOE_PLANS}")


MOE_PLANS = ("dp", "fsdp", "ep", "ep_fsdp", "ep_tp", "tp_2d")
