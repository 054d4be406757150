"""Compile-only expansion on a fake process group of world size 64 (no data)."""

from __future__ import annotations

from collections import Counter

import torch

import spmd_compiler as sc
from spmd_compiler.testing import fake_mesh
from spmd_compiler.testing.models import GPT, gpt_2d_plan, gpt_fsdp_plan, train_step


_TRACED: dict = {}


def _traced(layers=2):
    """Traced once per module: three tests expand the same step (expansion does not
    modify the traced step; test_fsdp_world_64_uneven_parameters expands it twice)."""
    if layers not in _TRACED:
        model = GPT(vocab=128, seq=16, dim=64, heads=8, layers=layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 128, (64, 16))
        _TRACED[layers] = model, sc.trace(train_step, model, opt, ids, ids)
    return _TRACED[layers]


def _kinds(step):
    return Counter((n.meta["spmd_phase"], n.meta["spmd_comm"]["kind"], n.meta["spmd_comm"]["axis_name"]) for n in step.collectives())


def test_data_parallel_world_64():
    mesh = fake_mesh((64,), ("dp",))
    model, traced = _traced()
    step = sc.expand(traced, mesh)
    kinds = _kinds(step)
    n_params = len(list(model.parameters()))
    grads = sum(c for (phase, kind, _), c in kinds.items() if kind == "all_reduce" and phase != "output")
    assert grads >= n_params  # every gradient is reduced (duplicates removed by optimize passes)
    assert all(kind == "all_reduce" for (_, kind, _) in kinds)
    assert step.rank_independent
    batch = [n for n in step.gm.graph.nodes if n.op == "placeholder" and n.name == "in_batch_0"][0]
    assert tuple(batch.meta["val"].shape) == (1, 16)


def test_fsdp_world_64_uneven_parameters():
    mesh = fake_mesh((64,), ("dp",))
    _, traced = _traced()
    step = sc.expand(traced, mesh, gpt_fsdp_plan())
    kinds = _kinds(step)
    assert kinds[("forward", "all_gather", "dp")] > 0
    # the position embedding (16 rows over 64 ranks) is sharded unevenly: its graph
    # depends on the rank, and expanding another rank gives the same nodes, other sizes
    assert not step.rank_independent
    last = sc.expand(traced, mesh, gpt_fsdp_plan(), coordinate=(63,))
    assert [n.target for n in step.gm.graph.nodes] == [n.target for n in last.gm.graph.nodes]
    pos = {n.name: n for n in last.gm.graph.nodes if n.op == "placeholder"}["p_pos_weight"]
    assert pos.meta["val"].shape[0] == 0


def test_2d_world_64_structure():
    mesh = fake_mesh((8, 8), ("dp", "tp"))
    _, traced = _traced()
    step = sc.expand(traced, mesh, gpt_2d_plan())
    kinds = _kinds(step)
    # TP: activations communicated over tp in forward; DP: gradients reduced over dp
    assert any(phase == "forward" and axis == "tp" for (phase, _, axis) in kinds)
    # over dp in forward only the mean loss's target count (4 bytes; backward then reads it replicated)
    forward_dp = [n.meta["spmd_comm"] for n in step.collectives() if n.meta["spmd_phase"] == "forward" and n.meta["spmd_comm"]["axis_name"] == "dp"]
    assert [(c["kind"], c["bytes"]) for c in forward_dp] == [("all_reduce", 4)] and "target count" in forward_dp[0]["reason"]
    assert not any(phase == "backward" and axis == "dp" for (phase, _, axis) in kinds)
    assert any(axis == "dp" and kind == "all_reduce" and phase != "output" for (phase, kind, axis) in kinds)
    assert step.rank_independent
    qw = {n.name: n for n in step.gm.graph.nodes if n.op == "placeholder"}["p_blocks_0_attn_q_weight"]
    assert tuple(qw.meta["val"].shape) == (8, 64)
