"""torchtitan 0.3.0's own MoE models (tests/zoo/titan_moe.py: Qwen3-MoE and DeepSeek-V3,
tiny, built from torchtitan's configs, its SDPA attention, its expert-bias load balancing)
under DP, FSDP, EP, EP x FSDP, experts-TP, TP, 2-D (dp x tp) and EP x TP: 3 AdamW steps in
float64 equal to one device, with the collectives asserted. Tokens cross ranks only where
EP says so: under DP/FSDP/TP nothing gathers activations; under EP the routed rows travel
in ``spmd_compiler::all_to_all_rows`` and the expert weights stay split."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from titan_moe import balanced_step, batches, deepseek_v3, qwen3_moe, register_load_balancing, train_step
from torch.distributed.tensor import Replicate, Shard
from zoo_common import adamw, gathered

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.harness import SimulatedTraining
from spmd_compiler.testing.kernels import float64_grouped_mm

MODELS = {"qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}
EXPERTS = ["w1_EFD", "w2_EDF", "w3_EFD"]
# the experts' hidden dim over tp: w1/w3 (experts, hidden, dim), w2 (experts, dim, hidden)
EXPERTS_TP = {"*.inner_experts.w1_EFD": [Shard(1)], "*.inner_experts.w3_EFD": [Shard(1)], "*.inner_experts.w2_EDF": [Shard(2)]}
# Megatron attention (and DeepSeek's dense and shared-expert feed-forwards) over tp
ATTENTION_TP = {
    "qwen3_moe": {"*.wqkv.weight": [Shard(0)], "*.attention.wo.weight": [Shard(1)]},
    "deepseek_v3": {"*.attention.wq.weight": [Shard(0)], "*.attention.wkv_b.weight": [Shard(0)], "*.attention.wo.weight": [Shard(1)],
                    "*.w1.weight": [Shard(0)], "*.w3.weight": [Shard(0)], "*.w2.weight": [Shard(1)]},
}


def _on(params: dict, first) -> dict:
    return {k: [first, *v] for k, v in params.items()}


def plan(model: str, name: str) -> tuple:
    """``(mesh, Plan)`` of a named plan."""
    dp, tp, dp_tp = fake_mesh((2,), ("dp",)), fake_mesh((2,), ("tp",)), fake_mesh((2, 2), ("dp", "tp"))
    att = ATTENTION_TP[model]
    return {
        "dp": (dp, sc.Plan()),
        "fsdp": (dp, sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=(0,))),
        "ep": (dp, sc.Plan(params={"*.inner_experts.*": [Shard(0)]})),
        "ep_fsdp": (dp, sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=(0,), expert_axes=(0,))),
        "experts_tp": (tp, sc.Plan(params=EXPERTS_TP, default_input=[Replicate()])),
        "tp": (tp, sc.Plan(params={**EXPERTS_TP, **att}, default_input=[Replicate()])),
        "tp_2d": (dp_tp, sc.Plan(params={**_on(EXPERTS_TP, Replicate()), **_on(att, Replicate())}, default_input=[Shard(0), Replicate()])),
        "ep_tp": (dp_tp, sc.Plan(params={**_on(EXPERTS_TP, Shard(0)), **_on(att, Replicate())}, default_input=[Shard(0), Replicate()])),
    }[name]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast")  # torchtitan's float32 autocast around the router's gate
        yield


def _rows_exchanges(sim) -> dict:
    """Phase -> number of ``spmd_compiler::all_to_all_rows`` in rank 0's program."""
    out: dict = {}
    for n in sim.expansions[next(iter(sim.expansions))].collectives():
        if "all_to_all_rows" in str(n.target):
            out[n.meta["spmd_phase"]] = out.get(n.meta["spmd_phase"], 0) + 1
    return out


def _expert_weights(model: torch.nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] in EXPERTS]


def check(model_name: str, plan_name: str, **config) -> None:
    """3 steps of ``balanced_step`` (torchtitan's expert-bias update included) equal to
    one device in float64, and distributed as the plan says."""
    model = MODELS[model_name](**config)
    mesh, p = plan(model_name, plan_name)
    with float64_grouped_mm():
        res = assert_training_matches(balanced_step, model, adamw, batches(), mesh, p, atol=1e-9, rtol=1e-7)
    dist = assert_distributed(res, collectives=1)
    experts = _expert_weights(model)
    rows = _rows_exchanges(res.sim)
    assert gathered(res, but="FSDP: gather") == [], dist.describe()  # no activation (token, routed row, count) is gathered
    if plan_name.startswith("ep"):  # rows to their experts and back, forward and backward; the experts stay split
        assert rows == {"forward": 2, "backward": 2}, (rows, dist.describe())
        assert_distributed(res, sharded=experts)
        assert dist.placements[experts[0]].startswith("S(0)"), dist.placements[experts[0]]
    else:
        assert rows == {} and dist.count("all_to_all") == 0, dist.describe()  # tokens stay where they are
    if plan_name in ("dp", "ep"):
        assert dist.count("all_gather") == 0 and dist.count("reduce_scatter") == 0, dist.describe()
    if "fsdp" in plan_name:
        assert_distributed(res, sharded=[n for n, _ in model.named_parameters()][:4])
        assert dist.count("forward/all_gather") >= 1 and dist.count("optimizer/reduce_scatter") >= 1, dist.describe()
    if "tp" in plan_name:
        assert_distributed(res, sharded=experts)
        assert dist.count("forward/all_reduce/tp") >= 1 and dist.count("all_gather") == 0, dist.describe()
    # the expert-bias update ran: torchtitan's counters were zeroed, the biases moved (as on one device)
    buffers = dict(model.named_buffers())
    assert all(float(b.abs().sum()) == 0 for n, b in buffers.items() if n.endswith("tokens_per_expert_E"))


