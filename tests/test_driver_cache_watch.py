"""The program cache warns once when it thrashes (spmd_compiler/driver/cache_watch.py)."""

from __future__ import annotations

import logging

import torch

import spmd_compiler as sc
from spmd_compiler.testing.models import MLP, mse_train_step


def test_a_cache_cycling_through_more_signatures_than_it_holds_warns_once(mesh4, caplog):
    step = sc.compile(mse_train_step, mesh=mesh4, cache_size=2, dynamic=False)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no optimizer state: one program per batch size
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"):
        for rows in (4, 8, 12) * 3:  # 3 sizes in turn, room for 2: every call compiles
            step(model, opt, torch.randn(rows, 16), torch.randn(rows, 16))
    assert step.compiles == 9
    warnings = [r for r in caplog.records if "thrashes" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    text = warnings[0].getMessage()
    assert "cache_size=2" in text and "dynamic=True" in text and "cache_size=N" in text


def test_a_cache_that_holds_every_signature_stays_quiet(mesh4, caplog):
    step = sc.compile(mse_train_step, mesh=mesh4, cache_size=3, dynamic=False)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"):
        for rows in (4, 8, 12) * 2:
            step(model, opt, torch.randn(rows, 16), torch.randn(rows, 16))
    assert step.compiles == 3
    assert not [r for r in caplog.records if "thrashes" in r.getMessage()]
