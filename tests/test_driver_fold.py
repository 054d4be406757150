"""The per-step check folded into the program's first all_reduce (spmd_compiler/driver/fold.py):
where it applies, that the guarded variant makes the same collectives and computes the
same values (compile-only and fake-group runs; the real gloo runs are in
tests/test_runtime_consistency.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.fx as fx

import spmd_compiler as sc
from spmd_compiler.testing.simulate import example_inputs
from spmd_compiler.driver.fold import FoldChain, FoldPoint, find_fold, fold_guard_pass, resync_if_flagged
from spmd_compiler.driver.guard import Resync, _is_effect
from spmd_compiler.runtime.executor import compile_runner
from spmd_compiler.testing.models import GPT, MLP, gpt_fsdp_plan, megatron_mlp_plan, mse_train_step, train_step

c10d = torch.ops._c10d_functional


_STEADY: dict[tuple, fx.GraphModule] = {}


def _steady(mesh, kind: str, plan_name: str | None = None) -> fx.GraphModule:
    """``_program`` compiled once per (mesh shape, kind, plan) for the whole module: several
    tests read the same steady program (neither ``find_fold``, ``fold_guard_pass`` nor
    ``compile_runner`` modifies it; test_folded_variant_makes_the_same_collectives asserts
    it keeps its nodes)."""
    key = (tuple(mesh.shape), kind, plan_name)
    if key not in _STEADY:
        _STEADY[key] = _program(mesh, kind, plan=gpt_fsdp_plan() if plan_name == "fsdp" else None)
    return _STEADY[key]


def _program(mesh, kind: str = "gpt", plan=None, model=None) -> fx.GraphModule:
    """The per-rank graph of the steady step (optimizer state present)."""
    if kind == "gpt":
        model = model or GPT(vocab=32, seq=8, dim=16, heads=2, layers=1)  # one block: the fold reads the first collectives
        fn, x = train_step, torch.randint(0, 32, (8, 8))
        y = x
    else:
        model = model or MLP().double()
        fn, x, y = mse_train_step, torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = sc.compile(fn, mesh=mesh, plan=plan)
    n = mesh.size(0)
    for _ in range(2):
        step(model, opt, x[: 8 // n], y[: 8 // n])
    return step.last.gm


def _on_fake_group(folded: fx.GraphModule) -> fx.GraphModule:
    """``folded`` for a run on the fake group, whose all_reduce returns its input (as over
    one rank) and whose gather repeats it: a sum's checks expect one rank's (id, id**2)."""
    for n in folded.graph.nodes:
        if n.target is resync_if_flagged and len(n.args[2]) == 1 and n.args[2][0] == [n.args[2][0][0]] * 2:
            n.args = (n.args[0], n.args[1], [[1, 1]], *n.args[3:])
    folded.recompile()
    return folded


def _collectives(gm: fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional")


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_folded_variant_makes_the_same_collectives(mesh4, kind):
    gm = _steady(mesh4, kind)
    point = find_fold(gm, world_size=4)
    assert point is not None and point.op == "sum"
    # MSE's loss rides in the gradient bucket, the program's only collective; the mean cross
    # entropy's [loss sum, target count] pair rides in the first gradient bucket
    # (optimize/mean_reductions.py, optimize/deferred_divisor.py)
    coll = next(n for n in gm.graph.nodes if n.name == point.collective)
    assert coll.meta["spmd_comm"]["op"] == "bucket" and any(m.get("rider") for m in coll.meta["spmd_comm"]["bucket"])
    folded = fold_guard_pass(gm, point=point)
    assert _collectives(folded) == _collectives(gm) and sum(_collectives(gm).values()) > 0
    nodes = list(folded.graph.nodes)
    checks = [n for n in nodes if n.target is resync_if_flagged]
    assert len(checks) == 1
    (coll,) = [n for n in nodes if n.target is c10d.all_reduce.default and n.args[0].target is torch.ops.aten.cat.default
               and n.args[0].args[0][-1].target is torch.ops.aten.full.default]
    assert coll.args[0].meta["val"].shape == (point.numel + 2,)  # the program id and its square, nothing else
    assert "carries the per-step check" in coll.meta["spmd_comm"]["history"][-1]
    # nothing irreversible runs between the folded collective and its check
    between = nodes[nodes.index(coll) + 1: nodes.index(checks[0])]
    assert [n for n in between if _is_effect(n)] == [checks[0].args[0]]  # only its own wait
    assert checks[0].args[2] == [[4, 4]]  # 4 ranks sent id 1 (and 1 squared)
    assert len(list(gm.graph.nodes)) + 7 == len(nodes)  # 9 nodes in, 2 out; the program itself is left as it was


def test_mlp_wait_moves_up_before_the_gradient_all_reduce(mesh4):
    """The MLP's gradient bucket (the loss riding in it) is waited where the optimizer
    reads it; the check cannot wait after the next effect."""
    gm = _steady(mesh4, "mlp")
    point = find_fold(gm, world_size=4)
    order = [n.name for n in gm.graph.nodes]
    effects = [n for n in gm.graph.nodes if _is_effect(n) and n.name not in (point.collective, point.wait)]
    assert order.index(point.wait) > order.index(effects[0].name)  # scheduled after the next effect
    nodes = list(fold_guard_pass(gm, point=point).graph.nodes)
    check = next(i for i, n in enumerate(nodes) if n.target is resync_if_flagged)
    first_other = next(i for i, n in enumerate(nodes) if n.name == effects[0].name)
    assert check < first_other


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_folded_variant_computes_what_the_program_computes(mesh4, kind):
    gm = _steady(mesh4, kind)
    folded = _on_fake_group(fold_guard_pass(gm, point=find_fold(gm, world_size=4)))
    a, b = example_inputs(gm), example_inputs(gm)
    with torch.no_grad():
        want, got = compile_runner(gm)(*a), compile_runner(folded)(*b)
    assert len(want) == len(got) > 0
    for x, y in zip(want, got):
        assert torch.equal(x, y)
    for x, y in zip(a, b):  # the in-place updates of parameters and optimizer state too
        assert (x == y) if not isinstance(x, torch.Tensor) else torch.equal(x, y)


def test_gather_carries_the_check(mesh4):
    """FSDP's first collective is a parameter all_gather: each rank's part carries a flag."""
    gm = _steady(mesh4, "gpt", "fsdp")
    point = find_fold(gm, world_size=4)
    assert point is not None and point.kind == "all_gather" and point.out_shape[0] == 4 * point.shape[0]
    folded = fold_guard_pass(gm, point=point)
    assert _collectives(folded) == _collectives(gm)
    (coll,) = [n for n in folded.graph.nodes if n.target is c10d.all_gather_into_tensor.default and n.args[0].target is torch.ops.aten.cat.default
               and n.args[0].args[0][-1].target is torch.ops.aten.full.default]
    (check,) = [n for n in folded.graph.nodes if n.target is resync_if_flagged]
    assert check.args[1] == point.numel + 1 and coll.args[0].meta["val"].shape == (point.numel + 1,)
    a, b = example_inputs(gm), example_inputs(gm)
    with torch.no_grad():
        want, got = compile_runner(gm)(*a), compile_runner(folded)(*b)
    for x, y in zip([*want, *a], [*got, *b]):
        assert (x == y) if not isinstance(x, torch.Tensor) else torch.equal(x, y)


def test_gather_check_reads_every_rank_s_id():
    rows = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 3.0], [5.0, 6.0, 0.0]]).flatten()  # rank 2 runs no program
    resync_if_flagged(rows[:6], 3, [[3], [3]])
    with pytest.raises(Resync):
        resync_if_flagged(rows, 3, [[3], [3], [3]])
    with pytest.raises(Resync):  # every rank runs a program, but rank 1 another one
        resync_if_flagged(torch.tensor([1.0, 2.0, 3.0, 3.0, 4.0, 2.0]), 3, [[3], [3]])


def test_no_fold_when_the_first_collective_spans_one_axis(mesh2x2):
    gm = _program(mesh2x2, "mlp", plan=megatron_mlp_plan(ndim=2, axis=1))
    assert find_fold(gm, world_size=4) is None  # a flag must reach all 4 ranks
    assert find_fold(gm, world_size=2) is not None  # the same collective over a world of 2 would do


def test_a_program_that_draws_keeps_the_standalone_check(mesh4):
    """Its exchange carries the generators' fingerprint (driver/rng.py)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 16)).double()
    assert find_fold(_program(mesh4, "mlp", model=model), world_size=4) is None
    assert find_fold(_steady(mesh4, "mlp"), world_size=4) is not None


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("ids", [(2, 2, 2), (2, 2, 0), (1, 3, 2), (2, 3, 1), (3, 3, 3)])
def test_check_passes_only_when_every_rank_sent_its_id(op, ids):
    """All ranks' (payload, encoded id) reduced as the collective would: the check passes
    exactly when every rank sent the id of the program reading it, whatever ids disagree
    (a sum of ids alone would take (1, 3) for (2, 2))."""
    point = FoldPoint("c", "w", "all_reduce", op, "0", len(ids), (), (), torch.float32, 4)
    rows = torch.tensor([[5.0, *point.encode(i)] for i in ids])
    packed = {"sum": rows.sum(0), "avg": rows.mean(0), "max": rows.max(0).values}[op]
    for mine in range(1, 5):
        if all(i == mine for i in ids):
            resync_if_flagged(packed, 3, point.expected(mine))
        else:
            with pytest.raises(Resync):
                resync_if_flagged(packed, 3, point.expected(mine))


