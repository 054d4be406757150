"""_private_torch/optim.py: the state a torch optimizer creates on its first step, created
before it: the first step (and the next) then give bit for bit what they give without."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_compiler._private_torch as pt

O = torch.optim
OPTIMIZERS = {
    "adam": lambda p: O.Adam(p, lr=0.01), "adamw": lambda p: O.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw_amsgrad": lambda p: O.AdamW(p, amsgrad=True), "adam_foreach": lambda p: O.Adam(p, foreach=True),
    "adam_fused": lambda p: O.Adam(p, fused=True), "nadam": lambda p: O.NAdam(p),
    "nadam_decoupled": lambda p: O.NAdam(p, decoupled_weight_decay=True, weight_decay=0.1), "radam": lambda p: O.RAdam(p),
    "adamax": lambda p: O.Adamax(p), "adagrad": lambda p: O.Adagrad(p, initial_accumulator_value=0.1),
    "rmsprop": lambda p: O.RMSprop(p, momentum=0.9, centered=True), "adadelta": lambda p: O.Adadelta(p),
    "asgd": lambda p: O.ASGD(p), "rprop": lambda p: O.Rprop(p), "sgd": lambda p: O.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: O.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_dampening": lambda p: O.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "adafactor": lambda p: O.Adafactor(p),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_created_state_gives_the_first_steps_bit_for_bit(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    lazy = copy.deepcopy(model)
    opt, lazy_opt = OPTIMIZERS[name](list(model.parameters())), OPTIMIZERS[name](list(lazy.parameters()))
    made = pt.create_lazy_state(opt)
    assert all(p.grad is None for p in model.parameters())  # the zero gradients it used are gone
    if name in ("sgd", "sgd_dampening", "adagrad"):  # no state, state in its update, state made at construction
        assert made == 0
    else:
        assert made == 4 and len(opt.state) == 4
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(2):
        for m, o in ((model, opt), (lazy, lazy_opt)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), lazy.parameters()):
        assert torch.equal(p, q)
    got, want = opt.state_dict()["state"], lazy_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].keys() == want[k].keys()
        for key in want[k]:
            assert torch.equal(torch.as_tensor(got[k][key]), torch.as_tensor(want[k][key])), (k, key)


def test_step_hooks_do_not_run_and_lbfgs_keeps_its_lazy_state():
    model = torch.nn.Linear(3, 2)
    opt = O.AdamW(model.parameters())
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    assert pt.create_lazy_state(opt) == 2 and calls == []
    assert pt.create_lazy_state(O.LBFGS(model.parameters())) == 0
