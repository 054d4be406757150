"""Indexing a sharded tensor by its own row numbers (expand/rules/indexing.py) and the
position tensors that make it exact (expand/positions.py): sharded against one device,
uneven splits included, with the collectives counted."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.testing import assert_spmd_matches, fake_mesh

aten = torch.ops.aten


def packed_causal_mask(ids):
    """What transformers' create_causal_mask does without a cache: a batch-shaped tensor
    evaluated at ``[arange(batch)[:, None, None, None], arange(seq)[None, None, :, None]]``."""
    b, s = ids.shape
    seq = ids.cumsum(-1)
    rows = torch.arange(b)[:, None, None, None]
    q = (torch.arange(s) + 0)[None, None, :, None]
    kv = torch.arange(s)[None, None, None, :]
    return ((seq[rows, q] >= seq[rows, kv]) & (kv <= q)).long(), seq[rows, q]


def shifted_rows(ids):
    """Rows ``(i + 1) % b``: not this rank's rows, so the rule must not apply."""
    b = ids.shape[0]
    return (ids * 3)[(torch.arange(b) + 1) % b, 1:]


def _collectives(run):
    return [n.meta["spmd_comm"]["reason"] for step in run.steps.values() for n in step.collectives()]


@pytest.mark.parametrize("ranks", [2, 3])
def test_rows_indexed_locally(ranks):
    """Batch 4 over 2 ranks (2, 2) and over 3 (2, 2, 0): each rank indexes its own rows at
    local numbers, equal to one device, no collective."""
    ids = torch.randint(0, 3, (4, 6))
    run = assert_spmd_matches(packed_causal_mask, [ids], fake_mesh((ranks,), ("dp",)), [[sc.Shard(0)]], atol=0, rtol=0)
    assert _collectives(run) == []
    step = run.steps[(ranks - 1,)]
    index = [n for n in step.gm.graph.nodes if n.target is aten.index.Tensor]
    assert index and all(n.meta["val"].shape[0] == (2 if ranks == 2 else 0) for n in index)  # the last rank's rows only


def test_other_rows_are_gathered():
    """An index that is not the rank's own rows (``(arange + 1) % b``) goes to DTensor,
    which gathers the indexed tensor: still exact."""
    ids = torch.randint(0, 5, (4, 6))
    run = assert_spmd_matches(shifted_rows, [ids], fake_mesh((2,), ("dp",)), [[sc.Shard(0)]], atol=0, rtol=0)
    assert any("index.Tensor" in r for r in _collectives(run)), _collectives(run)


def rows_then_written(ids):
    """The row numbers written in place after they were made: not positions any more."""
    b = ids.shape[0]
    rows = torch.arange(b)
    view = rows[:, None]
    rows.add_(1).remainder_(b)  # the view sees (i + 1) % b
    return (ids * 3)[view, 1:]


def test_written_row_numbers_are_not_positions():
    ids = torch.randint(0, 5, (4, 6))
    run = assert_spmd_matches(rows_then_written, [ids], fake_mesh((2,), ("dp",)), [[sc.Shard(0)]], atol=0, rtol=0)
    assert any("index.Tensor" in r for r in _collectives(run)), _collectives(run)


def last_token_logits(logits, ids):
    """Sequence-classification pooling: each row's logits at its count of non-zero tokens - 1, a
    per-row index split like the rows."""
    last = (ids != 0).long().sum(-1).clamp(min=1) - 1
    return logits[torch.arange(logits.shape[0]), last]


@pytest.mark.parametrize("ranks", [2, 3])
def test_per_row_index_split_like_the_rows(ranks):
    logits, ids = torch.randn(4, 6, 3, dtype=torch.float64), torch.randint(0, 3, (4, 6))
    mesh = fake_mesh((ranks,), ("dp",))
    run = assert_spmd_matches(last_token_logits, [logits, ids], mesh, [[sc.Shard(0)], [sc.Shard(0)]], atol=0, rtol=0)
    assert _collectives(run) == []


class ReversedTokens(torch.nn.Module):
    """Each row's tokens in reverse order, ``h[arange(b)[:, None], arange(t).flip(0)]``: the
    gradient goes back through ``index_put`` by the same rows."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x):
        rows = torch.arange(x.shape[0])[:, None]
        return (x * self.w)[rows, torch.arange(x.shape[1]).flip(0)]


def _sum_step(model, optimizer, x, y):
    loss = ((model(x) - y) ** 2).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("ranks", [2, 3])
def test_gradient_through_rows_stays_local(ranks):
    from spmd_compiler.testing import assert_distributed, assert_training_matches

    batches = [(torch.randn(4, 5, 4, dtype=torch.float64), torch.randn(4, 5, 4, dtype=torch.float64)) for _ in range(2)]
    res = assert_training_matches(_sum_step, ReversedTokens(), lambda p: torch.optim.SGD(p, lr=0.1), batches, fake_mesh((ranks,), ("dp",)), sc.Plan())
    # the gradient of w is all-reduced, the loss riding along; nothing else moves
    assert_distributed(res, sharded=["batch[0]"], collectives={"all_gather": 0, "all_reduce": 1})
    assert aten.index_put.default in {n.target for n in res.sim.expansions[(0,)].gm.graph.nodes}
