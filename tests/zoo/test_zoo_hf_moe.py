"""Hugging Face mixtures of experts (transformers' own Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE
and DeepSeek-V3, tiny configs, the default ``grouped_mm`` experts, router logits and the
auxiliary loss on) under data parallel, FSDP, expert parallelism (experts split over the
data axis) and EP x FSDP: 3 AdamW steps in float64 against one device, with the tokens
moving only where expert parallelism says (its row exchanges), and the first call
compiling (transformers sets a flag lazily in its first forward).

``torch._grouped_mm`` has no float64 CPU kernel: both sides run inside
``float64_grouped_mm()`` (spmd_compiler.testing.kernels). The models compute their RMSNorm
and their auxiliary loss in float32 on purpose; under data parallel and EP nothing they sum
in float32 changes order, so the tolerance is float64's (1e-9, the cross entropy computed
in float64 by the step, where ``labels=`` would upcast to float32); attention TP (the 2-D
case) sums the heads' projections in another order before a float32 norm: 1e-6.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from torch.distributed.tensor import Replicate, Shard
from zoo_common import adamw

import spmd_compiler as sc
import spmd_compiler._private_torch as pt
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.kernels import float64_grouped_mm

VOCAB, SEQ, BATCH = 32, 8, 4


def _common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=16, bos_token_id=0, eos_token_id=0, output_router_logits=True,
                experts_implementation="grouped_mm", use_cache=False)
    return {**base, **kw}


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01, **_common()))


def qwen2_moe():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.01, **_common()))


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=32, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.01, **_common()))


def olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        intermediate_size=8, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01, **_common()))


def deepseek_v3():
    # grouped routing (2 groups, top 1 group), shared experts, the aux-loss-free bias buffer
    cfg = _common(num_attention_heads=2, num_key_value_heads=2)
    cfg.pop("output_router_logits")
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        intermediate_size=32, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, **cfg))


MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "olmoe": olmoe, "deepseek_v3": deepseek_v3}

PLANS = {
    "dp": lambda: sc.Plan(),
    "fsdp": lambda: sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",)),
    "ep": lambda: sc.Plan(params={"*.experts.*": [Shard(0)]}),
    "ep_fsdp": lambda: sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",), expert_axes=("dp",)),
}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def batches(n: int = 3) -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(n)]


def step(model, opt, ids, labels):
    """Cross entropy in the model's dtype (``labels=`` would compute it in float32, as
    transformers' loss upcasts) plus the router's auxiliary loss, as transformers adds it."""
    out = model(input_ids=ids)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def collectives(res) -> list[tuple[str, str, str]]:
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    return [(n.meta.get("spmd_phase"), str(n.target), n.meta["spmd_comm"]["reason"]) for n in e.collectives()]


def token_moves(res) -> list[str]:
    """Collectives of forward and backward that move activations: everything but FSDP's
    parameter gathers, expert parallelism's exchanges and reductions of a few numbers."""
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    out = []
    for n in e.collectives():
        comm = n.meta["spmd_comm"]
        if n.meta.get("spmd_phase") not in ("forward", "backward") or comm["reason"].startswith(("FSDP", "expert parallelism")):
            continue
        if "all_reduce" in str(n.target) and n.meta["val"].numel() <= 16:
            continue  # the loss, its count, the auxiliary loss's per-expert sums
        out.append(f"{n.meta['spmd_phase']} {comm['kind']} {tuple(n.meta['val'].shape)}: {comm['reason']}")
    return out


def run(model_name: str, plan_name: str, mesh=None, plan=None, **tolerance):
    torch.manual_seed(0)
    model = MODELS[model_name]().double()
    with float64_grouped_mm():
        return assert_training_matches(step, model, adamw, batches(), mesh or fake_mesh((2,), ("dp",)),
                                       plan or PLANS[plan_name](), **tolerance)


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_hf_moe_equals_one_device_and_moves_no_token(model_name, plan_name):
    res = run(model_name, plan_name)
    assert token_moves(res) == [], token_moves(res)
    exchanged = [c for c in collectives(res) if c[1] == str(pt.ALL_TO_ALL_ROWS)]
    if plan_name.startswith("ep"):
        assert len(exchanged) == 4, collectives(res)  # rows to the experts and back, forward and backward
        assert_distributed(res, sharded=[n for n, _ in MODELS[model_name]().named_parameters() if ".experts." in n][:1])
    else:
        assert exchanged == []


def _attention_tp(model_name: str) -> dict:
    """Megatron attention on the second mesh axis: the projections into the heads by
    rows, the output projection by columns (DeepSeek-V3's MLA: the up-projections from
    its low-rank latents; the latents themselves stay replicated)."""
    r = Replicate()
    if model_name == "deepseek_v3":
        return {"*.q_b_proj.weight": [r, Shard(0)], "*.kv_b_proj.weight": [r, Shard(0)], "*.o_proj.weight": [r, Shard(1)]}
    return {"*.q_proj.weight": [r, Shard(0)], "*.k_proj.weight": [r, Shard(0)], "*.v_proj.weight": [r, Shard(0)],
            "*.o_proj.weight": [r, Shard(1)]}


