"""A torchtitan-style Llama 3, written the way torchtitan's ``models/llama3/model.py``
writes it (our own code, same idioms): rotary embeddings as complex numbers
(``torch.polar`` frequencies in a non-persistent buffer, ``view_as_complex`` /
``view_as_real`` of the heads computed in float32), grouped-query attention by
``repeat_kv`` (unsqueeze, expand, reshape), ``nn.RMSNorm``, a SwiGLU feed-forward, causal
SDPA, layers in an ``nn.ModuleDict``, and torchtitan's tensor-parallel plan (colwise
``wq/wk/wv/w1/w3``, rowwise ``wo/w2``).

``rope_dtype``: torchtitan computes the rotation in float32 (``xq.float()``, complex64
frequencies) whatever the model's dtype; a float64 model with ``rope_dtype=torch.float64``
stays float64 throughout, for exact comparisons.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

VOCAB, SEQ, BATCH = 64, 16, 4


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].to(dtype) / dim))
    t = torch.arange(end, dtype=dtype)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    real = freqs_cis.real.dtype
    xq_ = torch.view_as_complex(xq.to(real).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.to(real).reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # -1, not n_heads: under tensor parallelism the local heads are fewer
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden_dim: int | None = None) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, hidden_dim or 4 * dim)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, dim: int = 32, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
                 rope_dtype: torch.dtype = torch.float32, *, vocab: int = VOCAB, hidden_dim: int | None = None,
                 max_seq: int = SEQ * 2, rope_theta: float = 10000.0) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq, rope_theta, dtype=rope_dtype), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, n_kv_heads, hidden_dim) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def tp_params(ndim: int = 1) -> dict:
    """torchtitan's ``parallelize_llama`` plan for the blocks, on the last mesh axis."""
    rest = [Replicate()] * (ndim - 1)
    col, row = rest + [Shard(0)], rest + [Shard(1)]
    return {"layers.*.attention.w[qkv].weight": col, "layers.*.attention.wo.weight": row,
            "layers.*.feed_forward.w[13].weight": col, "layers.*.feed_forward.w2.weight": row}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's step: cross entropy of the logits in float32 (torchtitan's ``.float()``;
    a float64 model's stay float64), backward, clip, update."""
    pred = model(tokens)
    loss = F.cross_entropy(pred.flatten(0, 1).to(torch.promote_types(pred.dtype, torch.float32)), labels.flatten(0, 1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def batches(n: int = 3) -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(n)]