def test_fold_needs_ids_exact_in_its_dtype(mesh4):
    """A bfloat16 sum over 4 ranks holds integers to 256 exactly, half that with an avg's
    rounding margin: ids up to 5 (4 * 25) fit, 6 (4 * 36) do not."""
    from spmd_compiler.driver.fold import _exact
    assert _exact(torch.bfloat16, "sum", 4, 5) and not _exact(torch.bfloat16, "sum", 4, 6)
    assert _exact(torch.float32, "sum", 4, 8) and _exact(torch.int64, "max", 1024, 8) and not _exact(torch.uint8, "sum", 8, 8)
    assert find_fold(_steady(mesh4, "mlp"), world_size=4, ids=10 ** 8) is None  # float64: 4e16 ids squared pass 2**52
    assert find_fold(_steady(mesh4, "mlp"), world_size=4, ids=10 ** 7) is not None


def test_fold_point_validates_its_op():
    with pytest.raises(ValueError, match="expected an all_reduce with op one of"):
        FoldPoint("c", "w", "all_reduce", "min", "0", 2, (), (), torch.float32)
    with pytest.raises(ValueError, match="or an all_gather with op ''"):
        FoldPoint("c", "w", "all_gather", "sum", "0", 2, (1,), (2,), torch.float32)


# ---------------------------------------------------------------- 2-D meshes: one fold per axis


