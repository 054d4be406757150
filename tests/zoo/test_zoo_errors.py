"""Common user mistakes against a third-party model (Hugging Face GPT-2, tiny config):
each gives our error (ValueError/TypeError naming what was expected, what was received
and a fix), never a bare torch message; what is allowed (an optimizer built after the
model is distributed, a batch the mesh does not divide) trains as on one device."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from test_zoo_hf import SEQ, VOCAB, gpt2
from torch.distributed.tensor import DTensor, Replicate, Shard
from zoo_common import adamw, lm_step

import spmd_compiler as sc
from spmd_compiler.testing import SimulatedTraining, assert_training_matches, fake_mesh


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def batch(rows: int, target_rows: int | None = None) -> tuple:
    return torch.randint(0, VOCAB, (rows, SEQ)), torch.randint(0, VOCAB, (target_rows or rows, SEQ))


def simulate(plan: sc.Plan, *b) -> None:
    model = gpt2("sdpa").double()
    SimulatedTraining(lm_step, model, adamw(model.parameters()), fake_mesh((2,), ("dp",)), plan).step(*b)


BAD_PLANS = {
    "misspelled parameter": (
        sc.Plan(params={"transformer.h.0.attn.c_atn.weight": [Shard(0)]}), ValueError,
        [r"'transformer.h.0.attn.c_atn.weight' names no parameter or buffer", r"Did you mean 'transformer.h.0.attn.c_attn.weight'", "fix:"],
    ),
    "shard dim out of range": (
        sc.Plan(params={"transformer.h.0.attn.c_attn.bias": [Shard(1)]}, default_input=[Replicate()]), ValueError,
        [r"c_attn.bias \(shape \[48\]\)", r"Shard\(1\) on mesh axis 0 is out of range for a 1-d tensor", r"expected a dim in \[0, 0\]", "fix:"],
    ),
    "batch shard dim out of range": (
        sc.Plan(default_input=[Shard(2)]), ValueError, [r"batch\[0\] \(shape \[4, 8\]\)", "out of range for a 2-d tensor", "fix:"],
    ),
    "placement as a string": (
        sc.Plan(params={"transformer.wte.weight": ["Shard(0)"]}), TypeError, ["is not a Placement", "fix:"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plan_on_gpt2_is_our_error(case):
    plan, error, patterns = BAD_PLANS[case]
    with pytest.raises(error) as info:
        simulate(plan, *batch(4))
    for p in patterns:
        assert re.search(p, str(info.value)), (p, str(info.value))


def test_inputs_and_targets_of_different_lengths_name_the_batch_dims():
    """cross_entropy refuses 4 rows of logits against 6 of targets (as on one device);
    torch's message speaks of the trace's size symbols (``8*s60``), ours adds which batch
    dim each symbol is, the step's line and a fix."""
    with pytest.raises(ValueError) as info:
        simulate(sc.Plan(), *batch(4, 6))
    text = str(info.value)
    assert "Expected input batch_size" in text  # torch's own words stay
    assert "batch[0].size(0) = 4" in text and "batch[1].size(0) = 6" in text, text
    assert "zoo_common.py" in text and "cross_entropy" in text and "fix:" in text, text


def test_optimizer_built_after_the_model_is_distributed():
    """compile() distributes the model at the first call; an optimizer built afterwards
    (over the DTensor parameters) is used as it is; one over another model's parameters
    is refused before anything is distributed."""
    mesh = fake_mesh((2,), ("dp",))
    model = gpt2("sdpa").double()
    step = sc.compile(lm_step, mesh=mesh)
    step(model, adamw(model.parameters()), *batch(2))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    later = adamw(model.parameters())
    loss = step(model, later, *batch(2))
    assert torch.isfinite(loss.full_tensor() if isinstance(loss, DTensor) else loss)
    assert all(isinstance(s["exp_avg"], DTensor) for s in later.state.values())

    fresh, other = gpt2("sdpa").double(), gpt2("sdpa").double()
    with pytest.raises(ValueError, match=r"is not a parameter of the model.*fix:"):
        sc.compile(lm_step, mesh=mesh)(fresh, adamw(other.parameters()), *batch(2))
    assert not any(isinstance(p, DTensor) for p in fresh.parameters())


def test_batch_the_mesh_does_not_divide_trains_as_on_one_device():
    """3 rows on 4 ranks (shards 1, 1, 1, 0): no error to give, the uneven split is exact."""
    model = gpt2("sdpa").double()
    assert_training_matches(lm_step, copy.deepcopy(model), adamw, [batch(3), batch(5)], fake_mesh((4,), ("dp",)), sc.Plan())


@pytest.mark.parametrize("plan", ["dp", "vocab_sharded"])
def test_token_id_out_of_the_vocabulary_names_the_embedding(plan):
    """A token id >= vocab_size (a tokenizer larger than the model): one device raises
    IndexError, a vocab-sharded table would mask it out silently; ours names GPT-2's
    ``wte``, the ids' range, the line in transformers that embeds them and a fix."""
    model = gpt2("sdpa")
    plan = sc.Plan(params={"transformer.wte.weight": [Shard(0)]}) if plan == "vocab_sharded" else sc.Plan()
    ids, targets = batch(4)
    ids[2, 3] = VOCAB + 5
    one = copy.deepcopy(model)
    with pytest.raises(IndexError):  # one device
        lm_step(one, adamw(one.parameters()), ids, targets)
    step = sc.compile(lm_step, mesh=fake_mesh((2,), ("dp",)), plan=plan)
    with pytest.raises(ValueError) as info:
        step(model, adamw(model.parameters()), ids, targets)
    text = str(info.value)
    assert f"token ids out of range for the Embedding 'transformer.wte' (table transformer.wte.weight with {VOCAB} rows)" in text, text
    assert "batch[0] holds ids from " in text and f" to {VOCAB + 5} " in text, text
    assert "modeling_gpt2.py" in text and "self.wte(" in text and f"fix: keep the ids below num_embeddings={VOCAB}" in text, text


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_a_later_out_of_vocabulary_id_on_a_vocab_parallel_wte_is_refused(bad):
    """GPT-2's ``wte`` vocab-sharded with the batch replicated (a masked embedding: a bad
    id would be a zero row): a later batch is checked before the cached program runs."""
    model = gpt2("sdpa")
    opt = adamw(model.parameters())
    step = sc.compile(lm_step, mesh=fake_mesh((2,), ("tp",)),
                      plan=sc.Plan(params={"transformer.wte.weight": [Shard(0)]}, default_input=[Replicate()]))
    step(model, opt, *batch(4))
    ids, targets = batch(4)
    ids[1, 5] = bad
    with pytest.raises(ValueError) as info:
        step(model, opt, ids, targets)
    text = str(info.value)
    assert f"(table transformer.wte.weight with {VOCAB} rows)" in text and f"(e.g. {bad} at " in text, text
    assert "[1, 5]" in text and "self.wte(" in text and step.compiles == 1, text
