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


@pytest.mark.parametrize("ranks,pieces", [(2, 2), (4, 2), (2, 4)])  # n divides k, k divides n (run-time split sizes)
def test_split_of_a_fused_weight_is_one_all_to_all(ranks, pieces):
    """A gate|up weight stored as one ``Shard(0)`` tensor, split into its parts: each rank's
    rows go to the ranks that hold them in the parts' ``_StridedShard`` layout (one
    all_to_all of the weight's rows), after which every part is ``Shard(0)``; before, the
    whole weight was gathered."""
    w = torch.randn(8 * pieces, 3, dtype=torch.float64)
    run = assert_spmd_matches(lambda w: [p * (i + 1) for i, p in enumerate(w.chunk(pieces, 0))], [w], fake_mesh((ranks,), ("tp",)),
                              [[Shard(0)]], atol=1e-12, rtol=1e-10)
    assert_distributed(run, collectives={"all_gather": 0, "all_to_all": 1})
    assert all(o.spec.placements == (Shard(0),) for o in run.steps[(0,)].outputs)


class GateUp(torch.nn.Module):
    """A SwiGLU feed-forward whose gate and up projections are one weight, split in forward."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("ranks", [2, 4])
def test_fused_gate_up_trains_without_gathers(ranks):
    """``Shard(0)`` on the fused weight (what ``ColwiseParallel`` gives it): the activation's
    split is an all_to_all, the weight's gradient goes back to ``Shard(0)`` with one, no
    gather anywhere; equal to one device."""
    import spmd_compiler as sc
    from spmd_compiler.testing import assert_training_matches

    def step(model, opt, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    batches = [(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)) for _ in range(2)]
    plan = sc.Plan(params={"gate_up.weight": [Shard(0)], "down.weight": [Shard(1)]}, default_input=[Replicate()])
    res = assert_training_matches(step, GateUp().double(), lambda p: torch.optim.AdamW(p, lr=0.01), batches,
                                  fake_mesh((ranks,), ("tp",)), plan)
    dist = assert_distributed(res, sharded=["gate_up.weight"])
    assert dist.count("all_gather") == 0 and dist.count("all_to_all") >= 2, dist.describe()
