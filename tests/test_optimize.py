"""Optimization passes: numerics unchanged, duplicates removed, buckets, overlap order."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
from torch.distributed.tensor import Shard

import spmd_compiler as sc
from spmd_compiler.optimize import (
    PassSpec,
    bucket_gradients_pass,
    default_passes,
    overlap_pass,
    remove_redundant_collectives_pass,
    run_passes,
)
from spmd_compiler.optimize.bucketing import gradient_reductions
from spmd_compiler.optimize.graph_utils import is_collective, is_wait, positions
from spmd_compiler.testing import SimulatedTraining, assert_distributed, assert_training_matches
from spmd_compiler.testing.models import GPT, MLP, gpt_2d_plan, gpt_fsdp_plan, mse_train_step, train_step
from spmd_compiler.testing.models import accumulating_mse_step as _accumulate


_TRACED: dict = {}


def adam_gpt(layers=1):
    """Traced once per module and depth: the tests expand it afresh (expansion does not
    modify a traced step; the passes they run rewrite only the expanded graph)."""
    if layers not in _TRACED:
        model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=layers)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        ids = torch.randint(0, 32, (8, 8))
        train_step(model, opt, ids, ids)  # materialize Adam state: trace the steady step
        _TRACED[layers] = sc.trace(train_step, model, opt, ids, ids)
    return _TRACED[layers]


def _kinds(gm):
    return [n.meta["spmd_comm"]["kind"] for n in gm.graph.nodes if is_collective(n)]


@pytest.mark.slow
def test_passes_keep_numerics_2d_transformer(mesh2x2):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2).double()
    batches = [(torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))) for _ in range(3)]
    res = assert_training_matches(
        train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh2x2, gpt_2d_plan(),
        passes=default_passes(bucket_mb=0.001),
    )
    assert_distributed(res, sharded=["batch[0]", "blocks.0.attn.q.weight"])
    records = res.sim.expansions[(0, 0)].pass_records
    assert [r.name for r in records] == list(sc.optimize.DEFAULT_PASSES)
    bucketing = next(r for r in records if r.name == "bucket_gradients")
    assert bucketing.collectives_after < bucketing.collectives_before  # buckets formed


def test_passes_keep_numerics_fsdp(mesh4):
    batches = [(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)) for _ in range(3)]

    def step(model, opt, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    res = assert_training_matches(step, MLP().double(), lambda p: torch.optim.Adam(p, lr=0.01), batches, mesh4,
                                  sc.Plan(params={"*": [sc.Shard(0)]}), passes=default_passes(bucket_mb=0.001))
    assert_distributed(res, sharded=["l1.weight", "l2.weight", "batch[0]"])


def test_duplicate_collectives_removed(mesh4):
    """Parameters sharded for compute (no fsdp_axes) gather the same activations for
    several users. (The FSDP plan no longer has duplicates to merge: the expander gathers
    each parameter once per phase, or once per step with reshard_after_forward=False.)"""
    traced = adam_gpt()
    step = sc.expand(traced, mesh4, sc.Plan(params={"*": [Shard(0)]}))
    gm = step.gm
    before = _kinds(gm)
    remove_redundant_collectives_pass(gm)
    after = _kinds(gm)
    assert len(after) < len(before)
    # no two collectives left with the same op, input and arguments
    keys = [(n.target, n.args) for n in gm.graph.nodes if is_collective(n)]
    assert len(keys) == len(set(keys))
    merged = [n for n in gm.graph.nodes if is_collective(n) and n.meta["spmd_comm"].get("history")]
    assert merged and "duplicate" in merged[0].meta["spmd_comm"]["history"][0]


def test_never_merges_values_written_in_place(mesh4):
    """Adam's exp_avg and exp_avg_sq start as identical zeros_like: merging them would make
    two optimizer states share storage."""
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    traced = sc.trace(train_step_mse, model, opt, torch.randn(8, 16), torch.randn(8, 16))
    step = sc.expand(traced, mesh4)
    zeros = [n for n in step.gm.graph.nodes if n.target is torch.ops.aten.zeros_like.default]
    assert len(zeros) >= 2 and step.collectives()  # something the pass could merge
    remove_redundant_collectives_pass(step.gm)
    assert [n for n in step.gm.graph.nodes if n.target is torch.ops.aten.zeros_like.default] == zeros


def test_never_merges_reads_across_a_write_through_a_view(mesh4):
    """The second x.sum() reads x itself, not the write's result: only the order of the
    write (through a view of x) between the two reads keeps them apart."""
    from spmd_compiler.testing import assert_spmd_matches

    def f(x):
        before = x.sum()
        x[:, :1].mul_(2)
        after = x.sum()
        return before, after

    run = assert_spmd_matches(f, [torch.randn(8, 3, dtype=torch.float64)], mesh4, [[sc.Shard(0)]], atol=1e-12)
    gm = next(iter(run.steps.values())).gm
    assert len([n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.default]) == 2


def test_a_collective_is_not_hoisted_above_a_write_to_its_storage(mesh4):
    """The gather reads a view of x made before x is written: issued early, it would
    gather the old values."""
    from spmd_compiler.testing import assert_spmd_matches

    def f(x):
        v = x[:, :2]
        x.mul_(2)
        return torch.cumsum(v, 0)  # gathers the sharded dim

    run = assert_spmd_matches(f, [torch.randn(8, 3, dtype=torch.float64)], mesh4, [[sc.Shard(0)]], atol=1e-12)
    gm = next(iter(run.steps.values())).gm
    pos = positions(gm)
    write = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul_.Tensor)
    assert all(pos[n] > pos[write] for n in gm.graph.nodes if is_collective(n))


def train_step_mse(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _grad_bytes(n):
    """Bytes of the gradients a reduction carries (not of the values riding in its bucket)."""
    members = n.meta["spmd_comm"].get("bucket")
    return sum(m["bytes"] for m in members if not m.get("rider")) if members else n.meta["spmd_comm"]["bytes"]


@pytest.mark.parametrize("bucket_mb", [0.002, 0.01, 25.0])
def test_bucket_count_is_ceil_of_bytes(mesh4, bucket_mb):
    traced = adam_gpt(layers=2)
    step = sc.expand(traced, mesh4)  # data parallel: every gradient all_reduced over dp
    grads = gradient_reductions(step.gm)
    assert len(grads) == len(list(traced.state.params))  # one per gradient, to bucket
    total = sum(n.meta["spmd_comm"]["bytes"] for n in grads)
    bucket_gradients_pass(step.gm, bucket_mb=bucket_mb)
    buckets = gradient_reductions(step.gm)
    cap = bucket_mb * 2**20
    largest = max(n.meta["spmd_comm"]["bytes"] for n in grads)
    # a bucket closes once it reaches the cap, so every bucket but the last holds >= cap
    # and < cap + largest gradient bytes
    assert len(buckets) <= total // cap + 1
    assert len(buckets) >= total / (cap + largest)
    if largest * 4 < cap:  # gradients small next to a bucket: exactly ceil(bytes / bucket)
        assert len(buckets) == math.ceil(total / cap)
    assert sum(_grad_bytes(n) for n in buckets) == total


@pytest.mark.parametrize("first_mb", [None, 0.002])
def test_first_bucket_is_small_as_in_ddp(mesh4, first_mb):
    traced = adam_gpt(layers=2)
    step = sc.expand(traced, mesh4)
    grads = gradient_reductions(step.gm)
    assert len(grads) == len(list(traced.state.params))  # one per gradient, to bucket
    total = sum(n.meta["spmd_comm"]["bytes"] for n in grads)
    cap = 0.01 * 2**20
    bucket_gradients_pass(step.gm, bucket_mb=0.01, first_bucket_mb=first_mb)
    pos = positions(step.gm)
    buckets = sorted(gradient_reductions(step.gm), key=lambda n: pos[n])
    if first_mb is None:
        assert len(buckets) == math.ceil(total / cap)
    else:
        first = first_mb * 2**20
        assert first <= _grad_bytes(buckets[0]) < cap  # closed at the small size
        assert len(buckets) == 1 + math.ceil((total - _grad_bytes(buckets[0])) / cap)
    with pytest.raises(ValueError, match="first_bucket_mb must be positive"):
        bucket_gradients_pass(step.gm, first_bucket_mb=0)


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_gradients_kept_across_calls_are_reduced_in_one_bucket(mesh4, plan):
    """A call that keeps its gradients (returned new, or added into those it started with)
    reduces them in one bucket per group as a step does; training equals one device."""
    the_plan = {"dp": None, "fsdp": sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",))}[plan]
    model, ref = MLP().double(), MLP().double()
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    sim = SimulatedTraining(_accumulate, model, opt, mesh4, the_plan)
    programs = {}
    for i in range(4):  # no gradients at the call, then accumulate into them, then step
        batch = (torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64), i == 2)
        torch.testing.assert_close(sim.step(*batch), _accumulate(ref, ref_opt, *batch), atol=1e-12, rtol=1e-10)
        programs.setdefault(sim.reasons[-1], sim.expansions[(0,)])
    assert len(programs) == 4, list(programs)  # first call, gradients kept, step, optimizer state made
    kind = {"dp": "all_reduce", "fsdp": "reduce_scatter"}[plan]
    for reason, step in list(programs.items())[:3]:  # the steady step (last) is covered by the bucket tests
        reductions = [n for n in step.collectives() if n.meta["spmd_comm"]["kind"] == kind and n.args[1] == "sum"]
        assert len(reductions) == 1, (reason, [n.meta["spmd_comm"]["reason"] for n in reductions])
        members = reductions[0].meta["spmd_comm"]["bucket"]
        assert len([m for m in members if not m.get("rider")]) == 4, reason  # every gradient of the MLP
        assert len(members) == 5, reason  # and the loss, riding along (FSDP: in every row of the reduce_scatter)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-10, msg=lambda m, name=name: f"{name}.grad: {m}")


def test_overlap_issues_early_and_waits_late(mesh4):
    traced = adam_gpt()
    step = sc.expand(traced, mesh4)
    gm = step.gm
    bucket_gradients_pass(gm, bucket_mb=0.002)
    overlap_pass(gm)
    assert len(gradient_reductions(gm)) >= 2  # buckets to overlap
    pos = positions(gm)
    for n in gm.graph.nodes:
        if is_collective(n):
            # issued right after its input is ready (only input preparation in between)
            wait = next(u for u in n.users if is_wait(u))
            assert pos[wait] > pos[n]
        if is_wait(n) and n.users:
            first = min(pos[u] for u in n.users)
            assert first == pos[n] + 1  # waited for just before its first use
    # gradient reductions now start in the backward region, before the optimizer needs them
    grads = gradient_reductions(gm)
    first_opt = min(pos[n] for n in gm.graph.nodes if n.meta.get("spmd_phase") == "optimizer" and not is_collective(n) and n.op == "call_function" and n.target is not torch.ops.aten.reshape.default and "bucket" not in str(n.meta.get("spmd_origin", {}).get("node", "")))
    assert any(pos[n] < first_opt for n in grads)


def test_fsdp_prefetch_limits_live_gathers(mesh4):
    traced = adam_gpt(layers=2)
    step = sc.expand(traced, mesh4, gpt_fsdp_plan())
    gm = step.gm
    overlap_pass(gm, prefetch=2)
    pos = positions(gm)
    from spmd_compiler.optimize.overlap import is_param_gather

    gathers = [n for n in gm.graph.nodes if is_collective(n) and is_param_gather(n)]
    assert gathers
    # gathers are issued a couple ahead of need, not all at the top: before the first
    # gathered parameter is used, only about `prefetch` gathers have been issued
    def first_use(g):
        return min(pos[u] for u in next(w for w in g.users if is_wait(w)).users)

    earliest_use = min(first_use(g) for g in gathers)
    issued_early = [g for g in gathers if pos[g] < earliest_use]
    assert len(issued_early) <= 2 + 1 < len(gathers)  # prefetch, plus one tie (weight and bias used together)
    for g in gathers:
        assert pos[g] < first_use(g)


def test_runner_logs_disables_and_names_failures(mesh4, caplog):
    traced = adam_gpt()
    step = sc.expand(traced, mesh4)
    with caplog.at_level(logging.INFO, logger="spmd_compiler.optimize"):
        gm, records = run_passes(step.gm, default_passes(), disabled=["overlap", "schedule"])
    assert [r.name for r in records] == [
        "remove_redundant_collectives", "sum_partials_before_reducing", "fuse_mean_reductions", "defer_mean_divisor", "bucket_gradients", "bucket_parameter_gathers",
        "fuse_all_reduces",
        "rematerialize",
        "budget_prefetch",
    ]
    assert any("pass overlap: disabled" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith("pass bucket_gradients:") and "collectives" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="cannot disable unknown passes"):
        run_passes(gm, default_passes(), disabled=["bucketing"])

    def broken(gm):
        raise RuntimeError("boom")

    with pytest.raises(sc.SpmdError, match="optimization pass 'broken' failed: RuntimeError: boom"):
        run_passes(gm, [PassSpec("broken", broken)])


def test_runner_generates_the_code_once(mesh4, monkeypatch):
    """Passes work on the graph: its Python code is generated after the last pass only
    (about 1 s per recompile of a 20,000-node 8B program), and it is the final graph's."""
    step = sc.expand(adam_gpt(), mesh4)
    calls = []
    recompile = torch.fx.GraphModule.recompile
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", lambda self: calls.append(1) or recompile(self))
    gm, records = run_passes(step.gm, default_passes())
    assert len(records) == len(default_passes()) and len(calls) == 1
    assert gm.code == torch.fx.GraphModule(gm, gm.graph).code


