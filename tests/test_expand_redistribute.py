"""Redistribution emitter (spmd_compiler/expand/redistribute.py): which collectives a
placement change costs, checked with all ranks simulated against one device."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd_compiler.testing import assert_distributed, assert_spmd_matches


def _collectives(run):
    step = next(iter(run.steps.values()))
    return [n.meta["spmd_comm"]["kind"] + "@" + n.meta["spmd_comm"]["axis_name"] for n in step.collectives()]


@pytest.mark.parametrize("rows", [8, 6, 5])  # even, uneven on the inner axis, uneven on both
def test_subsplitting_a_kept_shard_is_local(mesh2x2, rows):
    # y is S(0),S(0): x (S(0),R) only needs the tp-chunk of its dp-chunk, a local narrow.
    x = torch.randn(rows, 4, dtype=torch.float64)
    y = torch.randn(rows, 4, dtype=torch.float64)
    run = assert_spmd_matches(
        lambda a, b: a * b, [x, y], mesh2x2, [[Shard(0), Replicate()], [Shard(0), Shard(0)]], atol=1e-12
    )
    assert _collectives(run) == []
    assert_distributed(run, sharded=["batch[0]", "batch[1]"])  # no collective, but every rank holds a shard


def test_changing_the_outer_split_regathers_the_inner_one(mesh2x2):
    # S(1),S(0) -> S(0),S(0): the outer axis changes dim, so the inner chunk is rebuilt
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randn(8, 4, dtype=torch.float64)
    run = assert_spmd_matches(
        lambda a, b: a + b, [x, y], mesh2x2, [[Shard(1), Shard(0)], [Shard(0), Shard(0)]], atol=1e-12
    )
    kinds = _collectives(run)
    assert kinds and all(k.startswith(("all_gather", "all_to_all")) for k in kinds), kinds
    assert_distributed(run, sharded=["batch[0]", "batch[1]"])


def test_partial_to_replicate_is_one_all_reduce(mesh4):
    x = torch.randn(8, 4, dtype=torch.float64)
    run = assert_spmd_matches(lambda a: torch.tanh(a), [x], mesh4, [[Partial()]], atol=1e-12)
    assert _collectives(run) == ["all_reduce@dp"]
    assert_distributed(run, collectives={"all_reduce/dp": 1})


@pytest.mark.parametrize("rows", [8, 6, 5])  # even, uneven on the inner axis, uneven on both
@pytest.mark.parametrize("reduce", ["all", "tp only"])
def test_embedding_rows_split_over_both_axes(mesh2x2, rows, reduce):
    # weight S(0),S(0): the ids are masked on each axis (one mask for both); the first
    # reduction applies it, the second one is a plain sum (it used to lose the mask)
    ids = torch.tensor([[0, rows - 1, 2], [3, 1, rows - 2]])
    weight = torch.randn(rows, 4, dtype=torch.float64)

    def fn(i, w):
        out = torch.nn.functional.embedding(i, w)
        return out * 2 if reduce == "all" else out.sum(-1)

    run = assert_spmd_matches(fn, [ids, weight], mesh2x2, [[Replicate(), Replicate()], [Shard(0), Shard(0)]], atol=1e-12)
    assert_distributed(run, collectives=1)


def test_moving_a_shard_to_another_axis_narrows_by_that_axis(mesh2x2):
    # S(0) on dp -> S(0) on tp (the same chunk size on both axes): gather over dp, then
    # this rank's tp chunk. The narrow starts at coord_tp * 4, so it must not be folded
    # into the gather's input, which is the dp chunk.
    a, b = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    run = assert_spmd_matches(
        lambda a, b: a + b, [a, b], mesh2x2, [[Replicate(), Shard(0)], [Shard(0), Replicate()]], atol=1e-12
    )
    assert _collectives(run) == ["all_gather@dp"]


@pytest.mark.parametrize("vocab", [8, 10])  # 10 rows over 4 ranks: uneven, the last shard shorter
def test_vocab_parallel_embedding_masks_ids_of_other_ranks(mesh4, vocab):
    # every id, each rank's first and last rows included: an id at a shard boundary
    # belongs to exactly one rank
    weight = torch.randn(vocab, 3, dtype=torch.float64)
    ids = torch.arange(vocab).repeat(2).view(4, -1)
    run = assert_spmd_matches(
        lambda i, w: torch.nn.functional.embedding(i, w), [ids, weight], mesh4, [[Replicate()], [Shard(0)]], atol=1e-12
    )
    assert _collectives(run) == ["all_reduce@dp"]  # MaskPartial -> Replicate
