"""Placement changes on a context-parallel axis with the head-tail layout
(spmd_compiler/expand/head_tail.py and its hook in expand/redistribute.py): rank r of n
holds chunks r and 2n-1-r of a split dim; a replicated value split to meet it takes
those chunks, a gathered one comes back in order, a Partial one is reduce-scattered in
that order; equal to one device (fed and assembled in the layout), collectives counted."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing import assert_spmd_matches, fake_mesh

CP = sc.ContextParallel(axis="cp")


def _kinds(run) -> list[str]:
    step = next(iter(run.steps.values()))
    return [n.meta["spmd_comm"]["kind"] for n in step.collectives()]


def _run(fn, args, placements, ranks=4):
    return assert_spmd_matches(fn, args, fake_mesh((ranks,), ("cp",)), placements, atol=1e-12, context_parallel=CP)


def test_replicated_value_takes_the_rank_chunks():
    """Positions (a replicated table) meet the split sequence: no communication."""
    x, table = torch.randn(2, 16, 3, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    run = _run(lambda a, t: a * t, [x, table], [[Shard(1)], [Replicate()]])
    assert _kinds(run) == []


def test_gathered_value_is_in_order():
    """A cumulative sum along the sequence needs it whole: gathered, in order."""
    x = torch.randn(2, 16, 3, dtype=torch.float64)
    run = _run(lambda a: a.cumsum(1), [x], [[Shard(1)]])
    assert _kinds(run) == ["all_gather"]


def test_partial_value_is_reduce_scattered_in_layout():
    x, p = torch.randn(2, 16, 3, dtype=torch.float64), torch.randn(2, 16, 3, dtype=torch.float64)
    run = _run(lambda a, b: a + b, [x, p], [[Shard(1)], [Partial()]])
    assert _kinds(run) == ["reduce_scatter"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_flattened_sequence_is_strided(ranks):
    """``(batch, seq) -> batch * seq`` with the sequence split: each batch row's block in the
    head-tail layout (``_StridedShard``), split from and gathered to replicated values."""
    x, rows = torch.randn(3, 16, 2, dtype=torch.float64), torch.randn(48, 2, dtype=torch.float64)

    def fn(a, r):
        flat = a.flatten(0, 1)
        return flat * r, (flat * r).cumsum(0)

    run = _run(fn, [x, rows], [[Shard(1)], [Replicate()]], ranks)
    assert _kinds(run) == ["all_gather"]


def test_sequence_split_in_pieces_the_layout_cannot_follow():
    """A view cutting the sequence into (4, 4) over 4 ranks: the outer dim's chunks are not
    the sequence's head and tail chunks, so the view runs on the gathered value; exact."""
    x = torch.randn(2, 16, dtype=torch.float64)
    run = _run(lambda a: a.view(2, 4, 4).sum(-1), [x], [[Shard(1)]])
    assert "all_gather" in _kinds(run)
