"""Hugging Face models (random init from tiny configs, no downloads) under data parallel
and FSDP-style plans, with SDPA and eager attention: 3 steps vs one device."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from zoo_common import SDPA, SDPA_BACKWARD, attention_collectives, lm_step, ops_in, run_case

VOCAB, SEQ, BATCH = 32, 8, 4


def gpt2(attn: str) -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, attn_implementation=attn,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def llama(attn: str) -> torch.nn.Module:
    # grouped-query attention: 4 query heads share 2 key/value heads
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, attn_implementation=attn, bos_token_id=0, eos_token_id=0, use_cache=False,
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


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_gpt2_four_ranks(plan):
    res = run_case(lm_step, gpt2("sdpa").double(), batches(), plan, ranks=4)
    assert attention_collectives(res) == []
