"""Communication by module and layer (spmd_compiler/dump/modules.py) from the module paths
the tracer records (spmd_compiler/trace/modules.py)."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.dump.modules import MODEL, OUTSIDE, comm_by_module, layer_of, traced_modules
from spmd_compiler.dump.summary import comm_summary
from spmd_compiler.testing.models import GPT, MLP, GPTConfig, gpt_2d_plan, gpt_fsdp_plan, mse_train_step, train_step


@pytest.fixture(scope="module")
def traced():
    model = GPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2))
    ids = torch.randint(0, 32, (4, 8))
    return sc.trace(train_step, model, torch.optim.AdamW(model.parameters()), ids, ids)


def test_forward_nodes_carry_the_running_modules_paths(traced):
    stacks = [list(n.meta["nn_module_stack"]) for n in traced.gm.graph.nodes if n.meta.get("nn_module_stack")]
    assert ["", "blocks.1", "blocks.1.attn", "blocks.1.attn.q"] in stacks  # outermost first, the model is ""
    assert all(n.meta.get("spmd_phase") == "forward" for n in traced.gm.graph.nodes if n.meta.get("nn_module_stack"))
    mods = traced_modules(traced.gm)
    phase = {n.name: n.meta.get("spmd_phase") for n in traced.gm.graph.nodes}
    # backward nodes find their forward op's module, optimizer nodes their parameter's
    assert {"blocks.0.attn.q", "blocks.1.fc", "head"} <= {m for n, m in mods.items() if phase[n] == "backward"}
    assert {"blocks.0.attn.q", "tok", "pos"} <= {m for n, m in mods.items() if phase[n] == "optimizer"}
    loss = next(n for n in traced.gm.graph.nodes if "nll_loss_forward" in n.name)
    assert mods[loss.name] == OUTSIDE  # the step's own cross entropy


def test_collectives_by_module_and_layer_add_up(traced, mesh2x2, mesh4):
    for mesh, plan in ((mesh2x2, gpt_2d_plan()), (mesh4, gpt_fsdp_plan())):
        step = sc.expand(traced, mesh, plan)
        rows, layers = comm_by_module(step.gm, traced.gm), comm_by_module(step.gm, traced.gm, by_layer=True)
        values = sum(len(n.meta["spmd_comm"].get("bucket") or [1]) for n in step.gm.graph.nodes if "spmd_comm" in n.meta)
        assert sum(r.values for r in rows) == sum(r.values for r in layers) == values
        assert sum(r.bytes for r in rows) == sum(r.bytes for r in layers) == comm_summary(step.gm).total_bytes
        assert {r.module for r in layers} >= {"blocks.0", "blocks.1", "tok", "head"}
        assert OUTSIDE not in {r.module for r in rows} or all(r.values <= 2 for r in rows if r.module == OUTSIDE)


def test_layer_of():
    assert layer_of("blocks.3.attn.q") == "blocks.3" and layer_of("head") == "head" and layer_of("encoder.layers.11.fc") == "encoder.layers.11"
    assert layer_of(MODEL) == MODEL and layer_of(OUTSIDE) == OUTSIDE


def test_a_gradient_bucket_is_split_by_module(tmp_path, mesh4):
    model = MLP(16, 32)
    step = sc.compile(mse_train_step, mesh=mesh4)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16), torch.randn(8, 16))
    gm = step.last.gm
    (bucket,) = [n for n in gm.graph.nodes if len((n.meta.get("spmd_comm") or {}).get("bucket") or ()) > 1]
    rows = {r.module: r for r in comm_by_module(gm, step.last.traced.gm)}
    assert set(rows) >= {"l1", "l2"} and rows["l1"].values == rows["l2"].values == 2  # weight and bias each
    assert rows["l1"].launches == rows["l2"].launches == 1  # the one bucket
    assert sum(r.bytes for r in rows.values()) == comm_summary(gm).total_bytes
