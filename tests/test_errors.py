"""Error messages: what was expected, what came, the node, the user's line, a fix."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.testing import SimulatedTraining, assert_distributed, assert_training_matches


class RenormModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.renorm(x @ self.w, p=2, dim=0, maxnorm=1.0)  # no DTensor sharding strategy


def step(model, optimizer, x):
    loss = model(x).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_unsupported_op_error_names_op_placements_node_and_line(mesh4):
    model = RenormModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    traced = sc.trace(step, model, opt, torch.randn(8, 4))
    with pytest.raises(sc.UnsupportedOpError) as info:
        sc.expand(traced, mesh4, fallback="error")
    msg = str(info.value)
    assert "aten.renorm.default" in msg
    assert "S(0) [8, 4]" in msg  # the input's placement and global shape
    assert "graph node: %renorm" in msg
    assert "test_errors.py" in msg and "torch.renorm" in msg  # the user's source line
    assert "fix:" in msg
    assert info.value.op is torch.ops.aten.renorm.default


def test_replicate_fallback_warns_once_and_matches(mesh4, caplog):
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"):
        res = assert_training_matches(
            step, RenormModel().double(), lambda p: torch.optim.SGD(p, lr=0.1),
            [(torch.randn(8, 4, dtype=torch.float64),) for _ in range(2)], mesh4,
        )
    warnings = [r for r in caplog.records if "renorm" in r.getMessage()]
    assert len(warnings) == 1  # once per op, not per node or step
    assert any("replicate fallback" in n.meta["spmd_comm"]["reason"] for n in res.sim.expansions[(0,)].collectives())
    assert_distributed(res, sharded=["batch[0]"], collectives={"forward/all_gather/dp": 1})  # the fallback's gather


def test_fallback_option_is_validated(mesh4):
    model = RenormModel()
    traced = sc.trace(step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 4))
    with pytest.raises(ValueError, match="fallback must be"):
        sc.expand(traced, mesh4, fallback="ignore")


def test_batch_argument_must_be_tensor_pytree():
    model = RenormModel()
    with pytest.raises(TypeError, match=r"batch argument batch\[0\] is a object"):
        sc.trace(step, model, None, object())


def test_optimizer_with_foreign_parameter():
    model = RenormModel()
    other = nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([*model.parameters(), other], lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(3,\)\) is not a parameter of the model"):
        sc.trace(step, model, opt, torch.randn(8, 4))
