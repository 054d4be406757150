"""``compile(..., pipeline=Pipeline(...), dynamic=True)``: one program for every batch size.

The stage pieces take the micro-batch size (the call's batch size / chunks) as a ``size_*``
input and compute every dependent size from it, so a new batch size (an epoch's partial
last batch) traces and expands nothing. Compiles on the fake process group (the runner
runs, the values are not checked there), and one 2-process gloo launch against one
device (float64, 1e-10 after every step), with and without the option.
"""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.driver.sizes import ShardedDim
from spmd_compiler.pipeline.sizes import MicroSizeProgram, per_shape_reason
from spmd_compiler.testing.mesh import fake_mesh
from spmd_compiler.testing.models import GPT, gpt_tp_plan, train_step

S = sc.SplitPoint.BEGINNING
SIZES = [8, 6, 4, 12, 10]  # 10: the epoch's partial last batch


def _gpt():
    return GPT(vocab=32, seq=8, dim=16, heads=2, layers=2).double()


def _run_sizes(step, model, opt, sizes):
    for b in sizes:
        ids = torch.randint(0, 32, (b, 8))
        step(model, opt, ids, ids)


@pytest.fixture(scope="module")
def pp_step():
    """One dynamic pipeline program on a 2-stage mesh, shared by the tests below: the sizes
    of SIZES, then one chunks does not divide (it raises), then more sizes."""
    torch.manual_seed(0)
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = sc.compile(train_step, mesh=fake_mesh((2,), ["pp"]), pipeline=sc.Pipeline(chunks=2, split={"blocks.1": S}),
                      dynamic=True)
    _run_sizes(step, model, opt, SIZES)
    compiles = step.compiles
    last = step.last
    with pytest.raises(ValueError, match="7 rows, which do not split into 2 equal micro-batches"):
        _run_sizes(step, model, opt, [7])
    after_error = step.last
    _run_sizes(step, model, opt, [2, 14])
    return {"step": step, "compiles": compiles, "last": last, "after_error": after_error}


def test_one_program_for_every_batch_size_on_a_pp_mesh(pp_step):
    assert pp_step["compiles"] == 1  # AdamW's state exists before the first trace
    compiled = pp_step["last"]
    (symbol,) = compiled.size_symbols
    name = f"size_{symbol.symbol}"
    program = compiled.program
    # every forward and backward piece reads the micro-batch size itself; no size crosses stages
    for s in (0, 1):
        for kind in "FB":
            assert name in program.pieces[(s, kind)].inputs, (s, kind, program.pieces[(s, kind)].inputs)
    crossing = program.cross_stage()
    assert crossing and all(isinstance(program.vals[v], torch.Tensor) for v, *_ in crossing)
    # the values sent between stages have the micro-batch size as their first dim
    sent = {v for v, t, s, tk, k in crossing if (tk, k) == ("F", "F")}
    assert any(str(program.vals[v].shape[0]) == str(symbol.symbol) for v in sent), {v: program.vals[v].shape for v in sent}


# dynamic=False compiles once per batch shape: test_gloo_one_program_equals_one_device
# checks it (the same pipeline, compiles [1, 2, 3, 4, 4, 5] over its sizes, no size symbol)


def test_a_batch_chunks_does_not_divide_raises_and_the_program_stays(pp_step):
    """A size chunks does not divide raises (in the fixture) and compiles nothing; the
    program stays and serves the sizes after it."""
    step = pp_step["step"]
    assert pp_step["after_error"] is pp_step["last"]
    assert step.last is pp_step["last"] and step.compiles == 1


@pytest.mark.parametrize("axis", ["dp", "tp"])
def test_stage_mesh_axes_beside_the_pipeline(axis):
    """pp x dp (each rank cuts its batch shard into micro-batches) and pp x tp (Megatron
    TP inside each stage): one program too; a shard chunks does not divide raises."""
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # no state: one compile (AdamW's second: pp_step)
    step = sc.compile(train_step, mesh=fake_mesh((2, 2), ["pp", axis]), plan=gpt_tp_plan() if axis == "tp" else None,
                      pipeline=sc.Pipeline(chunks=2, split={"blocks.1": S}), dynamic=True)
    _run_sizes(step, model, opt, [4, 6, 2, 8])  # dp: this rank's shard of twice as many rows
    assert step.compiles == 1
    assert step.last.size_symbols and step.last.mctx.axis_names == (axis,)
    with pytest.raises(ValueError, match="equal micro-batches"):
        _run_sizes(step, model, opt, [5])


