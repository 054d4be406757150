"""Property tests: no placement changes the answer (forward programs and train steps).

Example counts scale with the hypothesis profile (conftest.py): under CI (profile "ci",
derandomized) these tests run 400 + 400 + 12 + 200 = 1012 generated examples
(``SPMD_HYPOTHESIS_SCALE`` multiplies them).
"""

from __future__ import annotations

import operator
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd_compiler as sc
from spmd_compiler.expand.values import sym_apply
from spmd_compiler.testing import (
    assemble,
    assert_distributed,
    assert_spmd_matches,
    assert_training_matches,
    distribution_of,
    rank_coordinates,
    shard_tensor,
)
from spmd_compiler.testing import strategies as sst
from spmd_compiler.testing.checks import local_shape
from spmd_compiler.testing.models import MLP

SCALE = float(os.environ.get("SPMD_HYPOTHESIS_SCALE", "1.0"))
CACHE = sc.ExpansionCache()  # recipes repeat across examples


def n(count: int) -> int:
    return max(5, int(count * SCALE))


def assert_distributed_as_drawn(program, drawn, mesh_shape) -> None:
    """The program shards exactly what the drawn placements shard (``drawn``: input label
    -> (global shape, placements)); a draw that shards nothing (all Replicate, or only
    dims of size 1) runs the one-device program on every rank, and that is asserted too."""
    want = [label for label, (shape, pl) in drawn.items()
            if any(p.is_shard() and mesh_shape[a] > 1 and shape[p.dim] >= 2 for a, p in enumerate(pl))]
    dist = assert_distributed(program, sharded=want) if want else distribution_of(program)
    assert {label for label in dist.sharded if label in drawn} == set(want), (dist.describe(), want)


# Every failure a hypothesis search ever found, kept as an explicit case: derandomized
# search draws other examples under another hypothesis release, and the verdict on a
# known bug must not depend on which release is installed.
# (mesh shape, input shapes, ops, placements of each input)
REGRESSIONS = [
    # hypothesis 6.170.15: a dim of 2 split 4 ways over a 2x2 mesh (shards 1, 0, 1, 0),
    # then flattened: DTensor's view strategy gave local size 1 for 2 local elements
    ((2, 2), [(1, 2, 2)], [("flatten", ())], [(sc.Shard(1), sc.Shard(1))]),
    ((2, 2), [(2, 2, 2)], [("flatten", ())], [(sc.Shard(1), sc.Shard(1))]),
    ((2, 2), [(1, 2, 2)], [("flatten", ())], [(sc.Shard(2), sc.Shard(2))]),
    # thorough profile, 6.170.15: 7 columns over 5 ranks leave rank 4 an empty shard, and
    # a reduction without identity (amax) raised on it
    ((5,), [(2, 7)], [("flatten", ()), ("amax", (0, False))], [(sc.Shard(1),)]),
    ((5,), [(2, 7)], [("amax", (1, True))], [(sc.Shard(1),)]),
]


@pytest.mark.parametrize("mesh_shape,shapes,ops,placements", REGRESSIONS, ids=[f"{r[2][0][0]}-{i}" for i, r in enumerate(REGRESSIONS)])
def test_found_programs_match_single_device(mesh_shape, shapes, ops, placements):
    mesh = sc.testing.fake_mesh(mesh_shape)
    prog = sst.Program(list(shapes), list(ops))
    run = assert_spmd_matches(prog.fn, prog.inputs(seed=0), mesh, [list(p) for p in placements], atol=1e-9, rtol=1e-7,
                              symbolic="none", cache=sc.ExpansionCache(enabled=False))
    assert_distributed(run, sharded=[f"batch[{i}]" for i in range(len(shapes))])  # every regression shards its input


@settings(max_examples=n(400))
@given(st.data())
def test_programs_match_single_device(data):
    mesh = data.draw(sst.meshes(max_ranks=8))
    prog = data.draw(sst.programs(max_ops=4))
    inputs = prog.inputs(seed=data.draw(st.integers(0, 2**16)))
    pls = [data.draw(sst.placements(x.shape, mesh.shape), label=f"placements of input {i}") for i, x in enumerate(inputs)]
    run = assert_spmd_matches(prog.fn, inputs, mesh, pls, atol=1e-9, rtol=1e-7, symbolic="none", cache=CACHE)
    assert_distributed_as_drawn(run, {f"batch[{i}]": (x.shape, pl) for i, (x, pl) in enumerate(zip(inputs, pls))}, mesh.shape)


