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
