"""expand/rules/norms.py under FSDP: clip_grad_norm_ reads each gradient while its sum
over the data axis is pending; the gradient is reduced to its parameter's shard (one
bucketed reduce_scatter, as without clipping), not all-reduced whole and sliced (twice
the bytes), and the norms are taken shard-wise (one tiny all_reduce). Equal to one device.
The link from a gradient to its parameter is traced (trace/grad_links.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import MLP
from spmd_compiler.trace.grad_links import GRAD_OF
from spmd_compiler.trace.tracer import trace
from test_expand_rules_norms import _batches, _step  # the same step and batches as the 1-D and 2-D cases

FSDP = sc.Plan(params={"*": [sc.Shard(0)]}, fsdp_axes=(0,))
# 2-D FSDP x TP: each weight sharded on dp along the dim tensor parallelism leaves whole
FSDP_TP = sc.Plan(
    params={"l1.weight": [sc.Shard(1), sc.Shard(0)], "l1.bias": [sc.Replicate(), sc.Shard(0)],
            "l2.weight": [sc.Shard(0), sc.Shard(1)], "l2.bias": [sc.Shard(0), sc.Replicate()]},
    default_input=[sc.Shard(0), sc.Replicate()], fsdp_axes=(0,),
)


def _run(plan, mesh, clip, foreach=True):
    torch.manual_seed(0)
    res = assert_training_matches(_step(clip, foreach), MLP(16, 32).double(), lambda p: torch.optim.AdamW(p, lr=0.05), _batches(),
                                  mesh, plan, atol=1e-12, rtol=1e-10)
    return res, res.sim.expansions[next(iter(res.sim.expansions))].collectives()


def _text(comms):
    return [(n.target.__name__, n.meta["spmd_comm"]["reason"], tuple(n.args[0].meta["val"].shape)) for n in comms]


def _numel(n):
    return n.args[0].meta["val"].numel()


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach_norm", "vector_norm"])
def test_clip_under_fsdp_reduce_scatters_the_gradients(foreach):
    _, plain = _run(FSDP, fake_mesh((2,), ("dp",)), clip=False)
    res, comms = _run(FSDP, fake_mesh((2,), ("dp",)), clip=True, foreach=foreach)
    assert_distributed(res, sharded=["l1.weight", "l2.weight"])
    grads = sum(p.numel() for p in MLP(16, 32).parameters())  # 1072
    scatters = [n for n in comms if "reduce_scatter" in str(n.target)]
    # one bucket holds all 4 gradients (2 ranks' rows of each rank's share); before the
    # rule the bucket was 4 gradient all_reduces of the whole gradients
    assert len(scatters) == 1 and "4 gradient reduce_scatters" in scatters[0].meta["spmd_comm"]["reason"], _text(comms)
    assert _numel(scatters[0]) >= grads, _text(comms)
    reduces = [n for n in comms if "all_reduce" in str(n.target)]
    assert all(_numel(n) <= 8 for n in reduces), _text(comms)  # the norms (and the loss), never a gradient
    assert len(comms) == len(plain) + 1, (_text(plain), _text(comms))  # one tiny all_reduce more than without clipping


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach_norm", "vector_norm"])
def test_clip_under_fsdp_x_tp_reduce_scatters_on_dp(foreach):
    res, comms = _run(FSDP_TP, fake_mesh((2, 2), ("dp", "tp")), clip=True, foreach=foreach)
    assert_distributed(res, sharded=["l1.weight", "l2.weight"])
    opt = [n for n in comms if n.meta.get("spmd_phase") == "optimizer"]
    assert not [n for n in opt if "all_gather" in str(n.target)], _text(opt)
    # the three dp-sharded gradients are reduce_scattered in one bucket; all_reduced are
    # only l1.bias's (replicated on dp: 16 local elements, the loss riding along) and the
    # norms. Before the rule: one all_reduce of every whole gradient (545 elements).
    scatters = [n for n in opt if "reduce_scatter" in str(n.target)]
    assert len(scatters) == 1 and "3 gradient reduce_scatters" in scatters[0].meta["spmd_comm"]["reason"], _text(opt)
    assert all(_numel(n) <= 17 for n in opt if "all_reduce" in str(n.target)), _text(opt)
    # the norms, pending on dp, on tp or on both, are stacked as one Partial(norm) value:
    # one all_reduce of the 4 norms per axis (before the stack rule: 6 scalar all_reduces)
    norms = [n for n in opt if "all_reduce" in str(n.target) and "norm" in n.meta["spmd_comm"]["reason"]]
    assert len(norms) == 2 and all(_numel(n) == 4 for n in norms), _text(opt)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach_norm", "vector_norm"])
def test_clip_under_dp_x_tp_stacks_the_norms_in_one_all_reduce(foreach):
    """2-D DP x TP (the Megatron MLP): the tensor-parallel norms are Partial(norm) on tp,
    the others replicated; the replicated ones are lifted to shares (scaled locally), so
    one all_reduce of the stacked norms on tp replaces one per tensor-parallel gradient."""
    from spmd_compiler.testing.models import megatron_mlp_plan

    plan = sc.Plan(params=megatron_mlp_plan(ndim=2, axis=1).params, default_input=[sc.Shard(0), sc.Replicate()])
    _, comms = _run(plan, fake_mesh((2, 2), ("dp", "tp")), clip=True, foreach=foreach)
    tp = [n for n in comms if n.meta.get("spmd_phase") == "optimizer" and "'tp'" in n.meta["spmd_comm"]["reason"]]
    assert len(tp) == 1 and _numel(tp[0]) == 4, _text(comms)


def test_gradients_are_linked_to_their_parameters_across_calls():
    """The tag sits on the node p.grad is after backward, after the accumulation into a
    gradient kept from an earlier call too (what clip_grad_norm_ reads)."""
    def step(model, optimizer, x, y):
        F.mse_loss(model(x), y).backward()
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5, foreach=True)

    model = MLP(16, 32).double()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # accumulated by an earlier call
    x, y = _batches()[0]
    gm = trace(step, model, None, x, y).gm
    (norm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten._foreach_norm.Scalar]
    assert [a.meta.get(GRAD_OF) for a in norm.args[0]] == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    assert all(a.op != "placeholder" for a in norm.args[0])  # the sum with the kept gradient, not the input


@pytest.mark.parametrize("defer", [False, True], ids=["reduced_each_call", "defer_grad_sync"])
def test_clip_after_accumulation_over_calls_reduce_scatters(defer):
    """Gradients kept across calls: the stepping call clips the sum of the kept and the new
    gradient (the node the trace tags); it is reduce_scattered in one bucket, as one device."""
    import copy

    from spmd_compiler.testing import SimulatedTraining

    def step(model, optimizer, x, y, do_step):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if do_step:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
        return loss

    torch.manual_seed(0)
    model = MLP(16, 32).double()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    plan = sc.Plan(params={"*": [sc.Shard(0)]}, fsdp_axes=(0,), defer_grad_sync=defer)
    sim = SimulatedTraining(step, model, opt, fake_mesh((4,), ("dp",)), plan)
    for i, (x, y) in enumerate(_batches() * 2):
        do_step = i % 3 == 2
        loss, want = sim.step(x, y, do_step), step(ref, ref_opt, x, y, do_step)
        assert abs(loss.item() - want.item()) < 1e-12
        assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) < 1e-12
        if do_step:
            comms = [n for n in sim.expansions[(0,)].collectives() if n.meta.get("spmd_phase") != "forward"]
            scatters = [n for n in comms if "reduce_scatter" in str(n.target)]
            assert len(scatters) == 1 and "4 gradient reduce_scatters" in scatters[0].meta["spmd_comm"]["reason"], _text(comms)
            assert all(_numel(n) <= 8 for n in comms if "all_reduce" in str(n.target)), _text(comms)


def _clip_value_step(foreach: bool):
    def step(model, optimizer, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.01, foreach=foreach)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach_clamp", "clamp_"])
@pytest.mark.parametrize("plan_name", ["fsdp", "dp"])
def test_clip_grad_value_reduces_each_gradient_to_its_parameter_layout(foreach, plan_name, caplog):
    """clip_grad_value_ clamps each gradient in place while its sum is pending: the sum is
    reduced to the parameter's layout first (one bucketed reduce_scatter under FSDP, the
    all_reduce under DP), then each rank clamps its part. Before the rule the replicate
    fallback all-reduced every gradient whole under FSDP, with a warning. The clip value
    is small enough that most gradient entries are clamped: equal to one device."""
    plan, mesh = (FSDP, fake_mesh((2,), ("dp",))) if plan_name == "fsdp" else (sc.Plan(), fake_mesh((2,), ("dp",)))
    torch.manual_seed(0)
    with caplog.at_level("WARNING"):
        res = assert_training_matches(_clip_value_step(foreach), MLP(16, 32).double(), lambda p: torch.optim.AdamW(p, lr=0.05),
                                      _batches(), mesh, plan, atol=1e-12, rtol=1e-10)
    assert not [r for r in caplog.records if "no sharding strategy" in r.getMessage()], caplog.text
    comms = res.sim.expansions[next(iter(res.sim.expansions))].collectives()
    grads = sum(p.numel() for p in MLP(16, 32).parameters())
    gradient_reductions = [n for n in comms if "all_gather" not in str(n.target) and _numel(n) >= grads // 2]
    want = "reduce_scatter" if plan_name == "fsdp" else "all_reduce"
    assert len(gradient_reductions) == 1 and want in str(gradient_reductions[0].target), _text(comms)
    if plan_name == "fsdp":
        assert not [n for n in comms if "all_reduce" in str(n.target) and _numel(n) > 8], _text(comms)
