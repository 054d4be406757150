"""The compile API on a fake process group: cache, recompiles, state, plans, errors.

Numbers computed here are meaningless (fake collectives do nothing); numerics of the
compiled step are tested on real gloo processes in test_runtime_gloo.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.testing.models import MLP


def mse_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_decorator_and_cache(mesh4, caplog):
    @sc.compile(mesh=mesh4, dynamic=False)  # one program per batch shape
    def train_step(model, optimizer, x, y):
        return mse_step(model, optimizer, x, y)

    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        for _ in range(3):
            train_step(model, opt, torch.randn(2, 16), torch.randn(2, 16))
    assert train_step.compiles == 1  # Adam's state is created before the first trace: the steady step from the start
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")]
    assert reasons == ["compiling train_step (first call)"]
    # a new batch shape recompiles, with the reason logged
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        train_step(model, opt, torch.randn(3, 16), torch.randn(3, 16))
        train_step(model, opt, torch.randn(3, 16, dtype=torch.float64).float(), torch.randn(3, 16))
    assert train_step.compiles == 2
    assert any("batch[0]: shape (2, 16) -> (3, 16)" in r.getMessage() for r in caplog.records)
    # and an old shape reuses its graph, never another one
    train_step(model, opt, torch.randn(2, 16), torch.randn(2, 16))
    assert train_step.compiles == 2
    assert tuple(train_step.last.gm.graph.find_nodes(op="placeholder")[-1].meta["val"].shape) == (2, 16)


def test_compile_cache_evicts_the_least_recently_used_program(mesh4):
    step = sc.compile(mse_step, mesh=mesh4, cache_size=2, dynamic=False)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no optimizer state: one program per batch size

    def call(rows):
        step(model, opt, torch.randn(rows, 16), torch.randn(rows, 16))

    for rows in (2, 3, 2, 4):  # 2 was reused after 3: when 4 arrives, 3 is the least recently used
        call(rows)
    assert step.compiles == 3
    call(2)  # kept
    assert step.compiles == 3
    call(3)  # evicted: compiles again
    assert step.compiles == 4


def test_lr_is_an_input_other_hyperparameters_recompile(mesh4, caplog):
    step = sc.compile(mse_step, mesh=mesh4)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(2, 16), torch.randn(2, 16)
    step(model, opt, x, y)
    step(model, opt, x, y)
    assert step.compiles == 1
    lr_inputs = [i.label for i in step.last.traced.inputs if i.kind == "hparam"]
    assert lr_inputs == ["param_groups[0]['lr']", "param_groups[0]['betas']"]  # what schedulers change
    for lr in (0.005, 0.001):  # a scheduler's job: no recompile
        opt.param_groups[0]["lr"] = lr
        step(model, opt, x, y)
    assert step.compiles == 1
    opt.param_groups[0]["weight_decay"] = 0.5  # baked into the graph: recompiles, with the reason
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        step(model, opt, x, y)
    assert step.compiles == 2
    assert any("param_groups[0]['weight_decay'] changed: 0.01 -> 0.5" in r.getMessage() for r in caplog.records)


def test_state_becomes_dtensors(mesh4):
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    step = sc.compile(mse_step, mesh=mesh4, plan=sc.Plan(params={"l1.weight": [Shard(0)]}))
    step(model, opt, torch.randn(2, 16), torch.randn(2, 16))
    sd = model.state_dict()
    assert all(isinstance(v, DTensor) for v in sd.values())
    assert sd["l1.weight"].placements == (Shard(0),) and sd["l2.weight"].placements == (Replicate(),)
    assert isinstance(model.l1.weight, torch.nn.Parameter)
    osd = opt.state_dict()["state"]
    assert isinstance(osd[0]["exp_avg"], DTensor) and osd[0]["exp_avg"].placements == (Shard(0),)
    assert osd[0]["exp_avg"].shape == model.l1.weight.shape
    assert set(opt.param_groups[0]["params"]) == set(model.parameters())


def test_torch_compiled_model_is_traced_through_its_original_module(mesh4, caplog):
    """``torch.compile(model)`` (dynamo's wrapper) used to reach make_fx, which raised torch's
    "symbolically trace a dynamo-optimized function" error: the step now traces the wrapped
    module, the plan names it without ``_orig_mod.``, one WARNING says so."""
    model = MLP()
    compiled = torch.compile(model)
    opt = torch.optim.Adam(compiled.parameters())
    step = sc.compile(mse_step, mesh=mesh4, plan=sc.Plan(params={"l1.weight": [Shard(0)]}))
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"):
        for _ in range(3):
            step(compiled, opt, torch.randn(4, 16), torch.randn(4, 16))
    assert step.compiles == 1  # as for the plain model
    assert model.l1.weight.placements == (Shard(0),) and compiled.l1.weight is model.l1.weight
    warned = [r for r in caplog.records if "wrapped by torch.compile" in r.getMessage()]
    assert len(warned) == 1 and 'backend="inductor"' in warned[0].getMessage()


def test_torch_compiled_model_trains_like_one_device():
    from spmd_compiler.testing import assert_training_matches, fake_mesh

    torch.manual_seed(0)
    batches = [(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)) for _ in range(2)]
    res = assert_training_matches(mse_step, torch.compile(MLP().double()), lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                  fake_mesh((2,), ("dp",)), sc.Plan(params={"l1.weight": [Shard(0)]}, fsdp_axes=(0,)), atol=1e-12)
    assert res.max_param_error < 1e-12


def test_parallel_styles_in_plan(mesh4):
    model = MLP(16, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = sc.Plan(params={"l1": ColwiseParallel(), "l2": RowwiseParallel()}, default_input=[Replicate()])
    step = sc.compile(mse_step, mesh=mesh4, plan=plan)
    step(model, opt, torch.randn(4, 16), torch.randn(4, 16))
    assert model.l1.weight.placements == (Shard(0),) and model.l1.bias.placements == (Shard(0),)
    assert model.l2.weight.placements == (Shard(1),) and model.l2.bias.placements == (Replicate(),)


def test_parallel_style_on_wrong_module(mesh4):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)

        def forward(self, x):
            return self.norm(x)

    step = sc.compile(mse_step, mesh=mesh4, plan=sc.Plan(params={"norm": ColwiseParallel()}))
    model = Net()
    with pytest.raises(TypeError, match="ColwiseParallel applies to nn.Linear or nn.Embedding modules, but 'norm' is a LayerNorm"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 16), torch.randn(4, 16))


@pytest.mark.parametrize("plan, error, match", [
    (sc.Plan(params={"l3.weight": [Shard(0)]}), ValueError, "names no parameter or buffer"),
    (sc.Plan(params={"l1.weight": [Shard(5)]}), ValueError, r"Shard\(5\) .* out of range"),
    (sc.Plan(params={"l1.weight": [Shard(0), Replicate()]}), ValueError, "got 2 placements"),
])
def test_bad_plans_fail_before_any_collective(mesh4, plan, error, match):
    model = MLP()
    step = sc.compile(mse_step, mesh=mesh4, plan=plan)
    with pytest.raises(error, match=match):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 16), torch.randn(2, 16))
    assert not isinstance(model.l1.weight, DTensor)  # nothing was distributed


def test_bad_batch_and_mesh(mesh4):
    model = MLP()
    step = sc.compile(mse_step, mesh=mesh4)
    with pytest.raises(TypeError, match=r"batch argument batch\[1\] is a set"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 16), {1, 2})
    with pytest.raises(ValueError, match="needs 128 ranks but the world has 64"):
        sc.compile(mse_step, mesh=(128,)).mesh
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh"):
        sc.compile(mse_step, mesh="dp").mesh


def test_optimizer_with_foreign_parameters(mesh4):
    model = MLP()
    opt = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.ones(3))], lr=0.1)
    with pytest.raises(ValueError, match="is not a parameter of the model"):
        sc.compile(mse_step, mesh=mesh4)(model, opt, torch.randn(2, 16), torch.randn(2, 16))


def test_step_counts_stay_host_scalars(mesh4):
    """AdamW's ``step`` stays a plain 0-d CPU tensor, as torch keeps it: a DTensor would
    move to the mesh's device, and on a GPU every ``step.item()`` would wait for it."""
    step = sc.compile(mse_step, mesh=mesh4)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        step(model, opt, torch.randn(2, 16), torch.randn(2, 16))
    assert step.compiles == 1
    for p in model.parameters():
        s = opt.state[p]
        assert isinstance(p, DTensor) and isinstance(s["exp_avg"], DTensor)
        assert type(s["step"]) is torch.Tensor and s["step"].device.type == "cpu" and s["step"].dim() == 0
        assert s["step"].item() == 3.0
    host = [n for n in step.last.gm.graph.nodes if n.op == "placeholder" and n.meta.get("spmd_input") is not None
            and n.meta["spmd_input"].key == "step"]
    assert len(host) == len(list(model.parameters())) and all(n.meta["val"].device.type == "cpu" for n in host)
