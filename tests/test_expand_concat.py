"""cat / split of fused projections on shards (spmd_compiler/expand/rules/concat.py):
results vs one device, and no collective where none is needed."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from spmd_compiler.testing import assert_distributed, assert_spmd_matches, fake_mesh


def fused_qkv(x, w):
    """GPT-2's attention input: one (in, 3 * out) projection split into q, k, v."""
    q, k, v = (x @ w).split(w.shape[1] // 3, dim=1)
    return torch.cat([q * 2, k.tanh(), v - 1], dim=1)


@pytest.mark.parametrize("ranks,rows", [(2, 8), (4, 12), (4, 6)])  # 6 columns per block over 4: uneven
def test_strided_split_and_cat_stay_local(ranks, rows):
    mesh = fake_mesh((ranks,), ("tp",))
    x = torch.randn(5, 4, dtype=torch.float64)
    w = torch.randn(4, 3 * rows, dtype=torch.float64)
    run = assert_spmd_matches(fused_qkv, [x, w], mesh, [[Replicate()], [_StridedShard(1, split_factor=3)]], atol=1e-12, rtol=1e-10)
    assert_distributed(run, collectives={"all_gather": 0, "all_reduce": 0, "all_to_all": 0})
    step = run.steps[next(iter(run.steps))]
    cats = [n for n in step.gm.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert cats and cats[-1].meta["val"].shape[1] < 3 * rows  # concatenated locally


def test_cat_of_unequal_shards_falls_back_to_dtensor():
    mesh = fake_mesh((2,), ("tp",))
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    assert_spmd_matches(lambda a, b: torch.cat([a, b], 1) * 2, [a, b], mesh, [[Shard(1)], [Shard(1)]], atol=1e-12, rtol=1e-10)


def test_cat_skips_legacy_empty_inputs():
    """An empty 1-D tensor in cat (an empty KV cache) is skipped, as torch.cat does."""
    mesh = fake_mesh((2,), ("dp",))
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    run = assert_spmd_matches(lambda x: torch.cat([torch.tensor([], dtype=x.dtype), x], -2).sin(), [x], mesh, [[Shard(0)]], atol=1e-12, rtol=1e-10)
    assert_distributed(run, collectives={"all_gather": 0})


SPLITS = {
    "chunk": lambda x: x.chunk(3, dim=-1),
    "split": lambda x: x.split(2, dim=-1),
    "split_with_sizes": lambda x: x.split([1, 3, 2], dim=-1),
}


@pytest.mark.parametrize("how", list(SPLITS))
@pytest.mark.parametrize("ranks,batch", [(2, 4), (3, 5)])  # 5 over 3: uneven batch
def test_split_along_an_unsharded_dim_stays_local(how, ranks, batch):
    x = torch.randn(batch, 3, 6, dtype=torch.float64)
    run = assert_spmd_matches(lambda x: [p * (i + 1) for i, p in enumerate(SPLITS[how](x))], [x], fake_mesh((ranks,), ("dp",)),
                              [[Shard(0)]], atol=1e-12, rtol=1e-10)
    assert_distributed(run, sharded=["batch[0]"], collectives={"all_gather": 0, "all_reduce": 0, "all_to_all": 0})
    step = run.steps[next(iter(run.steps))]
    assert all(o.spec.placements == (Shard(0),) for o in step.outputs)


def test_split_along_the_sharded_dim_is_right():
    """A plain Shard(0) batch chunked along the batch: each piece lives on some ranks
    only, so it is gathered; the pieces equal one device's."""
    x = torch.randn(6, 4, dtype=torch.float64)
    assert_spmd_matches(lambda x: [p.exp() * (i + 1) for i, p in enumerate(x.chunk(3, 0))], [x], fake_mesh((2,), ("dp",)),
                        [[Shard(0)]], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("pieces,want", [(2, _StridedShard(0, split_factor=2)), (4, Shard(0))])
def test_split_of_a_merged_batch_stays_local(pieces, want):
    """(seq, batch, dim) split by batch, merged to (seq * batch, dim) (_StridedShard(0,
    seq)) and chunked along the merged dim into pieces of whole sequence positions:
    each piece keeps its share locally."""
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    run = assert_spmd_matches(lambda x: [p * (i + 1) for i, p in enumerate(x.reshape(24, 3).chunk(pieces, 0))], [x],
                              fake_mesh((2,), ("dp",)), [[Shard(1)]], atol=1e-12, rtol=1e-10)
    assert_distributed(run, collectives={"all_gather": 0, "all_to_all": 0})
    assert all(o.spec.placements == (want,) for o in run.steps[(0,)].outputs)
