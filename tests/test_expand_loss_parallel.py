"""Loss parallel (spmd_compiler/expand/rules/loss_parallel.py): log-softmax, cross entropy
and the embedding gradient on logits and tables split by class/vocab entry move no
logits (two all_reduces of one value per row in forward, one in backward), equal to one
device in float64; and a vocab-parallel Llama trains as Megatron does (the guard of
expand/guards.py: a Partial gradient is reduced before a matmul, not the activations
gathered)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_spmd_matches, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import GPT

aten = torch.ops.aten


def _kinds(run) -> list[str]:
    step = next(iter(run.steps.values()))
    return [f"{n.meta['spmd_phase']}/{n.meta['spmd_comm']['kind']}" for n in step.collectives()]


def _loss_and_grad(**options):
    def fn(x, t, *weight):
        with torch.enable_grad():  # the single-device reference runs under no_grad
            x = x.detach().requires_grad_(True)
            loss = F.cross_entropy(x.float() if x.dtype == torch.float16 else x, t, weight=weight[0] if weight else None, **options)
            loss.sum().backward()
        return loss.detach(), x.grad

    return fn


CASES = {
    "mean": {},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "ignore_index": {"ignore_index": 3},  # a class some rank owns: ignored, not picked
    "label_smoothing": {"label_smoothing": 0.1, "ignore_index": -100},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("classes", [12, 11])  # 11 over 4 ranks: 3, 3, 3, 2
def test_cross_entropy_over_split_classes(case, classes):
    logits = torch.randn(10, classes, dtype=torch.float64)
    target = torch.randint(0, classes, (10,))
    target[:3] = CASES[case].get("ignore_index", 0) if "ignore_index" in CASES[case] else target[:3]
    if case == "label_smoothing":
        target[:2] = -100
    run = assert_spmd_matches(_loss_and_grad(**CASES[case]), [logits, target], fake_mesh((4,), ("tp",)), [[Shard(1)], [Replicate()]],
                              atol=1e-12, rtol=1e-10)
    kinds = _kinds(run)
    assert not any("all_gather" in k or "reduce_scatter" in k for k in kinds), kinds
    # the row max and the row sum of exp in forward; the gradient's row sum in backward
    assert kinds.count("forward/all_reduce") >= 2 and kinds.count("backward/all_reduce") == 1, kinds
    step = next(iter(run.steps.values()))
    (lsm,) = [n for n in step.gm.graph.nodes if n.target is aten.exp.default and n.meta.get("spmd_origin", {}).get("op") == "aten._log_softmax.default"]
    assert lsm.meta["val"].shape[1] == 3  # this rank's classes only


def test_class_weights_and_2d_mesh():
    """Rows split over dp, classes over tp, class weights narrowed to each rank's classes."""
    logits = torch.randn(8, 12, dtype=torch.float64)
    target = torch.randint(0, 12, (8,))
    target[1] = -100
    weight = torch.rand(12, dtype=torch.float64) + 0.5
    run = assert_spmd_matches(_loss_and_grad(), [logits, target, weight], fake_mesh((2, 2), ("dp", "tp")),
                              [[Shard(0), Shard(1)], [Shard(0), Replicate()], [Replicate(), Replicate()]], atol=1e-12, rtol=1e-10)
    assert not any("all_gather" in k for k in _kinds(run)), _kinds(run)


def test_hugging_face_float32_upcast():
    logits = torch.randn(6, 8).half()
    target = torch.randint(0, 8, (6,))
    run = assert_spmd_matches(_loss_and_grad(), [logits, target], fake_mesh((2,), ("tp",)), [[Shard(1)], [Replicate()]], atol=1e-6)
    assert not any("all_gather" in k for k in _kinds(run)), _kinds(run)


def _llama():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "zoo"))
    import titan_llama

    return titan_llama


def vocab_params(ndim: int) -> dict:
    """torchtitan's plan with a vocab-parallel embedding and output layer (Shard(0) of both)."""
    llama = _llama()
    rest = [Replicate()] * (ndim - 1)
    return {**llama.tp_params(ndim), "tok_embeddings.weight": rest + [Shard(0)], "output.weight": rest + [Shard(0)]}


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_vocab_parallel_llama_moves_no_logits(mesh_shape):
    """Megatron's collectives: in forward the embedding's all_reduce, one per attention
    and feed-forward, the loss's two per-row values; in backward the loss's one, one per
    sub-layer (fused in pairs where independent) and the embedding gradient's rows. No
    gather, no reduce_scatter on tp; the table's gradient is this rank's rows."""
    llama = _llama()
    names = ("dp", "tp")[-len(mesh_shape):]
    torch.manual_seed(0)
    model = llama.Transformer(rope_dtype=torch.float64, n_layers=1).double()
    plan = sc.Plan(params=vocab_params(len(mesh_shape)), default_input=[Shard(0), Replicate()][-len(mesh_shape):])
    res = assert_training_matches(llama.train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), llama.batches(2),
                                  fake_mesh(mesh_shape, names), plan, atol=1e-10, rtol=1e-8)
    dist = assert_distributed(res, sharded=["output.weight", "tok_embeddings.weight"])
    assert dist.count("all_gather/tp") == 0 and dist.count("reduce_scatter/tp") == 0, dist.describe()
    assert dist.count("forward/all_reduce/tp") == 5 and dist.count("backward/all_reduce/tp") == 4, dist.describe()
    step = next(iter(res.sim.expansions.values()))
    (table,) = [n for n in step.gm.graph.nodes if n.target is aten.embedding_dense_backward.default]
    assert table.meta["val"].shape[0] == llama.VOCAB // 2 + 1  # its rows and the dropped one


def test_tied_embeddings():
    """GPT with the output layer tied to the token embedding, both vocab-parallel."""
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1, tie_embeddings=True).double()
    from spmd_compiler.testing.models import _tp_params, train_step

    plan = sc.Plan(params={**_tp_params(1, 0), "tok.weight": [Shard(0)]}, default_input=[Replicate()])
    batches = [(torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))) for _ in range(2)]
    res = assert_training_matches(train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), batches, fake_mesh((2,), ("tp",)), plan)
    dist = assert_distributed(res, sharded=["tok.weight"])
    assert dist.count("all_gather") == 0 and dist.count("reduce_scatter") == 0, dist.describe()
    step = next(iter(res.sim.expansions.values()))
    tables = [n.meta["val"].shape[0] for n in step.gm.graph.nodes if n.target is aten.embedding_dense_backward.default]
    assert sorted(tables) == [8, 32 // 2 + 1], tables  # positions (whole); the tied table's term: this rank's rows
