"""The intent check (spmd_compiler/driver/intent.py): the per-rank program keeps what the
step wrote, checked after the trace, the expansion and every pass; on in the harness,
``compile(check_intent=True)`` for users."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import Shard

import spmd_compiler as sc
from spmd_compiler.driver.intent import Intent, host_constant_losses, intent_losses, intent_of
from spmd_compiler.errors import IntentError
from spmd_compiler.optimize import default_passes
from spmd_compiler.optimize.runner import PassSpec
from spmd_compiler.plan import Plan
from spmd_compiler.testing import SimulatedTraining, fake_mesh
from spmd_compiler.testing.models import GPT, MLP, mse_train_step, train_step
from spmd_compiler.trace.markers import RECOMPUTE

aten = torch.ops.aten
DP = Plan(default_input=[Shard(0)])


@pytest.fixture
def mesh2():
    mesh = fake_mesh((2,), ("dp",))
    yield mesh
    dist.destroy_process_group()


def _compile(model, opt, batch, mesh, **options):
    sim = SimulatedTraining(train_step if batch[0].dtype == torch.int64 else mse_train_step, model, opt, mesh, DP,
                            create_lazy_state=False, **options)
    sim.step(*batch)
    return sim


def test_the_harness_checks_intent_by_default(mesh2):
    assert SimulatedTraining(mse_train_step, MLP(), None, mesh2).options.check_intent
    assert not sc.compile(mse_train_step, mesh=mesh2).options.check_intent  # users opt in
    assert sc.compile(mse_train_step, mesh=mesh2, check_intent=True).options.check_intent
    with pytest.raises(ValueError, match="check_intent='yes': expected True"):
        sc.compile(mse_train_step, mesh=mesh2, check_intent="yes")


def test_nadam_state_creating_call_keeps_its_host_numbers(mesh2):
    """NAdam's first call reads ``mu_product.item()`` from the state it creates (a NaN
    constant when the trace folded it, the guard's first check)."""
    model = MLP(8, 16).double()
    opt = torch.optim.NAdam(model.parameters(), lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)
    x = torch.randn(4, 8, dtype=torch.float64)
    sim = _compile(model, opt, (x, x), mesh2)
    assert sim.traced.new_optim_keys  # the state-creating call was checked


def test_a_checkpointed_model_keeps_its_recomputation(mesh2):
    """CSE merging the recomputed forward into the forward (the guard's second check)."""
    model = GPT(vocab=16, seq=8, dim=16, heads=2, layers=2, checkpoint="full").double()
    ids = torch.randint(0, 16, (4, 8))
    sim = _compile(model, torch.optim.SGD(model.parameters(), lr=0.1), (ids, ids), mesh2)
    gm = sim.expansions[(0,)].gm
    assert {n.meta[RECOMPUTE] for n in gm.graph.nodes if RECOMPUTE in n.meta} == {0, 1}


def _losing_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """The CSE blind to checkpointed regions (as it was): the recomputation merges into the forward."""
    from spmd_compiler.optimize.redundant import remove_redundant_collectives_pass

    regions = {n: n.meta.pop(RECOMPUTE) for n in gm.graph.nodes if RECOMPUTE in n.meta}
    gm = remove_redundant_collectives_pass(gm)
    for n in gm.graph.nodes:
        if n in regions:
            n.meta[RECOMPUTE] = regions[n]
    return gm


def test_a_pass_that_merges_a_recomputation_away_is_named(mesh2):
    model = GPT(vocab=16, seq=8, dim=16, heads=2, layers=1, checkpoint="full").double()
    ids = torch.randint(0, 16, (4, 8))
    passes = [PassSpec("merge_recompute", _losing_pass)]
    with pytest.raises(IntentError, match=r"(?s)lost what the step wrote, in pass 'merge_recompute'.*region 0's recomputation "
                                          r"in backward is gone.*passes_disabled=\('merge_recompute',\)"):
        _compile(model, torch.optim.SGD(model.parameters(), lr=0.1), (ids, ids), mesh2, passes=passes)


def _program(mesh, model, opt, x):
    sim = _compile(model, opt, (x, x), mesh, passes=default_passes())
    return sim.traced.gm, sim.expansions[(0,)].gm


def test_intent_of_a_trace_and_what_a_program_can_lose(mesh2):
    model = MLP(8, 16).double()
    traced_gm, gm = _program(mesh2, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.randn(4, 8, dtype=torch.float64))
    intent = intent_of(traced_gm)
    assert intent.phases == {"forward", "backward", "optimizer"}
    assert intent.updated == {"l1.weight", "l1.bias", "l2.weight", "l2.bias"} and not intent.regions
    assert intent_losses(intent, gm) == []
    # an update dropped: l2.bias's writes now go to a copy
    for n in list(gm.graph.nodes):
        if n.op == "placeholder" and n.meta.get("spmd_input") is not None and n.meta["spmd_input"].label == "l2.bias":
            with gm.graph.inserting_after(n):
                copy = gm.graph.call_function(aten.clone.default, (n,))
            n.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)
    assert intent_losses(intent, gm) == ["the trace updates parameter(s) l2.bias, the program does not write them"]
    # a phase gone, a region gone
    for n in gm.graph.nodes:
        if n.meta.get("spmd_phase") == "backward":
            n.meta["spmd_phase"] = "forward"
    lost = intent_losses(Intent(intent.phases, frozenset({3}), frozenset()), gm)
    assert lost == ["the trace computes in backward, the program does not",
                    "checkpointed region 3's recomputation in backward is gone (merged into the forward it repeats: its "
                    "activations live from forward to backward again)"]


def test_a_recomputation_moved_into_forward_is_named():
    g = fx.Graph()
    x = g.placeholder("x")
    early = g.call_function(aten.relu.default, (x,))
    early.meta.update({RECOMPUTE: 0, "spmd_phase": "backward"})
    loss = g.call_function(aten.sum.default, (x,))  # the forward is not done yet
    loss.meta["spmd_phase"] = "forward"
    start = g.call_function(aten.neg.default, (x,))
    start.meta["spmd_phase"] = "backward"
    g.output((early, loss, start))
    gm = fx.GraphModule(torch.nn.Module(), g)
    lost = intent_losses(Intent(frozenset({"forward", "backward"}), frozenset({0}), frozenset()), gm)
    assert len(lost) == 1 and "region 0's recomputation runs before backward starts" in lost[0]
    loss.append(early)  # after the forward's last node: in backward, where it belongs
    assert intent_losses(Intent(frozenset({"forward", "backward"}), frozenset({0}), frozenset()), gm) == []


def test_host_arithmetic_on_a_nan_constant_is_named():
    g = fx.Graph()
    lr = g.placeholder("lr")
    bad = g.call_function(operator.truediv, (lr, float("nan")))
    fill = g.call_function(aten.full.default, ([2], float("-inf")))  # a tensor filled with -inf is the user's
    g.output((bad, fill))
    lost = host_constant_losses(fx.GraphModule(torch.nn.Module(), g))
    assert len(lost) == 1 and "truediv" in lost[0] and "from the constant nan" in lost[0]
