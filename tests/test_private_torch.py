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
