"""Error messages: what was expected, what came, the node, the user's line, a fix."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches


class RenormModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.renorm(x @ self.w, p=2, dim=0, maxnorm=1.0)  # no DTensor sharding strategy


def step(model, optimizer, x):
    loss = model(x).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_unsupported_op_error_names_op_placements_node_and_line(mesh4):
    model = RenormModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    traced = sc.trace(step, model, opt, torch.randn(8, 4))
    with pytest.raises(sc.UnsupportedOpError) as info:
        sc.expand(traced, mesh4, fallback="error")
    msg = str(info.value)
    assert "aten.renorm.default" in msg
    assert "S(0) [8, 4]" in msg  # the input's placement and global shape
    assert "graph node: %renorm" in msg
    assert "test_errors.py" in msg and "torch.renorm" in msg  # the user's source line
    assert "fix:" in msg
    assert info.value.op is torch.ops.aten.renorm.default


def test_replicate_fallback_warns_once_and_matches(mesh4, caplog):
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"):
        res = assert_training_matches(
            step, RenormModel().double(), lambda p: torch.optim.SGD(p, lr=0.1),
            [(torch.randn(8, 4, dtype=torch.float64),) for _ in range(2)], mesh4,
        )
    warnings = [r for r in caplog.records if "renorm" in r.getMessage()]
    assert len(warnings) == 1  # once per op, not per node or step
    assert any("replicate fallback" in n.meta["spmd_comm"]["reason"] for n in res.sim.expansions[(0,)].collectives())
    assert_distributed(res, sharded=["batch[0]"], collectives={"forward/all_gather/dp": 1})  # the fallback's gather


def test_fallback_option_is_validated(mesh4):
    model = RenormModel()
    traced = sc.trace(step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 4))
    with pytest.raises(ValueError, match="fallback must be"):
        sc.expand(traced, mesh4, fallback="ignore")


def test_batch_argument_must_be_tensor_pytree():
    model = RenormModel()
    with pytest.raises(TypeError, match=r"batch argument batch\[0\] is a object"):
        sc.trace(step, model, None, object())


def test_optimizer_with_foreign_parameter():
    model = RenormModel()
    other = nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([*model.parameters(), other], lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(3,\)\) is not a parameter of the model"):
        sc.trace(step, model, opt, torch.randn(8, 4))


# ---------------------------------------------------------------- odd user plans (issue #19)
from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402

from spmd_compiler.errors import add_context  # noqa: E402
from spmd_compiler.testing.models import GPT, MLP, mse_train_step, train_step  # noqa: E402


def _mlp_traced():
    model = MLP(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return sc.trace(mse_train_step, model, opt, torch.randn(8, 8), torch.randn(8, 8))


# plan -> (exception type, what the message must name: the value, its placements as
# written, and the way out)
BAD_PLANS = {
    "shard dim past ndim": (
        lambda: sc.Plan(params={"l1.weight": [Shard(2), Replicate()]}), ValueError,
        ["l1.weight", "[Shard(dim=2), Replicate()]", "out of range for a 2-d tensor", "fix:"],
    ),
    "Shard(1) on a 1-D bias": (
        lambda: sc.Plan(params={"l1.bias": [Shard(1), Replicate()]}), ValueError,
        ["l1.bias", "[Shard(dim=1), Replicate()]", "1-d tensor", "fix:"],
    ),
    "[Shard(0), Shard(1)] on biases": (
        lambda: sc.Plan(params={"*.bias": [Shard(0), Shard(1)]}), ValueError,
        ["l1.bias", "[Shard(dim=0), Shard(dim=1)]", "plan['*.bias']", "mesh axis 1", "fix:"],
    ),
    "Partial() for a parameter": (
        lambda: sc.Plan(params={"l1.weight": [Partial(), Replicate()]}), ValueError,
        ["l1.weight", "[Partial(sum), Replicate()]", "only meaningful for batch inputs", "fix:"],
    ),
    "Partial('max') for every parameter": (
        lambda: sc.Plan(params={"*": [Replicate(), Partial("max")]}), ValueError,
        ["l1.weight", "[Replicate(), Partial(max)]", "plan['*']", "fix:"],
    ),
    "exact key that matches nothing (strict)": (
        lambda: sc.Plan(params={"l3.weight": [Shard(0), Replicate()]}), ValueError,
        ["'l3.weight'", "[Shard(dim=0), Replicate()]", "Did you mean", "strict=False", "fix:"],
    ),
    "pattern that matches nothing (strict)": (
        lambda: sc.Plan(params={"encoder.*": [Shard(0), Replicate()]}), ValueError,
        ["'encoder.*'", "[Shard(dim=0), Replicate()]", "strict=False", "fix:"],
    ),
    "one placement for a 2-D mesh": (
        lambda: sc.Plan(params={"l1.weight": Shard(0)}), ValueError,
        ["'l1.weight'", "Shard(dim=0)", "2-D mesh", "fix:"],
    ),
    "too few placements": (
        lambda: sc.Plan(params={"l1.weight": [Shard(0)]}), ValueError,
        ["'l1.weight'", "[Shard(dim=0)]", "mesh with 2 axes", "fix:"],
    ),
    "a string for a placement": (
        lambda: sc.Plan(params={"l1.weight": ["Shard(0)", Replicate()]}), TypeError,
        ["'l1.weight'", "'Shard(0)'", "not a Placement", "fix:"],
    ),
    "batch shard dim past ndim": (
        lambda: sc.Plan(inputs=[[Shard(3), Replicate()]]), ValueError,
        ["batch[0]", "[Shard(dim=3), Replicate()]", "Plan(inputs=", "fix:"],
    ),
    "unknown fsdp axis": (
        lambda: sc.Plan(params={"*": [Shard(0), Replicate()]}, fsdp_axes=("pp",)), ValueError,
        ["'pp'", "['dp', 'tp']", "fix:"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plan_names_value_placements_and_fix(mesh2x2, case):
    make_plan, exc, expected = BAD_PLANS[case]
    traced = _mlp_traced()
    with pytest.raises(exc) as info:
        sc.expand(traced, mesh2x2, make_plan())
    msg = str(info.value)
    for text in expected:
        assert text in msg, f"{text!r} missing from: {msg}"
    assert "bug" not in msg


def _mlp_run(plan, dim=8, hidden=16):
    model = MLP(dim, hidden).double()
    batches = [(torch.randn(8, dim, dtype=torch.float64), torch.randn(8, dim, dtype=torch.float64)) for _ in range(2)]
    return mse_train_step, model, batches, plan


def _gpt_run(plan, vocab=32, seq=8, dim=16):
    model = GPT(vocab=vocab, seq=seq, dim=dim, heads=2, layers=1).double()
    batches = [(torch.randint(0, vocab, (4, seq)), torch.randint(0, vocab, (4, seq))) for _ in range(2)]
    return train_step, model, batches, plan


# odd but legal plans: they compile and train as on one device
GOOD_PLANS = {
    # reached "a MaskPartial value lost its mask; this is a bug": the position embedding
    # [Shard(0), Shard(0)] splits its rows over both axes (indices masked on each)
    "GPT, every parameter [Shard(0), Shard(0)]": lambda: _gpt_run(sc.Plan(params={"*": [Shard(0), Shard(0)]})),
    "GPT, [Shard(0), Shard(0)] with uneven rows": lambda: _gpt_run(sc.Plan(params={"*": [Shard(0), Shard(0)]}), vocab=30, seq=6, dim=12),
    "GPT, [Shard(-1), Shard(-1)]": lambda: _gpt_run(sc.Plan(params={"*": [Shard(-1), Shard(-1)]})),
    "MLP, every parameter [Shard(0), Shard(0)]": lambda: _mlp_run(sc.Plan(params={"*": [Shard(0), Shard(0)]})),
    "MLP, weights [Shard(1), Shard(1)]": lambda: _mlp_run(sc.Plan(params={"*.weight": [Shard(1), Shard(1)]})),
    "MLP, [Shard(0), Shard(0)] uneven": lambda: _mlp_run(sc.Plan(params={"*": [Shard(0), Shard(0)]}), dim=6, hidden=10),
    "MLP, batch Partial('max')": lambda: _mlp_run(sc.Plan(default_input=[Partial("max"), Replicate()])),
    "MLP, batch [Shard(1), Shard(1)]": lambda: _mlp_run(sc.Plan(default_input=[Shard(1), Shard(1)])),
}


@pytest.mark.parametrize("case", list(GOOD_PLANS))
def test_odd_legal_plan_trains_as_on_one_device(mesh2x2, case):
    step_fn, model, batches, plan = GOOD_PLANS[case]()
    assert_training_matches(step_fn, model, lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh2x2, plan)


def test_error_inside_expansion_names_node_placements_line_and_fix(mesh2x2):
    """An op that cannot be sharded under this plan (fallback='error'): the error names
    the traced node, the placements of its inputs, the user's line and a fix."""
    step_fn, model, batches, plan = _gpt_run(sc.Plan(params={"*": [Shard(0), Shard(0)]}))
    traced = sc.trace(step_fn, model, torch.optim.SGD(model.parameters(), lr=0.1), *batches[0])
    with pytest.raises(sc.UnsupportedOpError) as info:
        sc.expand(traced, mesh2x2, plan, fallback="error")
    msg = str(info.value)
    assert "graph node: %view" in msg and "user code:" in msg and "models.py" in msg
    assert "input placements: view" in msg and "S(2)S(2) [4, 8, 16]" in msg
    assert msg.index("input placements:") < msg.index("fix:")  # the context comes before the way out
    assert msg.count("graph node:") == 1