def test_compile_runs_passes_and_dumps_each(mesh4, tmp_path):
    model = MLP()
    step = sc.compile(train_step_mse, mesh=mesh4, dump_dir=str(tmp_path), bucket_mb=0.001)
    opt = torch.optim.Adam(model.parameters())
    step(model, opt, torch.randn(2, 16), torch.randn(2, 16))
    assert [r.name for r in step.last.pass_records] == list(sc.optimize.DEFAULT_PASSES)
    folder = step.dumps[-1]
    assert sorted(p.name for p in folder.glob("pass_*.py")) == [
        f"pass_{i:02d}_{name}.py" for i, name in enumerate(sc.optimize.DEFAULT_PASSES)
    ]
    assert "bucket of" in (folder / "pass_04_bucket_gradients.py").read_text()
    assert step.timings()["passes"] > 0


def _breaks_order_pass(gm):
    """A broken pass: moves the first call to the end, after its users."""
    first = next(n for n in gm.graph.nodes if n.op == "call_function" and n.users)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.prepend(first)
    return gm


def test_a_pass_that_breaks_the_graph_is_named_in_a_short_error():
    from spmd_compiler.errors import SpmdError
    from spmd_compiler.optimize import PassSpec, run_passes

    traced = sc.trace(lambda m, o, x: m(x).sum(), MLP(4, 8), None, torch.randn(2, 4))
    gm = traced.gm
    assert len(gm.graph.nodes) > 4
    with pytest.raises(SpmdError, match=r"optimization pass 'breaks_order' left an invalid program: node 'addmm' reads 't' before") as info:
        run_passes(gm, [PassSpec("breaks_order", _breaks_order_pass)])
    text = str(info.value)
    assert len(text) < 2000 and len(text.splitlines()) < 40
    assert "graph node: %addmm" in text and "reads:      %t " in text  # the node and the value it reads too early
    assert "user code:" in text and "models.py" in text  # the user's line the node came from
    assert "fix for now: compile(..., passes_disabled=('breaks_order',))" in text and "please report it" in text


