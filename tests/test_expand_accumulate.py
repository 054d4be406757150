"""Accumulating writes of split values into a whole tensor (expand/rules/accumulate.py):
``index_put(accumulate=True)``, ``index_add`` and ``scatter_add`` of batch-split values
give a ``Partial(sum)`` result instead of gathering the values; equal to one device,
uneven splits included, collectives counted."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_spmd_matches, assert_training_matches, fake_mesh

aten = torch.ops.aten


def _reasons(run) -> list[str]:
    return [n.meta["spmd_comm"]["reason"] for step in run.steps.values() for n in step.collectives()]


def _results(run, op) -> list[str]:
    from spmd_compiler.expand.values import placements_text

    step = next(iter(run.steps.values()))
    return [placements_text(n.meta["spmd_spec"].placements) for n in step.gm.graph.nodes if n.target is op]


def put(values, idx):
    return torch.zeros(7, values.shape[-1], dtype=values.dtype).index_put((idx,), values, accumulate=True) * 2


@pytest.mark.parametrize("ranks", [2, 3])  # 6 rows over 3 ranks; 5 rows over 2 (uneven)
@pytest.mark.parametrize("index_placement", ["shard", "replicate"])
def test_index_put_of_split_values_is_partial(ranks, index_placement):
    rows = 6 if ranks == 3 else 5
    values = torch.randn(rows, 3, dtype=torch.float64)
    idx = torch.randint(0, 7, (rows,))
    idx[:2] = 4  # repeated rows add up
    placements = [[sc.Shard(0)], [sc.Shard(0) if index_placement == "shard" else sc.Replicate()]]
    run = assert_spmd_matches(put, [values, idx], fake_mesh((ranks,), ("dp",)), placements, atol=1e-12)
    assert not any("all_gather" in r or "index_put" in r for r in _reasons(run)), _reasons(run)
    assert _results(run, aten.index_put.default) == ["P(sum)"]


def test_index_put_of_partial_values():
    """Values that are partial sums (a sum over a split dim) with a replicated index."""
    def fn(x, idx):
        return torch.zeros(5, 3, dtype=x.dtype).index_put((idx,), x.sum(0), accumulate=True)

    run = assert_spmd_matches(fn, [torch.randn(4, 6, 3, dtype=torch.float64), torch.randint(0, 5, (6,))], fake_mesh((2,), ("dp",)),
                              [[sc.Shard(0)], [sc.Replicate()]], atol=1e-12)
    assert _results(run, aten.index_put.default) == ["P(sum)"]


def test_index_put_values_split_along_a_sliced_dim_go_to_dtensor():
    """Values split along a dim the index does not walk: x would have to be split too."""
    def fn(v, idx):
        return torch.zeros(5, 4, dtype=v.dtype).index_put((idx,), v, accumulate=True)

    run = assert_spmd_matches(fn, [torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 5, (6,))], fake_mesh((2,), ("tp",)),
                              [[sc.Shard(1)], [sc.Replicate()]], atol=1e-12)
    assert _results(run, aten.index_put.default) != ["P(sum)"]


def test_index_add_and_scatter_add():
    def fn(src, idx):
        a = torch.ones(5, 3, dtype=src.dtype).index_add(0, idx, src, alpha=0.5)
        b = torch.zeros(5, 3, dtype=src.dtype).scatter_add(0, idx[:, None].expand(-1, 3), src)
        return a, b

    run = assert_spmd_matches(fn, [torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 5, (8,))], fake_mesh((4,), ("dp",)),
                              [[sc.Shard(0)], [sc.Shard(0)]], atol=1e-12)
    assert not any("all_gather" in r for r in _reasons(run)), _reasons(run)
    assert _results(run, aten.index_add.default) == ["P(sum)"] and _results(run, aten.scatter_add.default) == ["P(sum)"]


class LearnedPositions(nn.Module):
    """Whisper's decoder positions: ``weight[position_ids]`` with the ids repeated per row."""

    def __init__(self, vocab: int = 11, seq: int = 6, dim: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        positions = torch.arange(s).unsqueeze(0).repeat(b, 1)
        return self.head(torch.tanh(self.tok(ids) + self.pos[positions]))


def lm_step(model, optimizer, ids, targets):
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_position_gradient_is_a_partial_sum_under_dp(mesh4):
    """The position table's gradient (index_put of the batch-split gradient) is summed in
    the gradient bucket with the others: nothing is gathered."""
    batches = [(torch.randint(0, 11, (8, 6)), torch.randint(0, 11, (8, 6))) for _ in range(2)]
    res = assert_training_matches(lm_step, LearnedPositions().double(), lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh4)
    assert_distributed(res, sharded=["batch[0]"], collectives={"all_gather": 0, "optimizer/all_reduce": 1})