def test_errors_from_redistribute_get_the_node(mesh4, monkeypatch):
    """A redistribution error has no node of its own; the expander adds it, once."""
    from spmd_compiler.expand import dispatch

    def refuse(*args, **kwargs):
        raise sc.UnsupportedPlacementError("cannot redistribute S(0) -> R (test)")

    model = RenormModel()
    traced = sc.trace(step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 4))
    monkeypatch.setattr(dispatch, "emit_redistribute", refuse)
    with pytest.raises(sc.UnsupportedPlacementError) as info:
        sc.expand(traced, mesh4, sc.Plan(params={"w": [Shard(1)]}))
    msg = str(info.value)
    assert msg.startswith("cannot redistribute S(0) -> R (test)")
    assert "graph node: %" in msg and "input placements:" in msg and "S(1) [4, 4]" in msg and "fix:" in msg
    assert "test_errors.py" in msg  # the user's line
    assert info.value.node is not None and info.value.spmd_node is info.value.node


def test_add_context_keeps_type_and_adds_once():
    import torch.fx as fx

    g = fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(torch.relu, (x,))
    err = ValueError("bad thing")
    assert add_context(err, node, inputs="x: S(0) [4]", fix="do better") is err
    add_context(err, x, inputs="other", fix="other fix")  # the innermost node wins
    msg = str(err)
    assert type(err) is ValueError and err.spmd_node is node
    assert msg.startswith("bad thing") and msg.count("graph node:") == 1 and "%relu" in msg
    assert "input placements: x: S(0) [4]" in msg and msg.endswith("fix: do better")