def _renames_an_input_pass(gm):
    """A broken pass: renames a placeholder the runtime binds a value to by name."""
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    first.name = "renamed"
    return gm


def test_a_pass_must_keep_the_programs_inputs_and_outputs():
    from spmd_compiler.optimize import PassSpec, check_program, run_passes

    traced = sc.trace(lambda m, o, x: m(x).sum(), MLP(4, 8), None, torch.randn(2, 4))
    check_program(traced.gm)  # a traced program is valid
    with pytest.raises(sc.SpmdError, match=r"'renames' left an invalid program: the program's inputs changed: expected \['p_l1_weight'"):
        run_passes(traced.gm, [PassSpec("renames", _renames_an_input_pass)])
    with pytest.raises(sc.SpmdError, match="'forgets_return' left an invalid program: expected the pass to return an fx.GraphModule, got NoneType"):
        run_passes(traced.gm, [PassSpec("forgets_return", lambda gm: None)])


def test_a_pass_whose_graph_fails_lint_keeps_the_message_short():
    from spmd_compiler.optimize import PassSpec, run_passes

    def bad_target(gm):  # reads an attribute the module lacks: lint refuses it
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm.graph.get_attr("missing")
        return gm

    traced = sc.trace(lambda m, o, x: m(x).sum(), MLP(4, 8), None, torch.randn(2, 4))
    with pytest.raises(sc.SpmdError, match="'bad_target' left an invalid program") as info:
        run_passes(traced.gm, [PassSpec("bad_target", bad_target)])
    assert len(str(info.value).splitlines()) < 40 and len(str(info.value)) < 2000
    assert "graph node: %missing " in str(info.value)