def _axes(gm: fx.GraphModule, mesh) -> tuple:
    """(group name, size) per mesh axis, as the runtime passes them (runtime/compiled.py)."""
    names = {n.meta["spmd_comm"]["axis"]: n.args[-1] for n in gm.graph.nodes if "spmd_comm" in n.meta and "axis" in n.meta["spmd_comm"]}
    return tuple((names[a], mesh.size(a)) for a in range(mesh.ndim))


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_2d_check_rides_on_the_first_collective_of_each_axis(mesh2x2, kind):
    """No collective spans the 4 ranks; the first one of each axis group carries a flag
    (tp's forward all_reduce, then dp's first gradient bucket, which carries the GPT's
    [loss sum, count] pair: optimize/deferred_divisor.py),
    so the step makes exactly the program's collectives."""
    plan = None if kind == "gpt" else megatron_mlp_plan(ndim=2, axis=1)
    if kind == "gpt":
        from spmd_compiler.testing.models import gpt_2d_plan
        plan = gpt_2d_plan()
    gm = _program(mesh2x2, kind, plan=plan)
    axes = _axes(gm, mesh2x2)
    assert find_fold(gm, world_size=4) is None  # no axes given: the standalone check, as before
    chain = find_fold(gm, world_size=4, axes=axes)
    assert isinstance(chain, FoldChain) and [p.group for p in chain.points] == [axes[1][0], axes[0][0]]  # tp first, then dp
    assert all(p.kind == "all_reduce" and p.op == "sum" and p.world_size == 2 for p in chain.points)
    folded = fold_guard_pass(gm, point=chain)
    assert _collectives(folded) == _collectives(gm)
    nodes = list(folded.graph.nodes)
    checks = [n for n in nodes if n.target is resync_if_flagged]
    assert len(checks) == 2
    # the first check sends id 0 in the second fold when it reads a mismatch (its fields, literals)
    assert checks[0].args[3] == (dataclasses.astuple(chain.points[1]),) and len(checks[1].args) in (3, 5)
    if len(checks[1].args) == 5:
        assert checks[1].args[3] == ()
    # between the first folded collective and the last check: only collectives of a folded axis and their waits
    first = next(n for n in nodes if getattr(n.target, "namespace", None) == "_c10d_functional")
    between = nodes[nodes.index(first): nodes.index(checks[-1])]
    assert all(n.args[-1] in {p.group for p in chain.points} for n in between
               if _is_effect(n) and n.target is not c10d.wait_tensor.default), [n.name for n in between if _is_effect(n)]
    a, b = example_inputs(gm), example_inputs(gm)
    with torch.no_grad():
        want, got = compile_runner(gm)(*a), compile_runner(_on_fake_group(folded))(*b)
    assert len(want) == len(got) > 0
    for x, y in zip([*want, *a], [*got, *b]):
        assert (x == y) if not isinstance(x, torch.Tensor) else torch.equal(x, y)