# ---------------------------------------------------------------- token ids out of the vocabulary


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 4)
        self.head = nn.Linear(4, vocab)

    def forward(self, ids):
        return self.head(self.emb(ids[:, :-1]).mean(1))  # the last column is the label


def lm_step(model, optimizer, ids):
    loss = nn.functional.cross_entropy(model(ids), ids[:, -1], ignore_index=-100)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _ids(bad: int | None = None) -> torch.Tensor:
    ids = torch.randint(0, 10, (2, 6))
    ids[1, -1] = -100  # an ignored label, never embedded: no error for it
    if bad is not None:
        ids[0, 2] = bad
    return ids


def _assert_names_embedding(err: BaseException, bad: int) -> None:
    msg = str(err)
    assert "token ids out of range for the Embedding 'emb' (table emb.weight with 10 rows)" in msg, msg
    assert (f"batch[0] holds ids from {bad} to " if bad < 0 else f" to {bad} (e.g. {bad} ") in msg, msg
    assert f"(e.g. {bad} at index [0, 2] of the ids the embedding reads" in msg, msg  # the first bad id's position
    assert "expected every id in [0, 10)" in msg, msg
    assert "test_errors.py" in msg and "self.emb(ids[:, :-1])" in msg, msg  # the user's line
    assert "fix: keep the ids below num_embeddings=10" in msg, msg


@pytest.mark.parametrize("plan", [None, sc.Plan(params={"emb.weight": [sc.Shard(0)]})], ids=["dp", "vocab_sharded"])
def test_out_of_vocabulary_id_at_compile_names_the_embedding(mesh4, plan):
    """An id >= num_embeddings in the batch a program is compiled for: our ValueError
    (one device: IndexError; a vocab-sharded table would mask the id out silently)."""
    model = TinyLM()
    step = sc.compile(lm_step, mesh=mesh4, plan=plan)
    with pytest.raises(ValueError) as info:
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), _ids(bad=12))
    _assert_names_embedding(info.value, 12)
    with pytest.raises(IndexError):  # what one device does with the same batch
        one = TinyLM()
        lm_step(one, torch.optim.SGD(one.parameters(), lr=0.1), _ids(bad=12))


def test_out_of_vocabulary_id_at_run_names_the_embedding(mesh4):
    """A later batch with a negative id: checked before the cached program runs (one
    device: IndexError), our ValueError."""
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(lm_step, mesh=mesh4)
    step(model, opt, _ids())
    step(model, opt, _ids())
    assert step.compiles == 1
    with pytest.raises(ValueError) as info:
        step(model, opt, _ids(bad=-3))
    assert step.compiles == 1  # the per-call check, not a compile
    _assert_names_embedding(info.value, -3)


def test_ids_in_range_and_ignored_labels_are_not_flagged(mesh4):
    """The ids an embedding reads are computed from the batch as the step does
    (``ids[:, :-1]``): the -100 label in the last column is not an embedding id."""
    model = TinyLM().double()
    res = assert_training_matches(lm_step, model, lambda p: torch.optim.SGD(p, lr=0.1),
                                  [(_ids().repeat(4, 1),) for _ in range(2)], mesh4)
    assert res.sim is not None
    step = sc.compile(lm_step, mesh=mesh4)
    m = TinyLM()
    step(m, torch.optim.SGD(m.parameters(), lr=0.1), _ids())
    assert step.compiles == 1
