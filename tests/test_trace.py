"""Tracing a whole train step: inputs lifted by name, updates as outputs, phases."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.testing.models import GPT, MLP, train_step


def step(model, optimizer, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.1),
    lambda p: torch.optim.AdamW(p, lr=0.1),
])
def test_first_step_creates_optimizer_state(make_opt):
    model = MLP()
    opt = make_opt(model.parameters())
    before = copy.deepcopy(model.state_dict())
    traced = sc.trace(step, model, opt, torch.randn(8, 16))
    # lr and momentum / betas (what schedulers change) are inputs
    assert [i.kind for i in traced.inputs] == ["param"] * 4 + ["hparam", "hparam", "batch"]
    assert [i.name for i in traced.inputs if i.kind == "param"] == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    # the learning rate is read at run time (LR schedulers), as a 0-d float64 input
    lr = next(i for i in traced.inputs if i.kind == "hparam")
    assert (lr.label, lr.shape, lr.dtype) == ("param_groups[0]['lr']", (), torch.float64)
    cycled = [i for i in traced.inputs if i.kind == "hparam"][1]
    assert (cycled.key, cycled.shape) in {("momentum", ()), ("betas", (2,))}
    reads = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default
             and n.args[0].name == "h_param_groups_0___lr"]
    assert len(reads) == 1 and reads[0].meta["spmd_phase"] == "optimizer"
    assert opt.param_groups[0]["lr"] == 0.1  # restored after tracing
    assert traced.new_optim_keys  # momentum_buffer / exp_avg created inside the graph
    assert {o.kind for o in traced.outputs} == {"user", "param", "optim"}
    # tracing computes nothing: model and optimizer untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state


def test_second_step_lifts_state_to_inputs():
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    step(model, opt, torch.randn(8, 16))
    traced = sc.trace(step, model, opt, torch.randn(8, 16))
    optim = [i for i in traced.inputs if i.kind == "optim"]
    assert {(i.name, i.key) for i in optim} == {(n, k) for n in ["l1.weight", "l1.bias", "l2.weight", "l2.bias"] for k in ["step", "exp_avg", "exp_avg_sq"]}
    assert not traced.new_optim_keys
    names = [n.name for n in traced.placeholders()]
    assert "o_l1_weight__exp_avg" in names and "p_l1_weight" in names and "in_batch_0" in names


def test_phases_and_stack_traces():
    model = GPT(layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ids = torch.randint(0, 64, (2, 16))
    traced = sc.trace(train_step, model, opt, ids, ids)
    phases = [n.meta.get("spmd_phase") for n in traced.gm.graph.nodes if n.op == "call_function"]
    # forward, then backward, then optimizer, in trace order
    order = [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]
    assert order == ["forward", "backward", "optimizer"]
    mm = next(n for n in traced.gm.graph.nodes if n.op == "call_function" and n.meta["spmd_phase"] == "forward" and "addmm" in n.name)
    assert "models.py" in mm.meta["stack_trace"]


def test_buffers_and_tied_parameters():
    model = GPT(layers=1, tie_embeddings=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 64, (2, 16))
    traced = sc.trace(train_step, model, opt, ids, ids)
    params = [i.name for i in traced.inputs if i.kind == "param"]
    assert "tok.weight" in params and "head.weight" not in params  # one input for the tie
    assert traced.state.aliases == {"head.weight": "tok.weight"}
    assert [i.name for i in traced.inputs if i.kind == "buffer"] == ["blocks.0.attn.mask"]


def test_symbolic_option_validated():
    model = MLP()
    with pytest.raises(ValueError, match="symbolic must be"):
        sc.trace(step, model, None, torch.randn(8, 16), symbolic="some")


def test_python_number_computed_from_sizes_is_a_graph_output():
    """Handed back as a Python int after each call (trace/host_values.py)."""
    model = MLP()

    def rows(model, optimizer, x):
        return x.size(0) * 2

    traced = sc.trace(rows, model, None, torch.randn(8, 16))
    assert traced.host_numbers == {0: int} and not traced.user_constants
    assert [o.kind for o in traced.outputs][:1] == ["user"]


def test_state_cache_reuses_and_invalidates():
    from spmd_compiler.trace.state import StateCache

    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cache = StateCache()
    first = cache.get(model, opt)
    assert cache.get(model, opt) is first  # nothing changed: reused
    opt.param_groups[0]["lr"] = 0.05  # a scheduler's change: reused, value refreshed
    assert cache.get(model, opt) is first and first.hparams[(0, "lr")] == 0.05
    step(model, opt, torch.randn(8, 16))  # Adam creates its state
    second = cache.get(model, opt)
    assert second is not first and second.optim
    new_weight = torch.nn.Parameter(torch.randn(32, 16))
    model.l1.weight = new_weight  # a replaced parameter is noticed (the optimizer still holds the old one)
    with pytest.raises(ValueError, match="is not a parameter of the model"):
        cache.get(model, opt)
    opt.param_groups[0]["params"][0] = new_weight
    third = cache.get(model, opt)
    assert third is not second and third.params["l1.weight"] is model.l1.weight
    model.extra = torch.nn.Linear(2, 2)  # a new submodule
    assert "extra.weight" in cache.get(model, opt).params
    opt.param_groups[0]["weight_decay"] = 0.5  # a compiled-in setting
    assert cache.get(model, opt).signature() != third.signature()
    other = MLP()  # another model: collected afresh
    assert cache.get(other, None).params["l1.weight"] is other.l1.weight