def test_2d_chain_needs_a_collective_on_every_axis(mesh2x2):
    """A 2-D program whose collectives all run on one axis: no fold reaches the other
    axis's groups, so the standalone check stays."""
    gm = _program(mesh2x2, "mlp", plan=megatron_mlp_plan(ndim=2, axis=1))
    axes = _axes(gm, mesh2x2)
    # drop the dp axis's collectives from view: pretend they run on a third group
    assert find_fold(gm, world_size=4, axes=axes) is not None
    assert find_fold(gm, world_size=4, axes=(axes[1], ("no_such_group", 2))) is None
    assert find_fold(gm, world_size=8, axes=axes) is None  # the axes do not cover the world


def test_2d_chain_stops_at_a_write_before_the_last_fold(mesh2x2):
    """A write between the first and the last folded collective could not be undone by a
    Resync at the last: the standalone check stays."""
    gm = _program(mesh2x2, "mlp", plan=megatron_mlp_plan(ndim=2, axis=1))
    axes = _axes(gm, mesh2x2)
    chain = find_fold(gm, world_size=4, axes=axes)
    g = gm.graph
    nodes = list(g.nodes)
    last = next(n for n in nodes if n.name == chain.points[-1].collective)
    x = next(n for n in nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point())
    with g.inserting_before(last):
        w = g.call_function(torch.ops.aten.mul_.Tensor, (x, 1.0))
    try:
        assert find_fold(gm, world_size=4, axes=axes) is None
    finally:
        g.erase_node(w)
    assert find_fold(gm, world_size=4, axes=axes) == chain
