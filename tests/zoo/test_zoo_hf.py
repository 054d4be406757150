"""Hugging Face models (random init from tiny configs, no downloads) under data parallel
and FSDP-style plans, with SDPA and eager attention: 3 steps vs one device."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from torch.distributed.tensor import Replicate, Shard
from zoo_common import SDPA, SDPA_BACKWARD, adamw, attention_collectives, gathered, lm_step, ops_in, run_case

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh

VOCAB, SEQ, BATCH = 32, 8, 4


def gpt2(attn: str) -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, attn_implementation=attn,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def llama(attn: str, **overrides) -> torch.nn.Module:
    # grouped-query attention: 4 query heads share 2 key/value heads
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, attn_implementation=attn, bos_token_id=0, eos_token_id=0, **overrides,
    )
    return transformers.LlamaForCausalLM(cfg)


def bert(attn: str) -> torch.nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=16, attn_implementation=attn, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    return transformers.BertForMaskedLM(cfg)


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def batches(n: int = 3) -> list:
    return [(torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))) for _ in range(n)]


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model(name, attn, plan):
    model = MODELS[name](attn).double()
    res = run_case(lm_step, model, batches(), plan)
    ops = ops_in(res)
    if attn == "sdpa":  # the attention rule ran, with the batch split and no collective
        assert {SDPA, SDPA_BACKWARD} <= ops, "expected SDPA's CPU flash ops in the program"
        assert attention_collectives(res) == []
    else:
        assert SDPA not in ops


@pytest.mark.parametrize(("name", "reentrant", "plan"), [("gpt2", False, "fsdp"), ("llama", True, "dp"), ("gpt2-dropout", False, "dp")])
def test_hf_gradient_checkpointing_trains_as_on_one_device(name, reentrant, plan):
    """The trainer's ``model.gradient_checkpointing_enable()`` (Hugging Face's activation
    checkpointing, reentrant or not): the same numbers as one device, and nothing but
    gradients (dp) or parameters (fsdp) moves. With GPT-2's default dropout, the
    recomputed forward draws the masks the first forward drew, as on one device."""
    model = (gpt2_with_dropout("eager") if name == "gpt2-dropout" else MODELS[name]("sdpa")).double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    assert model.is_gradient_checkpointing
    run_case(lm_step, model, batches(), plan)


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_gpt2_four_ranks(plan):
    res = run_case(lm_step, gpt2("sdpa").double(), batches(), plan, ranks=4)
    assert attention_collectives(res) == []


# ----------------------------------------------------------------------------- TP and 2-D

def megatron_params(name: str, ndim: int) -> dict:
    """Megatron by placement on the last mesh axis: q/k/v and MLP-in split by output
    features, attention-out and MLP-out by input features. GPT-2's Conv1D weights are
    (in, out), so column-parallel is Shard(1) there, and its fused ``c_attn`` gives each
    rank its share of q, of k and of v: ``sc.fused_shard(1, 3)``."""

    def on(p):
        return [Replicate()] * (ndim - 1) + [p]

    if name == "gpt2":
        h = "transformer.h.*."
        return {
            h + "attn.c_attn.weight": on(sc.fused_shard(1, 3)), h + "attn.c_attn.bias": on(sc.fused_shard(0, 3)),
            h + "attn.c_proj.weight": on(Shard(0)), h + "mlp.c_fc.weight": on(Shard(1)), h + "mlp.c_fc.bias": on(Shard(0)),
            h + "mlp.c_proj.weight": on(Shard(0)),
        }
    if name == "llama":
        h = "model.layers.*."
        return {
            h + "self_attn.[qkv]_proj.weight": on(Shard(0)), h + "self_attn.o_proj.weight": on(Shard(1)),
            h + "mlp.gate_proj.weight": on(Shard(0)), h + "mlp.up_proj.weight": on(Shard(0)), h + "mlp.down_proj.weight": on(Shard(1)),
        }
    h = "bert.encoder.layer.*."
    return {
        h + "attention.self.*.weight": on(Shard(0)), h + "attention.self.*.bias": on(Shard(0)),
        h + "attention.output.dense.weight": on(Shard(1)), h + "intermediate.dense.weight": on(Shard(0)),
        h + "intermediate.dense.bias": on(Shard(0)), h + "output.dense.weight": on(Shard(1)),
    }


SHARDED = {"gpt2": "transformer.h.0.attn.c_attn.weight", "llama": "model.layers.0.self_attn.q_proj.weight", "bert": "bert.encoder.layer.0.attention.self.query.weight"}
# LlamaRMSNorm computes in float32 whatever the model's dtype; the TP residual stream,
# all-reduced in another order, can round to a neighbouring float32 there (observed:
# 7e-9 absolute, 5e-7 relative after 3 steps). The other models stay float64 throughout.
TOLERANCE = {"llama": {"atol": 5e-8, "rtol": 5e-6}}


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["tp", "2d"])
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_megatron(name, mesh_shape):
    ndim = len(mesh_shape)
    mesh = fake_mesh(mesh_shape, ("dp", "tp")[-ndim:])
    plan = sc.Plan(params=megatron_params(name, ndim), default_input=[Shard(0), Replicate()] if ndim == 2 else [Replicate()])
    res = assert_training_matches(lm_step, MODELS[name]("sdpa").double(), adamw, batches(), mesh, plan, **TOLERANCE.get(name, {}))
    # Megatron: one tp all_reduce per sub-layer in forward (attention, MLP), no gathers
    dist = assert_distributed(res, sharded=[SHARDED[name]], collectives={"forward/all_reduce/tp": 2, "all_gather": 0})
    assert attention_collectives(res) == []
    heads = {"gpt2": 2, "llama": 4, "bert": 2}[name]
    step = res.sim.expansions[next(iter(res.sim.expansions))]
    (fwd,) = [n for n in step.gm.graph.nodes if n.target is SDPA]
    assert fwd.args[0].meta["val"].shape[1] == heads // 2, dist.describe()  # heads split over tp


def test_llama_without_cache_dp_without_gathers():
    """use_cache=False: create_causal_mask indexes the batch-shaped packed-sequence mask by
    ``arange(batch)[:, None, None, None]``; each rank takes its own rows at local numbers
    (expand/rules/indexing.py, uneven splits in tests/test_expand_indexing.py) instead of
    gathering the batch."""
    res = run_case(lm_step, llama("sdpa", use_cache=False).double(), batches(), "dp")
    assert torch.ops.aten.index.Tensor in ops_in(res)  # the mask still indexes, locally


# ----------------------------------------------------------------------------- dropout on


def gpt2_with_dropout(attn: str) -> torch.nn.Module:
    """GPT-2 as Hugging Face configures it by default: dropout 0.1 on embeddings,
    residuals and attention probabilities (SDPA: inside the attention kernel)."""
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, attn_implementation=attn,
                                  bos_token_id=0, eos_token_id=0)
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.1
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("plan", ["dp", "tp"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_with_dropout_equals_one_device(attn, plan):
    """The RNG contract on third-party code: every dropout mask is the one device's
    (docs/randomness.md), so training with dropout on matches one device under DP and
    Megatron TP (replicated residual-stream dropout and head-sharded attention dropout)."""
    torch.manual_seed(0)
    model = gpt2_with_dropout(attn).double()
    if plan == "dp":
        mesh, p, sharded = fake_mesh((2,), ("dp",)), sc.Plan(), "batch[0]"
    else:
        mesh, p, sharded = fake_mesh((2,), ("tp",)), sc.Plan(params=megatron_params("gpt2", 1), default_input=[Replicate()]), SHARDED["gpt2"]
    res = assert_training_matches(lm_step, model, adamw, batches(), mesh, p)
    assert_distributed(res, sharded=[sharded], collectives=1)
    draws = [n for n in res.sim.expansions[(0,)].gm.graph.nodes if getattr(n.target, "_nondeterministic_seeded", False)]
    assert len(draws) >= 3  # embedding, attention and residual dropouts all draw


# ----------------------------------------------------------------------------- buffers named sharded


@pytest.mark.parametrize("ranks", [2, 4])
def test_llama_rotary_buffer_named_sharded_under_fsdp_is_gathered_with_its_unit(ranks):
    """A buffer the FSDP plan names sharded (``"model.rotary_emb.inv_freq": [Shard(0)]``)
    is stored sharded and gathered for use like a parameter, in its unit's gather, equal
    to one device; not the rotary cos/sin activations gathered at each of their uses (what
    it cost before: two activation gathers per step). Its unit is the root, whose forward
    gather is kept for backward (as fully_shard keeps its root): one gather per step. The
    model reads it as ``inv_freq.float()``: the cast is made on the shard before the
    gather (half the bytes of the float64 buffer), so it travels in its own float32
    gather, once per step, beside the root's float64 parameters."""
    model = llama("sdpa").double()
    plan = sc.Plan(params={"*": [Shard(0)], "model.rotary_emb.inv_freq": [Shard(0)]}, default_input=[Shard(0)], fsdp_axes=("dp",))
    res = assert_training_matches(lm_step, model, adamw, batches(), fake_mesh((ranks,), ("dp",)), plan)
    dist = assert_distributed(res, sharded=["model.rotary_emb.inv_freq", "batch[0]"])
    assert gathered(res, but="FSDP: gather") == [], dist.describe()  # no activation is gathered
    root = [r for r in gathered(res) if r.endswith("unit <root> in one collective")]
    # forward only: embedding, final norm, lm head, kept for backward; inv_freq cast on its shard, gathered once
    assert len(root) == ranks and all("3 parameters of unit" in r for r in root), root
    buffer = [r for r in gathered(res) if "inv_freq" in r]
    assert len(buffer) == ranks and all(r.endswith("for forward: S(0)->R on 'dp'") for r in buffer), buffer
