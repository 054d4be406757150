"""Gradients as state of the step: several ``backward()`` calls in one step, and
gradients that a call leaves for the next (accumulation across calls).

Every test trains in float64 on all ranks simulated in one process and compares with
one device (atol 1e-9 / rtol 1e-7), and checks that the program is really distributed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing import SimulatedTraining, assert_distributed, assert_training_matches
from spmd_compiler.testing.models import GPT, MLP, backward_step, gpt_fsdp_plan, megatron_mlp_plan, optimizer_step


def two_backward_step(model, optimizer, ids, targets, ids2, targets2):
    """Gradient accumulation within the step: two micro-batches, two backward() calls."""
    first = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    first.backward()
    second = F.cross_entropy(model(ids2).flatten(0, 1), targets2.flatten())
    second.backward()
    optimizer.step()
    optimizer.zero_grad()
    return first + second


def _gpt():
    return GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double()


def _lm_batches(n=2, rows=8, tensors=2):
    return [tuple(torch.randint(0, 32, (rows, 8)) for _ in range(tensors)) for _ in range(n)]


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_two_backward_calls_in_one_step(mesh4, plan):
    plans = {"dp": None, "fsdp": gpt_fsdp_plan()}
    res = assert_training_matches(two_backward_step, _gpt(), lambda p: torch.optim.AdamW(p, lr=0.01), _lm_batches(tensors=4), mesh4, plans[plan])
    step = res.sim.expansions[(0,)]
    phases = {}
    for n in step.collectives():
        phases.setdefault(n.meta["spmd_phase"], []).append(n.meta["spmd_comm"]["kind"])
    if plan == "fsdp":
        # the second micro-batch's forward is forward: its parameters are gathered, not
        # used as shards; both backward's Partial gradients are summed, then reduce-scattered once
        assert_distributed(res, sharded=["batch[0]", "tok.weight", "blocks.0.fc.weight"])
        assert "all_gather" in phases["forward"], phases
        assert phases["optimizer"].count("reduce_scatter") == 1, phases
    else:
        # both backward's Partial gradients are summed locally and all-reduced once
        assert_distributed(res, sharded=["batch[0]", "batch[2]"], collectives={"optimizer/all_reduce/dp": 1})
        assert "all_gather" not in phases.get("forward", []), phases


def accumulating_step(set_to_none: bool):
    """The usual loop body with gradient accumulation over calls: backward() every call,
    an optimizer step (and zero_grad) when ``do_step``, every 4th call."""

    def step(model, optimizer, x, y, do_step):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if do_step:
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
        return loss

    return step


def _accumulation_batches(calls=6, every=4):
    """Calls 1-3 accumulate, call 4 steps, calls 5-6 accumulate again (their gradients
    are compared after the last call)."""
    return [(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64), i % every == every - 1) for i in range(calls)]


def _mlp_plans():
    return {
        "dp": (None, ["batch[0]", "batch[1]"]),
        "tp": (sc.Plan(params=megatron_mlp_plan().params, default_input=[Replicate()]), ["l1.weight", "l1.bias", "l2.weight"]),
        "fsdp": (sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",)), ["l1.weight", "l2.weight", "batch[0]"]),
    }


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("plan", ["dp", "tp", "fsdp"])
def test_accumulation_over_calls(mesh4, plan, set_to_none):
    the_plan, sharded = _mlp_plans()[plan]
    # SGD with momentum: its update is proportional to the gradient, so a lost or doubled
    # accumulation moves the parameters (Adam's would be nearly blind to the scale)
    res = assert_training_matches(
        accumulating_step(set_to_none), MLP().double(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), _accumulation_batches(), mesh4, the_plan
    )
    assert_distributed(res, sharded=sharded, collectives=1)
    assert any("gradients are set on 4 parameter(s)" in r for r in res.sim.reasons), res.sim.reasons
    # the last program starts from the gradients of the call before and keeps them
    step = res.sim.expansions[(0,)]
    assert step.traced.grads_in == step.traced.grads_left == ("l1.weight", "l1.bias", "l2.weight", "l2.bias")
    params = {i.name: s for i, s in zip(step.traced.inputs, step.input_specs) if i.kind == "param"}
    for inp, spec in zip(step.traced.inputs, step.input_specs):
        if inp.kind == "grad":  # stored like its parameter: sharded under FSDP (reduce-scattered), Replicate under DP
            assert tuple(spec.placements) == tuple(params[inp.name].placements), (inp.label, spec.placements)
    if plan == "fsdp":
        kinds = {(n.meta["spmd_phase"], n.meta["spmd_comm"]["kind"]) for n in step.collectives()}
        assert ("backward", "reduce_scatter") in kinds, kinds  # each call's gradient reduce-scattered into the stored shard
        assert_distributed(res, sharded=["l1.weight.grad", "l2.weight.grad"])


def test_accumulation_with_two_compiled_steps(mesh4):
    """``accumulate`` (backward only) and ``apply`` (optimizer step) as two compiled steps
    on one model: the gradients one leaves are the other's inputs."""
    accumulate, apply = backward_step, optimizer_step
    model = MLP().double()
    ref = MLP().double()
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    acc, app = (SimulatedTraining(f, model, opt, mesh4) for f in (accumulate, apply))
    for i, (x, y, do_step) in enumerate(_accumulation_batches(calls=8)):
        torch.testing.assert_close(acc.step(x, y), accumulate(ref, ref_opt, x, y), atol=1e-12, rtol=1e-10)
        if do_step:
            app.step()
            apply(ref, ref_opt)
            assert all(p.grad is None for p in model.parameters())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-10, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-10, msg=lambda m, n=n: f"{n}.grad: {m}")
    assert_distributed(acc, sharded=["batch[0]", "batch[1]"], collectives=1)


def zero_grad_first_step(model, optimizer, x, y):
    """zero_grad() at the start: the gradients outlive the call, as on one device."""
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_zero_grad_first_keeps_gradients_without_extra_communication(mesh4, plan):
    the_plan, sharded = _mlp_plans()[plan]
    res = assert_training_matches(
        zero_grad_first_step, MLP().double(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), [b[:2] for b in _accumulation_batches(calls=3)], mesh4, the_plan
    )
    # the gradients kept are the ones reduced for the optimizer: no second reduction
    kind = {"dp": "optimizer/all_reduce/dp", "fsdp": "optimizer/reduce_scatter/dp"}[plan]
    assert_distributed(res, sharded=sharded, collectives={kind: 1})
    step = res.sim.expansions[(0,)]
    assert step.traced.grads_left == ("l1.weight", "l1.bias", "l2.weight", "l2.bias")
    # zero_grad() dropped the gradients the call started with: the new ones are copied into their storage
    written = sorted(n.meta["spmd_writeback"] for n in step.gm.graph.nodes if str(n.meta.get("spmd_writeback", "")).startswith("grad "))
    assert written == ["grad l1.bias", "grad l1.weight", "grad l2.bias", "grad l2.weight"], written
