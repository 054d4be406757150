"""FSDP parameter gathers fused per module unit (spmd_compiler/optimize/gathers.py)."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.optimize import bucket_parameter_gathers_pass, default_passes, overlap_pass
from spmd_compiler.optimize.gathers import unit_of
from spmd_compiler.optimize.graph_utils import is_collective, is_wait, positions
from spmd_compiler.optimize.overlap import is_param_gather
from spmd_compiler.testing import assert_distributed, assert_training_matches
from spmd_compiler.testing.models import GPT, gpt_fsdp_plan, train_step


def test_unit_of():
    assert unit_of("blocks.3.attn.q.weight") == "blocks.3"
    assert unit_of("encoder.layers.12.fc.bias") == "encoder.layers.12"
    assert unit_of("tok.weight") == ""
    assert unit_of("head.weight") == ""


def _fsdp_step(mesh, vocab=32, layers=2):
    model = GPT(vocab=vocab, seq=8, dim=16, heads=2, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, vocab, (8, 8))
    train_step(model, opt, ids, ids)
    return sc.expand(sc.trace(train_step, model, opt, ids, ids), mesh, gpt_fsdp_plan())


def _gathers(gm):
    return [n for n in gm.graph.nodes if is_collective(n) and is_param_gather(n)]


def test_one_gather_per_unit(mesh4):
    step = _fsdp_step(mesh4)
    gm = sc.optimize.remove_redundant_collectives_pass(step.gm)
    before = _gathers(gm)
    gm = bucket_parameter_gathers_pass(gm)
    after = _gathers(gm)
    assert len(before) == sum(1 for i in step.traced.inputs if i.kind == "param")  # one per parameter
    units = sorted(n.meta["spmd_param_gather"] for n in after)
    assert units == ["", "blocks.0", "blocks.1"]
    assert sum(n.meta["spmd_comm"]["bytes"] for n in after) == sum(n.meta["spmd_comm"]["bytes"] for n in before)
    block0 = next(n for n in after if n.meta["spmd_param_gather"] == "blocks.0")
    assert "gather the 16 parameters of unit blocks.0" in block0.meta["spmd_comm"]["reason"]
    assert len(block0.meta["spmd_comm"]["bucket"]) == 16  # provenance of every member kept
    with pytest.raises(ValueError, match="by must be"):
        bucket_parameter_gathers_pass(gm, by="layer")


def test_units_are_prefetched_in_order_of_need(mesh4):
    step = _fsdp_step(mesh4, layers=3)
    gm = sc.optimize.remove_redundant_collectives_pass(step.gm)
    gm = overlap_pass(bucket_parameter_gathers_pass(gm), prefetch=1)
    pos = positions(gm)
    gathers = sorted(_gathers(gm), key=lambda n: pos[n])
    assert [n.meta["spmd_param_gather"] for n in gathers] == ["", "blocks.0", "blocks.1", "blocks.2"]

    def first_compute_use(g):
        w = next(u for u in g.users if is_wait(u))
        todo, uses = [w], []
        while todo:
            for u in todo.pop().users:
                (todo if u.meta.get("spmd_copy_out") else uses).append(u)
        return min(pos[u] for u in uses)

    for earlier, later in zip(gathers, gathers[1:]):
        # with prefetch=1 a unit is gathered only once the previous one is in use
        assert pos[later] > first_compute_use(earlier) - 2
        assert pos[later] < first_compute_use(later)


@pytest.mark.parametrize("vocab", [32, 30])  # 30 rows split unevenly over 4 ranks: padded shards
def test_fused_gathers_keep_training_numerics(mesh4, vocab):
    model = GPT(vocab=vocab, seq=8, dim=16, heads=2, layers=2).double()
    batches = [(torch.randint(0, vocab, (8, 8)), torch.randint(0, vocab, (8, 8))) for _ in range(3)]
    res = assert_training_matches(
        train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh4, gpt_fsdp_plan(),
        passes=default_passes(),
    )
    assert_distributed(res, sharded=["tok.weight", "blocks.0.fc.weight", "batch[0]"])
    gm = next(iter(res.sim.expansions.values())).gm
    assert sorted(n.meta["spmd_param_gather"] for n in _gathers(gm)) == ["", "blocks.0", "blocks.1"]


def test_gathers_of_views_made_late_are_left_alone(mesh2x2):
    # no fsdp_axes: DTensor gathers what each op needs, e.g. t(weight) in backward, made
    # long after the unit's first gather is needed; fusing it there read it before it
    # existed (the pass failed its lint: "used before it has been defined")
    from torch.distributed.tensor import Shard

    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 32, (4, 8))
    step = sc.expand(sc.trace(train_step, model, opt, ids, ids), mesh2x2, sc.Plan(params={"*": [Shard(0), Shard(0)]}))
    gm = bucket_parameter_gathers_pass(sc.optimize.remove_redundant_collectives_pass(step.gm))
    gm.graph.lint()
    pos = positions(gm)
    for fused in _gathers(gm):
        for member in fused.meta.get("spmd_copy_in", []):
            assert all(pos[a] < pos[fused] for a in member.all_input_nodes)
