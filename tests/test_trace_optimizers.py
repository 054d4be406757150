"""Every optimizer of ``torch.optim`` from a fresh optimizer: the call that creates its
state is traced with that state made inside the graph (trace/state.py), and host numbers
the optimizer reads from it (NAdam's ``mu_product.item()``, RAdam's ``rho_t``, ASGD's
``eta`` / ``mu``, Adamax's and Rprop's state) must be the numbers one device reads.

The sweep trains 3 steps under DP, FSDP and TP on a 2-layer MLP in float64 and compares
with one device. The default run takes one configuration per optimizer under DP, and
the optimizers that read host numbers from their state under every plan; the rest, and
the flag variants (foreach, fused, amsgrad, maximize, decoupled weight decay, nesterov,
...), are ``slow`` (the whole file: about 2.5 minutes on 2 CPU cores). ``capturable=True`` needs a CUDA device (torch refuses it on CPU, one device
too); ``SparseAdam`` needs sparse gradients (one device refuses dense ones); ``LBFGS`` is
refused with a clear error.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.errors import DataDependentError
from spmd_compiler.plan import Plan
from spmd_compiler.testing import assert_training_matches, fake_mesh
from spmd_compiler.testing.models import GPT, MLP, gpt_fsdp_plan, megatron_mlp_plan, mse_train_step, train_step

PLANS = {
    "dp": lambda: Plan(default_input=[Shard(0)]),
    "fsdp": lambda: Plan(params={"*": [Shard(0)]}, default_input=[Shard(0)], fsdp_axes=(0,)),
    "tp": lambda: Plan(params=megatron_mlp_plan().params, default_input=[Replicate()]),
}

WD = {"weight_decay": 0.1}
# one configuration per optimizer: the default run
BASE = [
    ("Adadelta", {}), ("Adafactor", {}), ("Adagrad", {}), ("Adam", {}), ("AdamW", {}), ("Adamax", {}),
    ("ASGD", {"t0": 1.0}),  # t0=1: averaging starts at step 2 (``mu = 1 / max(1, step - t0)``)
    ("NAdam", {}), ("NAdam", {"decoupled_weight_decay": True, **WD}), ("RAdam", {}), ("RMSprop", {}), ("Rprop", {}),
    ("SGD", {"momentum": 0.9}), ("Muon", {}),
]
# the common flags
FLAGS = [
    ("Adadelta", {"foreach": True, "maximize": True, **WD}),
    ("Adafactor", {"maximize": True, **WD}),
    ("Adagrad", {"fused": True}), ("Adagrad", {"foreach": True, "lr_decay": 0.01, **WD}),
    ("Adam", {"amsgrad": True}), ("Adam", {"foreach": True}), ("Adam", {"fused": True, "amsgrad": True}),
    ("Adam", {"maximize": True, **WD}), ("Adam", {"decoupled_weight_decay": True, **WD}),
    ("AdamW", {"amsgrad": True, "maximize": True}), ("AdamW", {"fused": True}),
    ("Adamax", {"foreach": True, "maximize": True, **WD}),
    ("ASGD", {"foreach": True, "maximize": True, "t0": 1.0, **WD}),
    ("NAdam", {"foreach": True, "maximize": True}), ("NAdam", {"momentum_decay": 0.01, **WD}),
    ("RAdam", {"decoupled_weight_decay": True, **WD}), ("RAdam", {"foreach": True, "maximize": True}),
    ("RMSprop", {"centered": True, "momentum": 0.9}), ("RMSprop", {"foreach": True, "maximize": True, **WD}),
    ("Rprop", {"foreach": True, "maximize": True}),
    ("SGD", {"momentum": 0.9, "nesterov": True}), ("SGD", {"momentum": 0.9, "dampening": 0.1, "maximize": True, **WD}),
    ("SGD", {"foreach": True, "momentum": 0.9}), ("SGD", {"fused": True, "momentum": 0.9}),
    ("Muon", {"nesterov": False, **WD}),
]


def _make(name: str, kw: dict):
    def make(params):
        params = list(params)
        if name == "Muon":  # Muon takes matrices only (torch raises for a bias)
            params = [p for p in params if p.dim() == 2]
        return getattr(torch.optim, name)(params, lr=0.01, **kw)

    return make


def _case_id(name: str, kw: dict, plan: str) -> str:
    flags = ",".join(f"{k}={v}" for k, v in kw.items())
    return f"{name}[{flags}]-{plan}" if flags else f"{name}-{plan}"


# the optimizers that read host numbers from the state they create: every plan by default
HOST_READERS = {"NAdam", "RAdam", "Adamax", "ASGD", "Rprop"}


def _cases(configs, slow=False):
    return [
        pytest.param(name, kw, plan, id=_case_id(name, kw, plan),
                     marks=pytest.mark.slow if slow or (plan != "dp" and name not in HOST_READERS) else ())
        for name, kw in configs for plan in PLANS
    ]


def _newton_schulz_float64(grad, ns_coefficients, ns_steps, eps):
    """torch's Muon orthogonalization (``_zeropower_via_newtonschulz``) without its cast
    to bfloat16: in bfloat16 a sharded matmul, summing in another order, rounds
    differently (4e-6 relative on the loss), which would hide a real difference."""
    a, b, c = ns_coefficients
    x = grad.T if grad.size(0) > grad.size(1) else grad
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


HOST_NUMBER_OPTIMIZERS = {"NAdam", "RAdam", "Adamax", "ASGD", "Rprop"}


def _train(name: str, kw: dict, plan: str, **options):
    model = MLP(8, 16).double()
    batches = [(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)) for _ in range(3)]
    try:
        return assert_training_matches(mse_train_step, model, _make(name, kw), batches, fake_mesh((2,), ("dp",)), PLANS[plan](),
                                       **options)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,kw,plan", _cases(BASE) + _cases(FLAGS, slow=True))
def test_optimizer_trains_as_on_one_device_from_a_fresh_optimizer(name, kw, plan, monkeypatch):
    if name == "Muon":
        monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _newton_schulz_float64)
    # the optimizers that read host numbers from their state run the state-creating first
    # call (compile() traces it for optimizers whose state their update creates); the others
    # have their state created before the first trace, as compile() does for torch.optim
    res = _train(name, kw, plan, create_lazy_state=name not in HOST_NUMBER_OPTIMIZERS)
    assert all(math.isfinite(v) for v in res.losses)


def _nan_constants(gm: torch.fx.GraphModule) -> list[str]:
    out = []
    for node in gm.graph.nodes:
        for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(a, float) and math.isnan(a):
                out.append(node.format_node())
    return out


@pytest.mark.parametrize("decoupled", [False, True])
def test_nadam_state_creating_trace_reads_mu_product_from_the_graph(decoupled):
    """NAdam creates ``mu_product = tensor(1.)`` and multiplies it by ``mu``, a number
    computed from the lifted ``betas``; the trace used to fold that into a constant
    NaN and divide by it (``1 - mu_product.item()``)."""
    model = GPT(vocab=16, seq=4, dim=8, heads=2, layers=1).double()
    opt = torch.optim.NAdam(model.parameters(), lr=0.01, decoupled_weight_decay=decoupled, weight_decay=0.1)
    ids = torch.randint(0, 16, (2, 4))
    traced = sc.trace(train_step, model, opt, ids, ids)
    assert traced.new_optim_keys  # the state-creating call
    assert _nan_constants(traced.gm) == []


@pytest.mark.slow  # a GPT: 9 s per plan; the MLP cases above run NAdam under every plan
@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_nadam_gpt_equals_one_device_from_the_first_call(plan):
    """The issue's case: NAdam(decoupled_weight_decay=True) on a GPT, first call included."""
    model = GPT(vocab=16, seq=4, dim=8, heads=2, layers=1).double()
    batches = [(torch.randint(0, 16, (4, 4)),) * 2 for _ in range(2)]
    make = lambda ps: torch.optim.NAdam(ps, lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)  # noqa: E731
    p = Plan(default_input=[Shard(0)]) if plan == "dp" else gpt_fsdp_plan()
    try:
        assert_training_matches(train_step, model, make, batches, fake_mesh((2,), ("dp",)), p, create_lazy_state=False)
    finally:
        dist.destroy_process_group()


def test_lbfgs_is_refused_with_a_fix():
    model = MLP(4, 8).double()
    opt = torch.optim.LBFGS(model.parameters())
    x = torch.randn(4, 4, dtype=torch.float64)

    def step(model, opt, x, y):
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        return opt.step(closure)

    with pytest.raises(DataDependentError, match=r"LBFGS\.step\(closure\).*\n.*fix: use a first-order optimizer"):
        sc.trace(step, model, opt, x, x)