@settings(max_examples=n(400))
@given(st.data())
def test_shard_and_assemble_round_trip(data):
    mesh_shape = data.draw(sst.mesh_shapes(max_ranks=8))
    shape = data.draw(sst.shapes(1, 3, 1, 9))
    pl = data.draw(sst.placements(shape, mesh_shape))
    x = torch.randn(shape)
    locals_ = {c: shard_tensor(x, pl, mesh_shape, c) for c in rank_coordinates(mesh_shape)}
    for c, t in locals_.items():  # the local shape assert_distributed expects is the shard the simulator feeds
        assert local_shape(shape, pl, mesh_shape, c) == tuple(t.shape)
    assert torch.equal(assemble(pl, shape, locals_, mesh_shape), x)
    # every element lives on exactly the ranks that do not shard it
    total = sum(t.numel() for t in locals_.values())
    replicas = 1
    for size, p in zip(mesh_shape, pl):
        if not p.is_shard():
            replicas *= size
    assert total == x.numel() * replicas


def mse_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@settings(max_examples=n(12))
@given(st.data())
def test_train_steps_match_single_device(data):
    mesh = data.draw(sst.meshes(max_ranks=4))
    dim, hidden = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 9))
    batch = data.draw(st.integers(1, 9))
    model = MLP(dim, hidden).double()
    params = {}
    for name, p in model.named_parameters():
        params[name] = list(data.draw(sst.placements(p.shape, mesh.shape), label=name))
    batch_pl = data.draw(sst.placements((batch, dim), mesh.shape, nested=False), label="batch")
    plan = sc.Plan(params=params, default_input=list(batch_pl))
    make_opt = data.draw(st.sampled_from([
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adam(p, lr=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    ]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    batches = [(torch.randn(batch, dim, generator=g, dtype=torch.float64), torch.randn(batch, dim, generator=g, dtype=torch.float64)) for _ in range(2)]
    res = assert_training_matches(mse_step, model, make_opt, batches, mesh, plan, atol=1e-8, rtol=1e-6)
    drawn = {name: (p.shape, params[name]) for name, p in model.named_parameters()}
    drawn.update({f"batch[{i}]": ((batch, dim), batch_pl) for i in range(2)})
    assert_distributed_as_drawn(res, drawn, mesh.shape)


@settings(max_examples=n(200))
@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 5))
def test_dsymint_keeps_local_through_multiplication(size, ranks, factor):
    local = -(-size // ranks)
    s = sc.DSymInt(size, local, axes=(0,))
    m = sym_apply(operator.mul, s, factor)
    assert (m.global_value, m.local_value, m.axes) == (size * factor, local * factor, (0,))
    added = sym_apply(operator.add, s, factor)
    assert added.global_value == size + factor and not added.is_sharded


def test_assert_spmd_matches_names_first_wrong_node(mesh4):
    """A deliberately wrong rule (relu passing a Partial sum through) is caught and the
    error points at the relu node."""
    from spmd_compiler.expand import registry
    from spmd_compiler.expand.args import _out_tensor

    op = torch.ops.aten.relu.default
    saved = registry.get_rule(op)

    @registry.register_rule(op)
    def wrong(ctx, b, op, args, kwargs):
        x = args[0]
        return _out_tensor(b, b.call(op, x.node), x.spec, {})

    try:
        with pytest.raises(sc.testing.SpmdMismatch, match=r"first differing node: %relu .*\n  placements P\(sum\)"):
            assert_spmd_matches(lambda a, b: torch.relu(a @ b) + 1, [torch.randn(4, 6), torch.randn(6, 5)], mesh4,
                                [[sc.Shard(1)], [sc.Shard(0)]], cache=sc.ExpansionCache(enabled=False))
    finally:
        registry._RULES.pop(op)
        if saved is not None:
            registry._RULES[op] = saved
