"""The one door to private torch (the spmd_compiler/_private_torch package): schema facts."""

from __future__ import annotations

import torch

from spmd_compiler import _private_torch as pt

aten = torch.ops.aten


def test_writes_first_arg():
    # foreach ops write their first argument too (a list: callers check for a node)
    for op in (aten.add_.Tensor, aten.copy_.default, aten.lerp_.Scalar, aten.zero_.default, aten._foreach_add_.List):
        assert pt.writes_first_arg(op), op
    for op in (aten.add.Tensor, aten.t.default, aten.add.out, torch.relu, "x", None):
        assert not pt.writes_first_arg(op), op  # add.out writes its out= keyword


def test_written_args():
    assert pt.written_args(aten.add_.Tensor) == ((0, "self"),)
    assert pt.written_args(aten.add.out) == ((3, "out"),)
    assert pt.written_args(aten._foreach_add_.List) == ((0, "self"),)
    written = dict((name, i) for i, name in pt.written_args(aten._fused_adamw_.default))
    assert {"self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"} <= set(written)
    assert pt.written_args(aten.mm.default) == () and pt.written_args(torch.relu) == ()


def test_storage_owner_and_written_storages():
    """The view-owner walk shared by trace (contiguous copies) and expand (positions):
    through views of the first argument, stopping at ops that make new storage or write."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, y):
        v = x.unsqueeze(0).transpose(0, 1)  # views of x
        v.add_(1.0)  # writes x's storage through the views
        c = y.clone()
        w = c[1:]  # a view of a fresh copy, read only
        return v.sum() + w.sum()

    gm = make_fx(f)(torch.zeros(4), torch.zeros(4))
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    x, y = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert pt.storage_owner(nodes[aten.transpose.int]) is x
    assert pt.storage_owner(nodes[aten.add_.Tensor]) is nodes[aten.add_.Tensor]  # a write: not followed
    assert pt.storage_owner(nodes[aten.slice.Tensor]) is nodes[aten.clone.default]
    assert pt.storage_owner(y) is y
    assert pt.written_storages(gm.graph) == {x}


def _adamw_gpt_trace():
    import spmd_compiler as sc
    from spmd_compiler.testing.models import GPT, train_step

    torch.manual_seed(0)
    model = GPT(vocab=64, seq=8, dim=32, heads=4, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (8, 8))
    train_step(model, opt, ids, ids)  # AdamW state: the steady step, Adam's bias corrections on symbols
    return sc.trace(train_step, model, opt, ids, ids)


def test_stack_traces_from_live_frames_are_torchs_text(monkeypatch):
    """make_fx's stack traces come from the live frames (not a symbolized capture of the
    whole stack at every node): the same text on every node."""
    import contextlib
    import traceback

    from torch.utils._traceback import CapturedTraceback

    symbolized = []  # whole-stack captures symbolized for a node (torch.fx.proxy's create_node)
    real = CapturedTraceback.summary

    def summary(self):
        symbolized.extend(f for f in traceback.extract_stack(limit=3) if f.filename.endswith("torch/fx/proxy.py"))
        return real(self)

    monkeypatch.setattr(CapturedTraceback, "summary", summary)
    fast = [(n.name, n.meta.get("stack_trace")) for n in _adamw_gpt_trace().gm.graph.nodes]
    assert symbolized == [] and sum(1 for _, s in fast if s and "in forward" in s) > 50
    monkeypatch.setattr(pt, "fast_stack_traces", contextlib.nullcontext)
    assert [(n.name, n.meta.get("stack_trace")) for n in _adamw_gpt_trace().gm.graph.nodes] == fast
    assert symbolized


def test_symbolic_powers_record_no_runtime_asserts():
    """Adam's ``bias_correction2 ** 0.5`` on a symbolic step count: torch's ``base >= 0``
    check is a deferred runtime assert per parameter that nothing emits (sympy work only)."""
    traced = _adamw_gpt_trace()
    env = pt.shape_env_of(pt.fake_mode_of(traced.placeholders()[0].meta["val"]))
    assert env.var_to_range and sum(len(v) for v in env.deferred_runtime_asserts.values()) == 0
