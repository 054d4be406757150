"""Pipeline configuration errors: raised at compile, before any collective, with a fix."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.testing.mesh import fake_mesh
from spmd_compiler.testing.models import GPT, train_step

S = sc.SplitPoint.BEGINNING


def _run(mesh: dict, pipeline, layers: int = 2, rows: int = 8):
    torch.manual_seed(0)
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(train_step, mesh=fake_mesh(tuple(mesh.values()), list(mesh)), pipeline=pipeline)
    ids = torch.randint(0, 32, (rows, 8))
    return step(model, opt, ids, ids)


@pytest.mark.parametrize(
    "mesh, pipeline, match",
    [
        ({"pp": 2}, sc.Pipeline(chunks=2, split={"block.1": S}), r"split point 'block.1' names no module.*'blocks.1'"),
        ({"pp": 4}, sc.Pipeline(chunks=2, split={"blocks.1": S}), r"cuts into 2 stage\(s\).*needs 4.*give 3 split points"),
        ({"pp": 2}, sc.Pipeline(chunks=2), r"cuts into 1 stage\(s\) \(0 split point\(s\)\).*Pipeline\(auto=True\)"),
        ({"pp": 2}, sc.Pipeline(chunks=16, split={"blocks.1": S}), r"batch\[0\] has 8 rows but chunks=16.*no_chunk"),
        ({"dp": 2}, sc.Pipeline(chunks=2, split={"blocks.1": S}), r"no pipeline axis 'pp'.*Pipeline\(axis="),
    ],
    ids=["unknown_fqn", "too_few_cuts", "no_cuts", "chunks_exceed_batch", "missing_axis"],
)
def test_configuration_errors(mesh, pipeline, match):
    with pytest.raises(ValueError, match=match):
        _run(mesh, pipeline)


def test_interleaved_needs_enough_microbatches():
    pipe = sc.Pipeline(chunks=1, schedule="Interleaved1F1B", stages_per_rank=2, split={f"blocks.{i}": S for i in (1, 2, 3)})
    with pytest.raises(ValueError, match="needs at least as many micro-batches as pipeline ranks"):
        _run({"pp": 2}, pipe, layers=4)


def test_uneven_microbatches():
    with pytest.raises(ValueError, match="6 rows, which do not split into 4 equal micro-batches"):
        _run({"pp": 2}, sc.Pipeline(chunks=4, split={"blocks.1": S}), rows=6)


def test_bad_arguments():
    with pytest.raises(TypeError, match="expects a spmd_compiler.Pipeline"):
        sc.compile(train_step, mesh={"pp": 2}, pipeline={"chunks": 2})
    with pytest.raises(ValueError, match="schedule='ZB'"):
        sc.Pipeline(schedule="ZB")
    with pytest.raises(ValueError, match="checkpoint='sometimes'"):
        sc.Pipeline(checkpoint="sometimes")
    with pytest.raises(ValueError, match="chunks=0"):
        sc.Pipeline(chunks=0)
    with pytest.raises(TypeError, match="expected SplitPoint"):
        _run({"pp": 2}, sc.Pipeline(chunks=2, split={"blocks.1": "beginning"}))


def test_cross_stage_optimizer_code_is_refused():
    def clipped_step(model, optimizer, ids, targets):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a norm over every stage's gradients
        optimizer.step()
        optimizer.zero_grad()
        return loss

    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(clipped_step, mesh=fake_mesh((2,), ["pp"]), pipeline=sc.Pipeline(chunks=2, split={"blocks.1": S}))
    ids = torch.randint(0, 32, (8, 8))
    with pytest.raises(sc.SpmdError, match=r"optimizer part of stage 0 to the optimizer part of stage 1.*clip_grad_norm_.*fix:"):
        step(model, opt, ids, ids)


def _lm_step(zero_grad):
    def step(model, optimizer, ids, targets):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        if zero_grad is not None:
            optimizer.zero_grad(set_to_none=zero_grad)
        return loss

    return step


def test_gradients_kept_across_calls_are_refused(monkeypatch):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")  # compiled, not run
    ids = torch.randint(0, 32, (8, 8))

    def call(fn, grad=False):
        torch.manual_seed(0)
        model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2)
        if grad:
            model.tok.weight.grad = torch.zeros_like(model.tok.weight)
        step = sc.compile(fn, mesh=fake_mesh((2,), ["pp"]), pipeline=sc.Pipeline(chunks=2, split={"blocks.1": S}))
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), ids, ids)
        return step

    # no zero_grad(): the gradients would be the next call's; refused, never dropped
    with pytest.raises(sc.SpmdError, match=r"cannot keep gradients across calls: the step leaves gradients set.*fix: end the step"):
        call(_lm_step(None))
    # gradients from before the call
    with pytest.raises(sc.SpmdError, match=r"parameters hold gradients when the step is called \(tok.weight\)"):
        call(_lm_step(True), grad=True)
    # zeroed but present: left out, as before gradients were state
    step = call(_lm_step(False))
    assert step.last.traced.grads_left == () and not any(o.kind == "grad" for o in step.last.outputs)