# by default: EP x FSDP, EP on the other model, and experts-TP in the item-2 test below
DEFAULT = [("qwen3_moe", "ep_fsdp"), ("deepseek_v3", "ep")]
PLANS = ["dp", "fsdp", "ep", "ep_fsdp", "experts_tp", "tp", "tp_2d", "ep_tp"]
SLOW = [(m, p) for m in MODELS for p in PLANS if (m, p) not in DEFAULT]


@pytest.mark.parametrize(("model_name", "plan_name"), DEFAULT)
def test_titan_moe_float64_equals_one_device(model_name, plan_name):
    # by default DeepSeek-V3 is its one MoE layer (MLA, shared experts); all_plans has the dense first layer too
    check(model_name, plan_name, **({"n_layers": 1, "n_dense_layers": 0} if model_name == "deepseek_v3" else {}))


@pytest.mark.slow
@pytest.mark.parametrize(("model_name", "plan_name"), SLOW)
def test_titan_moe_float64_equals_one_device_all_plans(model_name, plan_name):
    check(model_name, plan_name)


def test_experts_tp_combine_reduces_before_its_float32_cast():
    """Issue #32 item 2: torchtitan's combine scales the experts' outputs in float32
    (``routed_output_RD.to(torch.float32) * scores``); with the experts' hidden dim split,
    that output is each rank's ``Partial`` float64 term of the down projection. Each rank
    used to round its own term to float32 and the terms were summed after (DTensor keeps
    ``Partial`` through a cast): 1e-11 in the loss, 4e-9 in the expert weights. Now the
    sum is reduced in float64 first, rounded once, as one device does."""
    model = qwen3_moe(load_balance_coeff=None)
    mesh, p = plan("qwen3_moe", "experts_tp")
    with float64_grouped_mm():
        res = assert_training_matches(train_step, model, adamw, batches(), mesh, p, atol=1e-12, rtol=1e-10)
    assert res.losses == pytest.approx(res.reference_losses, abs=1e-13, rel=0)
    reasons = [n.meta["spmd_comm"]["reason"] for n in res.sim.expansions[(0,)].collectives()]
    assert any("_to_copy" in r and "cast that rounds" in r for r in reasons), reasons


@pytest.mark.slow
@pytest.mark.parametrize("model_name", list(MODELS))
def test_load_balancing_pre_hook_registered_as_torchtitan_does(model_name):
    """torchtitan's ``register_moe_load_balancing_hook`` on the optimizer (a step pre-hook)
    runs inside the compiled step: EP x FSDP, the expert biases, counters, losses and
    parameters equal to one device's, where the same hook ran eagerly."""
    model = MODELS[model_name]()
    ref, dist_model = copy.deepcopy(model), copy.deepcopy(model)
    ref_opt = register_load_balancing(adamw(ref.parameters()), ref)
    dist_opt = register_load_balancing(adamw(dist_model.parameters()), dist_model)
    assert len(dist_opt._optimizer_step_pre_hooks) == 1
    mesh, p = plan(model_name, "ep_fsdp")
    sim = SimulatedTraining(train_step, dist_model, dist_opt, mesh, p)
    with float64_grouped_mm():
        for batch in batches():
            loss, ref_loss = sim.step(*batch), train_step(ref, ref_opt, *batch)
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-12, rtol=1e-10)
    biases = [n for n, _ in ref.named_buffers() if n.endswith("expert_bias_E")]
    assert biases and all(float(b.abs().sum()) > 0 for n, b in ref.named_buffers() if n in biases)  # the hook moved them
    for (name, a), b in zip(dist_model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda m, n=name: f"buffer {n}: {m}")
    for (name, a), b in zip(dist_model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7, msg=lambda m, n=name: f"parameter {n}: {m}")
    assert _rows_exchanges(sim) == {"forward": 2, "backward": 2}


@pytest.mark.slow
def test_deepseek_v3_671b_routing_ep_fsdp_four_ranks():
    """DeepSeek-V3 671B's router (sigmoid scores, ``route_norm``, ``route_scale``,
    node-limited routing: 4 expert groups, 2 chosen per token) with 8 experts, EP x FSDP on
    4 ranks (2 experts each): equal to one device, rows exchanged, nothing gathered but
    parameters."""
    model = deepseek_v3(num_experts=8, router="671B")
    p = sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=(0,), expert_axes=(0,))
    with float64_grouped_mm():
        res = assert_training_matches(balanced_step, model, adamw, batches(), fake_mesh((4,), ("dp",)), p)
    dist = assert_distributed(res, sharded=_expert_weights(model))
    assert gathered(res, but="FSDP: gather") == [] and _rows_exchanges(res.sim) == {"forward": 2, "backward": 2}, dist.describe()


@pytest.mark.slow
def test_qwen3_moe_as_torchtitan_writes_it_ep_fsdp():
    """The model as torchtitan builds it (float32, experts in bfloat16 through
    ``torch._grouped_mm``'s CPU kernel, no swap): EP x FSDP agrees with one device to
    float32 rounding (each expert computes the same rows in the same bfloat16 matmul)."""
    model = qwen3_moe(float64=False)
    mesh, p = plan("qwen3_moe", "ep_fsdp")
    res = assert_training_matches(balanced_step, model, adamw, batches(), mesh, p, atol=1e-5, rtol=1e-4)
    assert gathered(res, but="FSDP: gather") == [] and _rows_exchanges(res.sim) == {"forward": 2, "backward": 2}