# plans where the default passes once broke a program: sizes 1 over 2 ranks (uneven, some
# shards empty) made CSE and the gather fold rank-specific, so the simulated ranks ended
# with different programs (RankMismatchError); a parameter gathered as a view computed in
# backward was fused into a unit gather placed before the view existed (fx lint error)
R, S0 = sc.Replicate(), sc.Shard(0)
PASS_REGRESSIONS = {
    "uneven-cse-2x2": ((2, 2), {"l1.weight": [S0, S0]}, [R, R], lambda p: torch.optim.Adam(p, lr=0.01)),
    "late-view-gather": ((2,), {"l1.bias": [S0], "l2.weight": [S0]}, [R], lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
}


@pytest.mark.parametrize("case", list(PASS_REGRESSIONS))
def test_default_passes_keep_every_rank_on_one_program(case):
    from spmd_compiler.testing import fake_mesh

    shape, params, batch_pl, make_opt = PASS_REGRESSIONS[case]
    mesh = fake_mesh(shape, [f"a{i}" for i in range(len(shape))])
    torch.manual_seed(0)
    batches = [(torch.randn(1, 1, dtype=torch.float64), torch.randn(1, 1, dtype=torch.float64)) for _ in range(2)]
    res = assert_training_matches(mse_train_step, MLP(1, 1).double(), make_opt, batches, mesh, sc.Plan(params=params, default_input=batch_pl),
                                  atol=1e-8, rtol=1e-6)
    programs = res.sim.expansions
    assert_distributed(res, collectives=1)
    assert len({id(p) for p in programs.values()}) == len(programs) > 1  # uneven: one program per rank, all run
    assert all(p.pass_records for p in programs.values())  # the default passes ran on each