@pytest.mark.parametrize("model_name", list(MODELS))
def test_hf_moe_2d_attention_tp_with_expert_parallel(model_name):
    """(dp, tp): Megatron attention on tp, experts split over dp (4 row exchanges: to the
    experts and back, forward and backward); tokens cross ranks on dp only there. The
    models' norms compute in float32 on purpose (a cast of the float64 activations), so
    TP's other summation order shows at 1e-6."""
    r = Replicate()
    params = {**_attention_tp(model_name), "*.experts.*": [Shard(0), r]}
    res = run(model_name, "2d", fake_mesh((2, 2), ("dp", "tp")), sc.Plan(params=params, default_input=[Shard(0), r]),
              atol=1e-6, rtol=1e-4)
    assert token_moves(res) == [] or all("'tp'" in m for m in token_moves(res)), token_moves(res)
    exchanged = [c for c in collectives(res) if c[1] == str(pt.ALL_TO_ALL_ROWS)]
    assert len(exchanged) == 4, collectives(res)


def test_first_call_compiles_although_transformers_sets_a_flag_lazily():
    """transformers installs its output-capturing hooks in the first forward and sets
    ``_output_capturing_hooks_installed``; a flag created once is no trainer counter."""
    torch.manual_seed(0)
    model = mixtral().double()
    assert not getattr(model.model, "_output_capturing_hooks_installed", False)
    opt = adamw(model.parameters())
    with float64_grouped_mm():
        traced = sc.trace(step, model, opt, *batches(1)[0])
    assert traced.gm is not None and getattr(model.model, "_output_capturing_hooks_installed", False)


def test_grouped_mm_for_cuda_in_float32_names_the_cause_and_the_fix():
    """On CUDA, ``torch._grouped_mm`` takes bfloat16 only: a float32 model compiled on
    ``meta`` for CUDA stops with a message that says so, not torch's shape check."""
    with torch.device("meta"):
        model = mixtral()
    opt = adamw(model.parameters())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="meta")
    with pytest.raises(Exception, match="bfloat16") as info:
        sc.trace(step, model, opt, ids, ids, device_type="cuda")
    assert "experts_implementation" in str(info.value) and "autocast" in str(info.value)


def test_hf_mixtral_experts_tp_splits_the_fused_gate_up_without_gathering_it():
    """Issue #32 item 4: transformers stores Mixtral's gate and up projections as one
    ``gate_up_proj`` [experts, 2 x hidden, dim] and ``chunk``s it; with that fused dim split
    over tp (and ``down_proj``'s hidden dim), each rank keeps its rows of both halves (one
    all_to_all into the pieces' strided layout): no expert weight or its gradient is
    gathered, and the step equals one device."""
    plan = sc.Plan(params={"*.experts.gate_up_proj": [Shard(1)], "*.experts.down_proj": [Shard(2)]}, default_input=[Replicate()])
    res = run("mixtral", "experts_tp", fake_mesh((2,), ("tp",)), plan)
    gathers = [c for c in collectives(res) if "all_gather" in c[1]]
    assert gathers == [], gathers
    assert_distributed(res, sharded=["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"])


def test_hf_mixtral_experts_tp_with_gate_up_stored_by_fused_shard_makes_only_megatrons_all_reduces():
    """``gate_up_proj`` stored by ``fused_shard(1, 2)`` (each rank its block of the gate
    rows and of the up rows, Megatron's fused layout): nothing is re-laid out (the plain
    ``Shard(1)`` above costs an all_to_all of the rows forward, one backward and one of the
    weight's gradient every step); the only collectives are the all_reduces of the
    experts' output and of the input gradient (and of the routing weights' gradient, a
    column, before its float32 cast); equal to one device."""
    plan = sc.Plan(params={"*.experts.gate_up_proj": [sc.fused_shard(1, 2)], "*.experts.down_proj": [Shard(2)]},
                   default_input=[Replicate()])
    res = run("mixtral", "experts_tp", fake_mesh((2,), ("tp",)), plan)
    assert {c[1] for c in collectives(res)} == {"_c10d_functional.all_reduce.default"}, collectives(res)
    assert_distributed(res, sharded=["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"])


@pytest.mark.parametrize("layout", ["shard", "fused_shard"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_hf_moe_expert_parallel_by_experts_tensor_parallel(model_name, layout):
    """EP x TP on (dp 2, tp 2): the stacked experts split by expert over dp (tokens travel
    to them) and by their hidden dim over tp (the fused gate|up rows, as a plain Shard(1)
    or stored by ``fused_shard(1, 2)``, and the down projection's columns, Megatron-style),
    the rest replicated; equal to one device (``run`` asserts it before the collectives
    are checked). With ``fused_shard`` nothing but expert parallelism's rows and counts
    is exchanged."""
    r = Replicate()
    gate_up = Shard(1) if layout == "shard" else sc.fused_shard(1, 2)
    params = {"*.experts.gate_up_proj": [Shard(0), gate_up], "*.experts.down_proj": [Shard(0), Shard(2)]}
    res = run(model_name, "ep_tp", fake_mesh((2, 2), ("dp", "tp")), sc.Plan(params=params, default_input=[Shard(0), r]))
    exchanged = [c for c in collectives(res) if c[1] == str(pt.ALL_TO_ALL_ROWS)]
    assert len(exchanged) == 4, collectives(res)  # rows to the experts and back, forward and backward
    assert [c for c in collectives(res) if "all_gather" in c[1] and "expert" in c[2]] == [], collectives(res)
    if layout == "fused_shard":
        moved = [c for c in collectives(res) if ("all_to_all" in c[1] or "all_gather" in c[1]) and not c[2].startswith("expert parallelism")]
        assert moved == [], moved