def test_no_chunk_tensors_keep_their_size_in_the_signature():
    def weighted_step(model, optimizer, ids, targets, class_weights):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=class_weights)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # no state: every size after the first reuses its program
    step = sc.compile(weighted_step, mesh=fake_mesh((2,), ["pp"]), dynamic=True,
                      pipeline=sc.Pipeline(chunks=2, split={"blocks.1": S}, no_chunk=["batch[2]"]))
    w = torch.rand(32, dtype=torch.float64)
    for b in (8, 6, 4):
        ids = torch.randint(0, 32, (b, 8))
        step(model, opt, ids, ids, w)
    assert step.compiles == 1
    assert [s.label for s in step.last.size_symbols] == ["batch[0]"]  # not the weights' length


def test_micro_size_program_values():
    dims = [ShardedDim(0, 0, None, "batch[0]"), ShardedDim(1, 0, 1, "batch[1]")]
    program = MicroSizeProgram(dims, [0], ["s0"], [], [], divisors=[2, 2], mesh_shape=(2, 2))
    assert program.values([8, 8]) == ([4], None)
    feed, broken = program.values([7, 8])
    assert "batch[0] has 7 rows, which do not split into 2 equal micro-batches" in broken
    feed, broken = program.values([10, 10])  # shards of 5 and 5 rows: each rank cuts its own
    assert "shards of [5, 5] rows over mesh axis 1" in broken
    assert per_shape_reason("inductor", False) and per_shape_reason("eager", True) == "explain mode"
    assert per_shape_reason("eager", False) is None


# ---------------------------------------------------------------------- real processes
GLOO_SIZES = [8, 6, 4, 12, 7, 10]  # 7: chunks=2 does not divide it (ValueError on every rank)


def _worker(rank: int, world: int) -> dict:
    out = {}
    for dynamic in (True, False):
        torch.manual_seed(0)
        model = _gpt()
        ref = copy.deepcopy(model)
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref))
        step = sc.compile(train_step, mesh={"pp": 2}, pipeline=sc.Pipeline(chunks=2, split={"blocks.1": S}),
                          dynamic=dynamic, symbolic="batch")
        steps = []
        for i, b in enumerate(GLOO_SIZES):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 32, (b, 8), generator=g)
            targets = torch.roll(ids, -1, 1)
            try:
                got = step(model, opt, ids, targets)
            except ValueError as e:
                steps.append({"size": b, "error": str(e), "compiles": step.compiles})
                continue
            want = train_step(ref, ref_opt, ids, targets)
            ref_sd = ref.state_dict()
            state_err = max((v.full_tensor() - ref_sd[k]).abs().max().item() for k, v in model.state_dict().items())
            steps.append({"size": b, "loss": got.item(), "loss_err": abs(got.item() - want.item()), "state_err": state_err,
                          "compiles": step.compiles})
        out[dynamic] = {"steps": steps, "symbols": len(step.last.size_symbols)}
    return out


@pytest.mark.gloo
def test_gloo_one_program_equals_one_device():
    from gloo_launch import run_processes

    per_rank = run_processes(_worker, 2, timeout=900)
    for rank, res in enumerate(per_rank):
        for dynamic, compiles in ((True, [1, 1, 1, 1, 1, 1]), (False, [1, 2, 3, 4, 4, 5])):
            r = res[dynamic]
            assert [s["compiles"] for s in r["steps"]] == compiles, (rank, dynamic, r)
            assert r["symbols"] == (1 if dynamic else 0)
            for s in r["steps"]:
                if s["size"] == 7:
                    assert "do not split into 2 equal micro-batches" in s["error"], s
                    continue
                assert s["loss_err"] < 1e-10 and s["state_err"] < 1e-10, (rank, dynamic, s)
    for dynamic in (True, False):  # every rank returns the full-batch loss
        assert len({tuple(s.get("loss") for s in res[dynamic]["steps"]) for res in per_rank}) == 1
