"""The lockstep simulator is no kinder than gloo: wrong groups, early reads of a
collective's result and writes into an in-flight input all change the numbers."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, fake_mesh, group_axes_of, rank_coordinates, run_lockstep, shard_tensor
from spmd_compiler.testing.spmd import run_spmd

c10d = torch.ops._c10d_functional


def _program(a, b):
    return torch.cumsum(a @ b, 0)  # tp all_reduce of the partial matmul, then a dp all_gather for cumsum


def _run(mutate=None):
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    pls = [[sc.Shard(0), sc.Shard(1)], [sc.Replicate(), sc.Shard(0)]]
    run = run_spmd(_program, [a, b], mesh, pls, symbolic="none", cache=sc.ExpansionCache(enabled=False))
    step = next(iter(run.steps.values()))
    kinds = [n.target for n in step.gm.graph.nodes if n.op == "call_function" and n.target.namespace == "_c10d_functional"
             and n.target is not c10d.wait_tensor.default]
    assert c10d.all_reduce.default in kinds and c10d.all_gather_into_tensor.default in kinds, kinds
    gm = copy.deepcopy(step.gm)
    if mutate is not None:
        mutate(gm, step)
        gm.graph.lint()
        gm.recompile()
    coords = rank_coordinates((2, 2))
    inputs = {c: [shard_tensor(t, s.placements, (2, 2), c) for t, s in zip([a, b], step.input_specs)] for c in coords}
    outs = run_lockstep({c: gm for c in coords}, inputs, (2, 2), group_axes=group_axes_of(step))
    return outs, run


def _collectives(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def test_unmutated_program_matches():
    outs, run = _run()
    got = run.outputs[0]
    assert_distributed(run, sharded=["batch[0]", "batch[1]"], collectives={"all_reduce/tp": 1, "all_gather/dp": 1})
    assert torch.allclose(got, run.reference[0], atol=1e-12)


def test_collective_runs_on_the_group_its_argument_names():
    """Every collective on the group of mesh axis 0 (a seeded bug): the simulator reads
    the group argument, not the node's metadata, so the numbers change."""
    def wrong_group(gm, step):
        dp = step.mctx.group_names[0]
        for n in _collectives(gm, c10d.all_reduce.default):
            n.args = (*n.args[:-1], dp)

    clean, _ = _run()
    bad, _ = _run(wrong_group)
    assert any(not torch.allclose(clean[c][0], bad[c][0]) for c in clean)


def test_result_is_poison_until_its_wait():
    """A wait moved after its first use (the consumer, cumsum, reads the collective's
    output buffer directly) sees poison, as it would see an unfinished buffer on gloo."""
    def read_early(gm, step):
        for n in _collectives(gm, c10d.all_gather_into_tensor.default):
            wait = next(iter(n.users))
            first = min(wait.users, key=lambda u: list(gm.graph.nodes).index(u))
            first.replace_input_with(wait, n)  # the consumer now reads the in-flight buffer
            first.append(wait)  # and the wait runs after it

    bad, _ = _run(read_early)
    assert all(torch.isnan(bad[c][0]).any() for c in bad)


def test_input_is_read_until_the_wait():
    """A write into an all_gather's input while it is in flight changes what the other
    ranks receive."""
    def write_in_flight(gm, step):
        for n in _collectives(gm, c10d.all_gather_into_tensor.default):
            with gm.graph.inserting_after(n):
                gm.graph.call_function(torch.ops.aten.mul_.Tensor, (n.args[0], 2.0))

    clean, _ = _run()
    bad, _ = _run(write_in_flight)
    assert any(not torch.allclose(clean[c][0], bad[c][0]) for c in clean)


def test_missing_group_mapping_is_a_clear_error():
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    run = run_spmd(_program, [a, b], mesh, [[sc.Shard(0), sc.Shard(1)], [sc.Replicate(), sc.Shard(0)]], symbolic="none")
    step = next(iter(run.steps.values()))
    coords = rank_coordinates((2, 2))
    inputs = {c: [shard_tensor(t, s.placements, (2, 2), c) for t, s in zip([a, b], step.input_specs)] for c in coords}
    with pytest.raises(ValueError, match="group_axes"):
        run_lockstep({c: step.gm for c in coords}, inputs, (2, 2))


def test_reduce_scatter_sums_each_rank_chunk_in_ring_order():
    """Rank j's chunk is summed from rank j + 1 round to j, as NCCL's ring does, so the
    ranks' chunks round differently: with a, b, c = 1, 1e16, -1e16 on ranks 0, 1, 2,
    rank 0 gets (b + c) + a = 1, rank 1 (c + a) + b = 0, rank 2 (a + b) + c = 0. A value
    taken from each rank's own chunk and meant to be the same on every rank (a loss riding
    in an FSDP bucket) differs between ranks here as it would on NCCL."""
    import torch.fx as fx

    g = fx.Graph()
    g.placeholder("coord_g")
    x = g.placeholder("x")
    w = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 3, "g")),))
    g.output([w])
    gm = fx.GraphModule(torch.nn.Module(), g)
    values = {(0,): 1.0, (1,): 1e16, (2,): -1e16}
    inputs = {c: [torch.full((3,), v, dtype=torch.float64)] for c, v in values.items()}
    outs = run_lockstep({c: gm for c in values}, inputs, (3,), group_axes={"g": 0})
    assert [outs[c][0].item() for c in sorted(outs)] == [1.0, 0.0, 0.0]
