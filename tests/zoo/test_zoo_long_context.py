"""Long sequences and large vocabularies in the zoo: context parallelism
(``Plan(context_parallel=...)``), loss parallelism (vocab-parallel embedding and output
layer) and both, under 2-D plans, on the torchtitan-style Llama of titan_llama.py, Hugging
Face's LlamaForCausalLM and GPT-2 (tied embeddings): float64 against one device, with
the collectives asserted (no logits gathered, no query gathered, each rank a ``1/cp``
share of the causal attention counted from its program)."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from test_zoo_hf import TOLERANCE, batches as hf_batches, gpt2, llama, megatron_params
from titan_llama import Transformer, batches as titan_batches, tp_params, train_step
from torch.distributed.tensor import Replicate, Shard
from zoo_common import SDPA, adamw, lm_step

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def attention_share(res, seq: int, ranks: int) -> list[float]:
    """Each rank's causal attention work as a share of one device's (score entries per
    batch row and head: ``rows x keys`` per kernel call, a causal square ``rows (rows + 1) / 2``)."""
    whole = seq * (seq + 1) / 2
    shares = []
    for e in res.sim.expansions.values():
        work = 0.0
        for n in e.gm.graph.nodes:
            if n.target is SDPA:
                rows, keys = n.args[0].meta["val"].shape[2], n.args[1].meta["val"].shape[2]
                work += rows * (rows + 1) / 2 if len(n.args) > 4 and n.args[4] else rows * keys
        shares.append(work / whole * ranks)
    return shares


def no_logits_gathered(dist) -> None:
    assert dist.count("all_gather/tp") == 0 and dist.count("reduce_scatter/tp") == 0, dist.describe()


# ------------------------------------------------------------------ torchtitan-style Llama
def titan_vocab_params(ndim: int) -> dict:
    rest = [Replicate()] * (ndim - 1)
    return {**tp_params(ndim), "tok_embeddings.weight": rest + [Shard(0)], "output.weight": rest + [Shard(0)]}


def titan(plan: sc.Plan, mesh, **tolerance):
    torch.manual_seed(0)
    model = Transformer(rope_dtype=torch.float64, n_layers=1).double()
    return assert_training_matches(train_step, model, adamw, titan_batches(2), mesh, plan, atol=1e-10, rtol=1e-8, **tolerance)


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_titan_llama_sequence_over_4_ranks(attention):
    """The issue's 'done when': a causal Llama step (complex rotary embeddings through the
    head-tail layout) with the sequence split 4 ways computes a quarter of the attention on
    every rank and equals one device."""
    plan = sc.Plan(default_input=[Shard(1)], context_parallel=sc.ContextParallel(axis="cp", attention=attention))
    res = titan(plan, fake_mesh((4,), ("cp",)))
    assert all(abs(s - 1) <= 0.05 for s in attention_share(res, 16, 4)), attention_share(res, 16, 4)
    dist = assert_distributed(res, sharded=["batch[0]"])
    assert dist.count("forward/all_gather") == (1 if attention == "allgather" else 0), dist.describe()


def test_titan_llama_context_and_loss_parallel():
    """(cp 2, tp 2): ring attention over cp, Megatron TP with a vocab-parallel embedding
    and output layer over tp."""
    plan = sc.Plan(params=titan_vocab_params(2), default_input=[Shard(1), Replicate()],
                   context_parallel=sc.ContextParallel(axis="cp", attention="ring"))
    res = titan(plan, fake_mesh((2, 2), ("cp", "tp")))
    dist = assert_distributed(res, sharded=["output.weight", "batch[0]"])
    no_logits_gathered(dist)
    assert dist.count("forward/all_gather") == 0 and dist.count("forward/all_to_all/cp") == 1, dist.describe()
    assert all(abs(s - 1) <= 0.05 for s in attention_share(res, 16, 2))


@pytest.mark.slow
def test_titan_llama_3d_fsdp_context_tensor():
    """(dp 2, cp 2, tp 2): FSDP over dp, all-gather attention over cp, TP and loss parallel
    over tp (8 simulated ranks: slow)."""
    plan = sc.Plan(params=titan_vocab_params(3), default_input=[Shard(0), Shard(1), Replicate()],
                   context_parallel=sc.ContextParallel(axis="cp"))
    res = titan(plan, fake_mesh((2, 2, 2), ("dp", "cp", "tp")))
    no_logits_gathered(assert_distributed(res, sharded=["output.weight"]))


@pytest.mark.slow
def test_titan_llama_fsdp_and_context_parallel():
    plan = sc.Plan(params={"*": [Shard(0), Replicate()]}, fsdp_axes=("dp",), default_input=[Shard(0), Shard(1)],
                   context_parallel=sc.ContextParallel(axis="cp"))
    res = titan(plan, fake_mesh((2, 2), ("dp", "cp")))
    assert_distributed(res, sharded=["layers.0.attention.wq.weight", "batch[0]"])


# ------------------------------------------------------------------ Hugging Face
def hf_vocab_params(name: str, ndim: int) -> dict:
    rest = [Replicate()] * (ndim - 1)
    table = {"llama": ["model.embed_tokens.weight", "lm_head.weight"], "gpt2": ["transformer.wte.weight"]}[name]  # GPT-2's head is tied
    return {**megatron_params(name, ndim), **{fqn: rest + [Shard(0)] for fqn in table}}


MODELS = {"llama": llama, "gpt2": gpt2}
PLANS = {
    # name -> (mesh shape and names, plan)
    "cp": (((2, 2), ("dp", "cp")), lambda name: sc.Plan(default_input=[Shard(0), Shard(1)], context_parallel=sc.ContextParallel(axis="cp"))),
    "lp": (((2, 2), ("dp", "tp")), lambda name: sc.Plan(params=hf_vocab_params(name, 2), default_input=[Shard(0), Replicate()])),
    "cp+lp": (((2, 2), ("cp", "tp")), lambda name: sc.Plan(params=hf_vocab_params(name, 2), default_input=[Shard(1), Replicate()],
                                                             context_parallel=sc.ContextParallel(axis="cp", attention="ring"))),
}


@pytest.mark.parametrize("plan_name", [pytest.param(p, marks=() if p == "cp+lp" else pytest.mark.slow) for p in PLANS])
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_long_context(name, plan_name):
    (shape, names), plan = PLANS[plan_name]
    res = assert_training_matches(lm_step, MODELS[name]("sdpa").double(), adamw, hf_batches(2), fake_mesh(shape, names), plan(name),
                                  **TOLERANCE.get(name, {}))
    dist = assert_distributed(res, sharded=["batch[0]"] if plan_name == "cp" else [hf_vocab_params(name, 1).popitem()[0]])
    if "lp" in plan_name:
        no_logits_gathered(dist)
    if "cp" in plan_name:
        assert dist.count("forward/all_gather/cp") <= 1 and dist.count("backward/all_gather/cp") == 0, dist.describe()
        assert all(abs(s - 1) <= 0.05 for s in attention_share(res, 8, 2)), attention_share(res, 8, 2)
