"""The strongest hand-built peers a user would pick, for ``step_time.py --strong``.

* :func:`megatron_tp`: Megatron tensor parallelism written by hand for the GPT of
  :mod:`spmd_compiler.testing.models`, no DTensor: q, k, v and fc are column-parallel
  (weight rows and bias split), out and proj row-parallel (weight columns split, bias
  added after the reduction). Megatron's ``f`` (identity forward, all_reduce backward)
  sits once before each attention and MLP, its ``g`` (all_reduce forward, identity
  backward) after them: 2 + 2 ``torch.distributed.all_reduce`` per layer. Replicated
  parameters see the same inputs on every rank, so they need no gradient reduction.
* :func:`ddp_compiled`: DistributedDataParallel with ``torch.compile`` on the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all_reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all_reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _shard(p: torch.Tensor, dim: int, rank: int, world: int) -> nn.Parameter:
    return nn.Parameter(p.detach().chunk(world, dim)[rank].clone())


class MegatronBlock(nn.Module):
    """A GPT Block with its attention and MLP split over the default group."""

    def __init__(self, block: nn.Module, rank: int, world: int) -> None:
        super().__init__()
        attn = block.attn
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.heads, self.head_dim = attn.heads // world, attn.head_dim
        self.register_buffer("mask", attn.mask, persistent=False)
        for name in ("q", "k", "v"):
            lin = getattr(attn, name)
            setattr(self, f"{name}_w", _shard(lin.weight, 0, rank, world))
            setattr(self, f"{name}_b", _shard(lin.bias, 0, rank, world))
        self.out_w, self.out_b = _shard(attn.out.weight, 1, rank, world), attn.out.bias
        self.fc_w, self.fc_b = _shard(block.fc.weight, 0, rank, world), _shard(block.fc.bias, 0, rank, world)
        self.proj_w, self.proj_b = _shard(block.proj.weight, 1, rank, world), block.proj.bias

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = _CopyToParallel.apply(x)
        q = F.linear(x, self.q_w, self.q_b).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = F.linear(x, self.k_w, self.k_b).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = F.linear(x, self.v_w, self.v_b).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return _ReduceFromParallel.apply(F.linear(y, self.out_w)) + self.out_b

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(_CopyToParallel.apply(x), self.fc_w, self.fc_b))
        return _ReduceFromParallel.apply(F.linear(h, self.proj_w)) + self.proj_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln1(x))
        return x + self._mlp(self.ln2(x))


def megatron_tp(model: nn.Module, rank: int, world: int) -> nn.Module:
    """``model`` (a GPT) with every block replaced by a hand-written Megatron block."""
    model.blocks = nn.ModuleList(MegatronBlock(b, rank, world) for b in model.blocks)
    return model


def ddp_compiled(model: nn.Module) -> nn.Module:
    """DistributedDataParallel with torch.compile (inductor) on the wrapped model."""
    from torch.nn.parallel import DistributedDataParallel

    return torch.compile(DistributedDataParallel(model))
