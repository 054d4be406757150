"""What trainers do, under ``dynamic=True`` (docs/dynamic_shapes.md), on Hugging Face
models in the simulator with a data parallel plan: a partial last batch, gradient
accumulation over calls, dropout on. Every case equals one device (float64, 1e-10;
with dropout the RNG contract's bit-exact draws, docs/randomness.md); a model either
keeps one program for every batch size or falls back to one per shape with one INFO
line naming the op and the model's source line."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_zoo_hf import SEQ, TOLERANCE, VOCAB, bert, gpt2, gpt2_with_dropout, llama, megatron_params
from torch.distributed.tensor import Replicate, Shard
from zoo_common import adamw, lm_step

import spmd_compiler as sc
from spmd_compiler.testing import assert_training_matches, fake_mesh

TIGHT = {"atol": 1e-10, "rtol": 1e-10}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def sized(sizes: list[int]) -> list:
    return [(torch.randint(0, VOCAB, (b, SEQ)), torch.randint(0, VOCAB, (b, SEQ))) for b in sizes]


def fallbacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "spmd_compiler.driver.dynamic" and r.levelno == logging.INFO]


def shape_compiles(res) -> list[str]:
    """The compiles a batch size caused (a new shape, or a broken size guard)."""
    return [r for r in res.sim.reasons if "shape" in r or "size guard" in r]


MODELS = {
    "gpt2": lambda: gpt2("sdpa"),
    "llama": lambda: llama("sdpa"),
    "gpt2-eager": lambda: gpt2("eager"),  # create_causal_mask expands a mask to the batch
    "bert": lambda: bert("sdpa"),  # expands its token_type_ids buffer to (batch, seq)
    "bert-eager": lambda: bert("eager"),
}


@pytest.mark.parametrize("name", [m for m in MODELS if m != "gpt2"])  # gpt2: the uneven first call below
def test_partial_last_batch_one_program(name, caplog):
    """Sizes 8, 8, 5, 3 on 2 ranks (odd sizes: uneven shards): the program of the first
    step serves every size: one compile (the optimizer state is created before it)."""
    caplog.set_level(logging.INFO, logger="spmd_compiler.driver.dynamic")
    model = MODELS[name]().double()
    res = assert_training_matches(lm_step, model, adamw, sized([8, 8, 5, 3]), fake_mesh((2,), ("dp",)), sc.Plan(), dynamic=True, **TIGHT)
    assert_one_distributed_program(res, caplog)


def assert_one_distributed_program(res, caplog) -> None:
    """One compile (the optimizer state is created before the first trace), none for a batch size, no
    fallback; the batch is a run-time size, arrives split, and gradients are all-reduced."""
    assert res.sim.compiles == 1 and shape_compiles(res) == [], res.sim.reasons
    assert fallbacks(caplog) == []
    assert res.sim.expansions[(0,)].size_symbols  # the batch is a run-time size
    # distributed: the batch arrives split, gradients are all-reduced (assert_distributed
    # checks concrete local shapes only, not yet the size_* inputs of a symbolic program)
    step = res.sim.expansions[(0,)]
    batch = [s for i, s in zip(step.traced.inputs, step.input_specs) if i.kind == "batch"]
    assert all(s.placements[0].is_shard(0) for s in batch), batch
    assert any("all_reduce" in str(n.target) for n in step.collectives())


def test_partial_last_batch_uneven_first_call_same_graph_on_every_rank(caplog):
    """GPT-2 (SDPA) with a partial last batch, the first call of an odd size (5 on 2 ranks):
    each rank's program must still be the same graph (the view of the local batch sized by
    the coordinate symbol, not this rank's number); the program of the second call (8)
    then serves the odd size 3 and the even 2, as test_partial_last_batch_one_program
    checks for the other models."""
    caplog.set_level(logging.INFO, logger="spmd_compiler.driver.dynamic")
    res = assert_training_matches(lm_step, gpt2("sdpa").double(), adamw, sized([5, 8, 3, 2]), fake_mesh((2,), ("dp",)), sc.Plan(), dynamic=True, **TIGHT)
    assert_one_distributed_program(res, caplog)


def accumulating_lm_step(model, optimizer, ids, targets, do_step):
    """Gradient accumulation over calls, the usual loop body."""
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    if do_step:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def test_gradient_accumulation_with_partial_batches_one_program_per_call_kind():
    """Two calls per optimizer step, batch sizes 8, 5, 3, 8: gradients accumulate
    as on one device, and the batch sizes cause no compile (programs differ only by
    whether gradients come in and whether the step updates)."""
    sizes = [8, 5, 3, 8]
    batches = [(*b, i % 2 == 1) for i, b in enumerate(sized(sizes))]
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731  (update proportional to the gradient)
    res = assert_training_matches(accumulating_lm_step, gpt2("sdpa").double(), sgd, batches, fake_mesh((2,), ("dp",)), sc.Plan(), dynamic=True, **TIGHT)
    assert shape_compiles(res) == [], res.sim.reasons
    assert res.sim.expansions[(0,)].size_symbols


def test_dropout_with_partial_last_batch_equals_one_device(caplog):
    """Dropout on (Hugging Face's default 0.1) with sizes 8 then 5: every mask is the one
    device's (rng="exact"), whether the program is symbolic or compiled per shape."""
    caplog.set_level(logging.INFO, logger="spmd_compiler.driver.dynamic")
    torch.manual_seed(0)
    res = assert_training_matches(lm_step, gpt2_with_dropout("sdpa").double(), adamw, sized([8, 5]), fake_mesh((2,), ("dp",)), sc.Plan(), dynamic=True, **TIGHT)
    draws = [n for n in res.sim.expansions[(0,)].gm.graph.nodes if getattr(n.target, "_nondeterministic_seeded", False)]
    assert len(draws) >= 3
    assert res.sim.compiles == 1 and shape_compiles(res) == [] and not fallbacks(caplog), res.sim.reasons  # one program


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["tp", "2d"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_megatron_partial_last_batch_one_program_without_gathers(name, mesh_shape, caplog):
    """Megatron TP (the batch replicated over tp, its size a symbol all the same) and DP x
    TP on 2 x 2, sizes 4, 3, 5, 1: one program, and no gather that the per-shape program
    would not make (it makes none). GPT-2's ``Conv1D`` flattens the batch with
    ``x.view(-1, D)`` and views its fused qkv (strided over tp) back to ``(B, T, 3D)``."""
    caplog.set_level(logging.WARNING, logger="spmd_compiler.expand.dispatch")
    ndim = len(mesh_shape)
    plan = sc.Plan(params=megatron_params(name, ndim), default_input=[Shard(0), Replicate()] if ndim == 2 else [Replicate()])
    res = assert_training_matches(lm_step, MODELS[name]().double(), adamw, sized([4, 3, 5, 1]), fake_mesh(mesh_shape, ("dp", "tp")[-ndim:]),
                                  plan, dynamic=True, **TOLERANCE.get(name, TIGHT))
    assert res.sim.compiles == 1 and shape_compiles(res) == [], res.sim.reasons
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # no fallback gather
    step = res.sim.expansions[(0,) * ndim]
    assert step.size_symbols
    kinds = [n.meta["spmd_comm"]["kind"] for n in step.gm.graph.nodes if "spmd_comm" in n.meta]
    assert "all_gather" not in kinds and "all_reduce" in kinds, kinds


def hf_labels_step(model, optimizer, ids, mask, labels):
    """What a Hugging Face trainer does: the model's own loss from ``labels`` (padded
    positions ``-100``; GPT-2 and Llama pad the labels and shift them), an attention mask
    for the right padding, gradient clipping, AdamW."""
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return out.loss


def padded(sizes: list[int]) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for b in sizes:
        ids = torch.randint(1, VOCAB, (b, SEQ), generator=g)
        lengths = torch.randint(2, SEQ + 1, (b,), generator=g)
        mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
        out.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return out


# the models' loss casts the logits to float32 (``logits.float()``): float32 rounding
HF_LOSS = {"atol": 1e-6, "rtol": 1e-6}


# GPT-2 on 3 ranks (uneven shards), eager attention (the transposed key's view), Llama
# under FSDP; ad hoc the same passed for GPT-2 dp/fsdp on 2 ranks, Llama dp, BERT
@pytest.mark.parametrize("name,plan,ranks", [("gpt2", "dp", 3), ("gpt2-eager", "dp", 2), ("llama", "fsdp", 2)])
def test_model_loss_with_labels_and_padding_mask_one_program(name, plan, ranks, caplog):
    """``model(input_ids, attention_mask, labels).loss`` with a partial last batch: one
    program for sizes 8, 8, 5, 3 and no gather. Before, three things each made it one
    program per shape or gathered: the loss pads the labels (``constant_pad_nd``, whose
    size kernel pinned the batch size); GPT-2 views the mask by the ids' batch size (two
    batch symbols, one divided by the other); the padding mask indexes the mask with an
    ``arange`` of the batch (its offset asked whether the size splits evenly); eager
    attention views a transposed key (a strided layout the view rule refused)."""
    caplog.set_level(logging.INFO, logger="spmd_compiler")
    model = MODELS[name]().double()
    p = sc.Plan() if plan == "dp" else sc.Plan(params={"*": [Shard(0)]}, default_input=[Shard(0)], fsdp_axes=(0,))
    res = assert_training_matches(hf_labels_step, model, adamw, padded([8, 8, 5, 3]), fake_mesh((ranks,), ("dp",)), p, dynamic=True, **HF_LOSS)
    assert res.sim.compiles == 1 and shape_compiles(res) == [], res.sim.reasons
    assert fallbacks(caplog) == [] and [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    step = res.sim.expansions[(0,)]
    assert len(step.size_symbols) == 1  # ids, mask and labels: one batch size
    assert not [n for n in step.gm.graph.nodes if n.meta.get("spmd_comm", {}).get("kind") == "all_gather"
                and not n.meta["spmd_comm"].get("reason", "").startswith("FSDP")]
