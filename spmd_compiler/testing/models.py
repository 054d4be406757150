"""Small models and plans used by tests, examples and benchmarks.

* :class:`MLP` - two Linear layers with ReLU (the Megatron MLP when planned with
  :func:`megatron_mlp_plan`).
* :class:`GPT` - a decoder-only transformer: token and position embeddings, blocks of
  LayerNorm, causal softmax attention and a GELU MLP, a final LayerNorm and an LM head
  (optionally tied to the token embedding), trained with cross-entropy.

Plans follow Megatron-LM: attention q/k/v and MLP fc are split by output features
(``Shard(0)`` of the weight), attention out and MLP proj by input features
(``Shard(1)``), so each block needs one all_reduce in forward per sub-layer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from ..plan import Plan

__all__ = [
    "backward_step",
    "optimizer_step",
    "MLP",
    "GPT",
    "GPTConfig",
    "train_step",
    "megatron_mlp_plan",
    "gpt_tp_plan",
    "gpt_fsdp_plan",
    "gpt_2d_plan",
]


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, out: int | None = None) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, hidden)
        self.l2 = nn.Linear(hidden, out or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    # activation checkpointing of each block: None (off), "full" (torch.utils.checkpoint),
    # or the aten ops whose outputs are saved (torchtitan's selective policy: those are not
    # recomputed, the rest is)
    checkpoint: Any = None


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.register_buffer("mask", torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.out(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        cfg = cfg or GPTConfig(**overrides)
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x) if self.cfg.checkpoint is None else checkpoint(
                block, x, use_reentrant=False, context_fn=_checkpoint_contexts(self.cfg.checkpoint))
        return self.head(self.ln(x))


def _checkpoint_contexts(mode: Any) -> Any:
    """``context_fn`` of ``torch.utils.checkpoint`` for :attr:`GPTConfig.checkpoint`."""
    if mode == "full":
        return noop_context_fn
    save = frozenset(mode)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One language-model training step: forward, cross-entropy, backward, update."""
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def megatron_mlp_plan(ndim: int = 1, axis: int = 0) -> Plan:
    """First Linear split by output features, second by input features."""

    def on(p: Any) -> list[Any]:
        pl: list[Any] = [Replicate()] * ndim
        pl[axis] = p
        return pl

    return Plan(params={"l1.weight": on(Shard(0)), "l1.bias": on(Shard(0)), "l2.weight": on(Shard(1))})


def _tp_params(ndim: int, axis: int) -> dict[str, list[Any]]:
    def on(p: Any) -> list[Any]:
        pl: list[Any] = [Replicate()] * ndim
        pl[axis] = p
        return pl

    return {
        "blocks.*.attn.[qkv].weight": on(Shard(0)),
        "blocks.*.attn.[qkv].bias": on(Shard(0)),
        "blocks.*.attn.out.weight": on(Shard(1)),
        "blocks.*.fc.weight": on(Shard(0)),
        "blocks.*.fc.bias": on(Shard(0)),
        "blocks.*.proj.weight": on(Shard(1)),
    }


def gpt_tp_plan() -> Plan:
    """Megatron tensor parallelism on a 1-D mesh; batch replicated."""
    return Plan(params=_tp_params(1, 0), default_input=[Replicate()])


def gpt_fsdp_plan(ndim: int = 1, *, reshard_after_forward: bool = True) -> Plan:
    """FSDP: every parameter stored split along dim 0 and gathered for compute (again for
    backward unless ``reshard_after_forward=False``); batch split along dim 0."""
    return Plan(params={"*": [Shard(0)] * ndim}, default_input=[Shard(0)] * ndim, fsdp_axes=tuple(range(ndim)),
                reshard_after_forward=reshard_after_forward)


def gpt_2d_plan() -> Plan:
    """Data parallel on mesh axis 0 ("dp") and Megatron TP on axis 1 ("tp")."""
    return Plan(params=_tp_params(2, 1), default_input=[Shard(0), Replicate()])


class SkipNet(nn.Module):
    """Four layers cut by ``pipe_split()`` calls into four stages, with a skip connection
    from stage 0 to stage 2 and a dict passed between sub-modules."""

    def __init__(self, dim: int = 8, batchnorm: bool = False) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(dim, dim) for _ in range(4))
        self.norm = nn.BatchNorm1d(dim) if batchnorm else None

    def block(self, x: torch.Tensor) -> dict[str, Any]:
        return {"h": torch.relu(self.l1(x)), "scale": 0.5, "none": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..trace.markers import pipe_split

        h0 = torch.relu(self.l0(x))
        if self.norm is not None:
            h0 = self.norm(h0)
        pipe_split()
        out = self.block(h0)
        pipe_split()
        h2 = torch.relu(self.l2(out["h"])) * out["scale"] + h0  # skip over stage 1
        pipe_split()
        return self.l3(h2)


def mse_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward, mean-squared error, backward, update."""
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def accumulating_mse_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, do_step: bool) -> torch.Tensor:
    """Gradient accumulation over calls: backward every call, an update when ``do_step``."""
    loss = F.mse_loss(model(x), y)
    loss.backward()
    if do_step:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def backward_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Half of gradient accumulation across calls: MSE loss and ``backward()`` only (the
    gradients are left on the parameters)."""
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The other half: apply the accumulated gradients and clear them."""
    optimizer.step()
    optimizer.zero_grad()
