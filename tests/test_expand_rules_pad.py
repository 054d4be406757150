"""``constant_pad_nd`` under dynamic=True (``expand/rules/pad.py``): padding dims that no
mesh axis splits keeps one program for every batch size (Hugging Face's causal-LM loss
pads the labels, ``F.pad(labels, (0, 1), value=-100)``); padding the split batch dim goes
to DTensor (per shape, gathering), equal to one device either way."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.testing import assert_training_matches, fake_mesh

V, T = 11, 8
aten = torch.ops.aten


class _LM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, 6)
        self.head = torch.nn.Linear(6, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _shifted_loss_step(model, optimizer, ids, labels):
    """The causal-LM loss as Hugging Face writes it: pad, shift, flatten."""
    logits = model(ids)
    labels = F.pad(labels, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    loss = F.cross_entropy(logits.view(-1, V), shift.view(-1), ignore_index=-100)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _batch_pad_step(model, optimizer, ids, labels):
    """Pads the split batch dim itself: two rows of ``ignore_index``."""
    logits = F.pad(model(ids), (0, 0, 0, 0, 0, 2))
    labels = F.pad(labels, (0, 0, 0, 2), value=-100)
    loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _batches(sizes):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, V, (b, T), generator=g), torch.randint(0, V, (b, T), generator=g)) for b in sizes]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("ranks", [2, 3])
def test_padding_an_unsplit_dim_keeps_one_program(ranks, caplog):
    caplog.set_level(logging.INFO, logger="spmd_compiler")
    res = assert_training_matches(_shifted_loss_step, _LM().double(), _sgd, _batches([8, 5, 3, 1, 7]), fake_mesh((ranks,), ("dp",)),
                                  sc.Plan(), dynamic=True, atol=1e-10, rtol=1e-10)
    assert res.sim.compiles == 1, res.sim.reasons
    assert [r.getMessage() for r in caplog.records if r.name == "spmd_compiler.driver.dynamic" or r.levelno >= logging.WARNING] == []
    gm = res.sim.expansions[(0,)].gm
    (pad,) = [n for n in gm.graph.nodes if n.target is aten.constant_pad_nd.default]
    assert pad.args[1] == [0, 1]  # each rank pads its own rows
    assert not [n for n in gm.graph.nodes if "all_gather" in str(n.target)]


def test_padding_the_split_batch_dim_still_equals_one_device():
    res = assert_training_matches(_batch_pad_step, _LM().double(), _sgd, _batches([8, 5]), fake_mesh((2,), ("dp",)),
                                  sc.Plan(), dynamic=True, atol=1e-10, rtol=1e-10)
    assert res.sim.compiles >= 1
