"""Context-parallel attention (spmd_compiler/expand/rules/context_parallel.py, the plan's
ContextParallel in spmd_compiler/plan/context.py, the head-tail layout of
spmd_compiler/expand/head_tail.py): a causal attention step with the sequence split over
a ``cp`` axis equals one device in float64 (all-gather and ring, load-balanced or not),
each rank computes its share of the attention (FLOPs counted per rank from its program),
no query is gathered, and the ring's transfers are in flight while a block is computed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh

aten = torch.ops.aten
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class Block(nn.Module):
    """Pre-norm causal self-attention with learned positions (a replicated table the
    sequence split must take in the same layout as the tokens) and a token embedding."""

    def __init__(self, vocab: int = 16, seq: int = 16, dim: int = 16, heads: int = 2, causal: bool = True, checkpoint: bool = False) -> None:
        super().__init__()
        self.heads, self.causal, self.checkpoint = heads, causal, checkpoint
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(self.norm(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[:ids.shape[1]]
        y = torch.utils.checkpoint.checkpoint(self.attention, x, use_reentrant=False) if self.checkpoint else self.attention(x)
        return self.head(x + y)


def lm_step(model, optimizer, ids, targets):
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def batches(n: int = 2, batch: int = 2, seq: int = 16) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 16, (batch, seq), generator=g), torch.randint(0, 16, (batch, seq), generator=g)) for _ in range(n)]


def train(ranks: int, *, attention: str = "allgather", load_balance: bool = True, causal: bool = True, checkpoint: bool = False, **plan):
    torch.manual_seed(0)
    cp = sc.ContextParallel(axis="cp", attention=attention, load_balance=load_balance)
    return assert_training_matches(lm_step, Block(causal=causal, checkpoint=checkpoint).double(), lambda p: torch.optim.AdamW(p, lr=0.01), batches(),
                                   fake_mesh((ranks,), ("cp",)), sc.Plan(default_input=[Shard(1)], context_parallel=cp, **plan),
                                   atol=1e-10, rtol=1e-8)


def attention_work(gm) -> float:
    """Score entries one rank's attention forward computes (per batch row and head):
    ``rows x keys`` per kernel call, ``rows (rows + 1) / 2`` for a causal square one."""
    work = 0.0
    for n in gm.graph.nodes:
        if n.target is SDPA:
            rows, keys = n.args[0].meta["val"].shape[2], n.args[1].meta["val"].shape[2]
            causal = len(n.args) > 4 and n.args[4]
            work += rows * (rows + 1) / 2 if causal else rows * keys
    return work


def reasons(res) -> list[str]:
    return [f"{n.meta['spmd_phase']}/{n.meta['spmd_comm']['kind']}: {n.meta['spmd_comm']['reason']}"
            for e in res.sim.expansions.values() for n in e.collectives()]


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_causal_attention_in_blocks(attention):
    """4 ranks, head-tail layout: equal to one device, a quarter of the causal attention on
    every rank, nothing but keys/values (and their gradients) moving for attention."""
    res = train(4, attention=attention)
    dist = assert_distributed(res, sharded=["batch[0]"])
    seq = 16
    share = seq * (seq + 1) / 2 / 4
    works = [attention_work(e.gm) for e in res.sim.expansions.values()]
    assert max(works) <= 1.05 * min(works) and all(abs(w - share) <= 0.05 * share for w in works), (works, share)
    attention_comms = [r for r in reasons(res) if "scaled_dot_product" in r]
    assert not any("query" in r for r in attention_comms), attention_comms
    first = next(iter(res.sim.expansions.values()))
    if attention == "allgather":  # one gather of keys and values (backward reuses it), one reduce_scatter of their gradients
        assert dist.count("forward/all_gather") == 1 and dist.count("backward/reduce_scatter") == 1, dist.describe()
        assert dist.count("all_to_all") == 0, dist.describe()
    else:  # 3 transfers forward; 3 of keys/values and 4 of their gradients backward
        assert dist.count("forward/all_to_all") == 3 and dist.count("backward/all_to_all") == 7, dist.describe()
        # the position table's gradient is split by positions: gathered for its update, nothing else
        assert dist.count("forward/all_gather") == dist.count("backward/all_gather") == 0, dist.describe()
        assert_transfers_overlap(first.gm)


def assert_transfers_overlap(gm) -> None:
    """Every ring transfer of keys and values is in flight over a kernel call, and so is
    every transfer of their gradients but the last (home, after the last block)."""
    nodes = list(gm.graph.nodes)
    alone = []
    for i, n in enumerate(nodes):
        if n.target is torch.ops._c10d_functional.all_to_all_single.default:
            (wait,) = n.users
            if not any(m.target in (SDPA, SDPA_BACKWARD) for m in nodes[i + 1:nodes.index(wait)]):
                alone.append(n.meta["spmd_comm"]["reason"])
    assert len(alone) == 1 and "gradients" in alone[0], alone


def test_contiguous_pieces():
    """Without load balancing each rank holds one run of the sequence; causal blocks above
    the diagonal are computed and dropped (every rank the work of ``seq^2 / n``)."""
    res = train(2, load_balance=False)
    works = [attention_work(e.gm) for e in res.sim.expansions.values()]
    assert works == [8 * 9 / 2 + 8 * 8] * 2, works


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_without_causal_mask(attention):
    """Every block is one full call: keys and values gathered at once (stacked), or the
    one transfer of a 2-rank ring."""
    res = train(2, attention=attention, causal=False)
    assert not any("query" in r for r in reasons(res)), reasons(res)
    dist = assert_distributed(res, sharded=["batch[0]"])
    kind = "forward/all_gather" if attention == "allgather" else "forward/all_to_all"
    assert dist.count(kind) == 1, dist.describe()


def test_head_tail_layout_of_the_batch():
    """What each rank is fed: its head and tail chunks (here rank 1 of 2 over 8 positions:
    2, 3, 4, 5), and the learned positions reach each rank in the same order."""
    cp = sc.ContextParallel()
    x = torch.arange(8)[None].repeat(2, 1)
    assert cp.shard(x, 1, 1, 2).tolist() == [[2, 3, 4, 5]] * 2
    assert sc.ContextParallel(load_balance=False).shard(x, 1, 1, 2).tolist() == [[4, 5, 6, 7]] * 2
    with pytest.raises(ValueError, match="multiple of 2 x 2 = 4"):
        cp.shard(torch.zeros(1, 6), 1, 0, 2)


def test_plan_validation():
    with pytest.raises(ValueError, match="expected one of 'allgather', 'ring'"):
        sc.ContextParallel(attention="all_gather")
    with pytest.raises(TypeError, match="expected a spmd_compiler.ContextParallel"):
        sc.Plan(context_parallel="cp")
    with pytest.raises(ValueError, match="is not a mesh axis; mesh axes are"):
        sc.ContextParallel(axis="sp").axis_index(fake_mesh((2,), ("cp",)))


def test_data_and_context_parallel_2d():
    """(dp 2, cp 2): batch rows over dp, sequence over cp; gradients reduced over both."""
    torch.manual_seed(0)
    cp = sc.ContextParallel(axis="cp", attention="ring")
    plan = sc.Plan(default_input=[Shard(0), Shard(1)], context_parallel=cp)
    res = assert_training_matches(lm_step, Block().double(), lambda p: torch.optim.AdamW(p, lr=0.01), batches(batch=4), fake_mesh((2, 2), ("dp", "cp")),
                                  plan, atol=1e-10, rtol=1e-8)
    dist = assert_distributed(res, sharded=["batch[0]"])
    assert dist.count("forward/all_gather") == dist.count("backward/all_gather") == 0, dist.describe()


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_activation_checkpointing(attention):
    """A checkpointed attention block: its projections are recomputed in backward (the
    trace keeps the kernel's outputs, as torch.compile's partitioner does), the attention
    backward reads the recomputed keys, and the recomputation stays in backward (the
    schedule pass sinks nothing that precedes it past that gather: the intent check)."""
    from spmd_compiler.trace.markers import RECOMPUTE

    res = train(2, attention=attention, checkpoint=True)
    first = next(iter(res.sim.expansions.values()))
    assert any(RECOMPUTE in n.meta for n in first.gm.graph.nodes)
    works = [attention_work(e.gm) for e in res.sim.expansions.values()]
    assert works == [16 * 17 / 2 / 2] * 2, works


@pytest.mark.parametrize("attention", ["allgather", "ring"])
@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
def test_cuda_kernels_in_blocks(kernel, attention):
    """CUDA's flash, efficient and cuDNN kernels (forward and backward, traced on fake CUDA
    tensors: structure only, their numerics need a GPU) under a causal mask over 2 ranks:
    no query gathered, 5 block calls each way (3 at the rank's own block, 2 at the other),
    every block of 32 rows (the efficient kernel pads its logsumexp to 32), results split
    by rows."""
    from spmd_compiler.plan import CPLayout
    from test_expand_attention import KERNELS, comms, results

    ex = cuda_expansion_cp(kernel, CPLayout(0, attention, True))
    assert not any("query" in c for c in comms(ex)), comms(ex)
    _, fwd, bwd = KERNELS[kernel]
    calls = {op: [n for n in ex.graph.nodes if n.target is op] for op in (fwd, bwd)}
    assert len(calls[fwd]) == len(calls[bwd]) == 5
    assert {n.args[0].meta["val"].shape[2] for n in calls[fwd] + calls[bwd]} == {32}
    assert [r[0] for r in results(ex, fwd)[:2]] == ["S(2)", "S(2)"] and [r[0] for r in results(ex, bwd)[:3]] == ["S(2)"] * 3
    assert results(ex, fwd)[0][1] == (4, 4, 64, 8)  # this rank's 64 of 128 rows


def cuda_expansion_cp(kernel, cp):
    from test_expand_attention import cuda_expansion

    return cuda_expansion(kernel, fake_mesh((2,), ("cp",)), [Shard(2)], seq=128, causal=True, cp=cp)
