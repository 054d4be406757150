"""No stage hard-codes a device: compile with every parameter, buffer and batch tensor on
the ``meta`` device and check that every value of every produced graph is on it.

A stage that made a tensor on the CPU by default (``torch.empty(shape)``) or by name
(``device="cpu"``) shows up here as a CPU value, or as a fake-tensor device error; on a
GPU the same bug mixes cuda and cpu tensors. The one exception is a host scalar: the
learning rate and other hyperparameters are 0-d float64 CPU tensors read with ``.item()``
(as torch's own optimizers allow), never device data.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import spmd_compiler as sc
from spmd_compiler.testing.mesh import fake_mesh
from spmd_compiler.testing.models import GPT, gpt_2d_plan, gpt_fsdp_plan, gpt_tp_plan, train_step

DEVICE = torch.device("meta")


def _off_device(gm) -> list[str]:
    bad = []
    for node in gm.graph.nodes:
        inp = node.meta.get("spmd_input")
        if node.op == "placeholder" and inp is not None and inp.kind == "hparam":
            continue  # host scalar (lr): CPU by design
        for v in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(v, torch.Tensor) and v.device != DEVICE:
                bad.append(f"{node.format_node()} on {v.device}")
    return bad


def _model(fused: bool = False):
    with DEVICE:
        model = GPT(vocab=64, seq=8, dim=32, heads=4, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    ids = torch.randint(0, 64, (8, 8), device=DEVICE)
    return model, opt, ids


PLANS = {
    "dp": ((4,), ("dp",), lambda: sc.Plan()),
    "fsdp": ((4,), ("dp",), gpt_fsdp_plan),
    "tp": ((4,), ("tp",), gpt_tp_plan),
    "2d": ((2, 2), ("dp", "tp"), gpt_2d_plan),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_every_graph_value_stays_on_the_model_device(name, monkeypatch):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")  # compile, never run
    shape, names, plan = PLANS[name]
    model, opt, ids = _model()
    step = sc.compile(train_step, mesh=fake_mesh(shape, names), plan=plan())
    loss = step(model, opt, ids[: 8 // shape[0]], ids[: 8 // shape[0]])
    assert loss.device == DEVICE
    assert step.last.collectives(), "nothing was distributed"
    assert _off_device(step.last.traced.gm) == []
    assert _off_device(step.last.gm) == []
    assert all(p.device_mesh == step.mesh for p in model.parameters())
    assert all(p.to_local().device == DEVICE for p in model.parameters())


def test_pipeline_stages_stay_on_the_model_device(monkeypatch):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    model, opt, ids = _model()
    step = sc.compile(train_step, mesh=fake_mesh((2, 2), ["pp", "tp"]), plan=gpt_tp_plan(),
                      pipeline=sc.Pipeline(chunks=2, schedule="1F1B", split={"blocks.1": sc.SplitPoint.BEGINNING}))
    loss = step(model, opt, ids, ids)
    assert loss.device == DEVICE
    assert _off_device(step.last.gm) == []
    for piece in step.last.pipeline.program.pieces.values():
        assert _off_device(piece.gm) == [], (piece.stage, piece.kind)
