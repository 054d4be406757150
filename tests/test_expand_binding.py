"""The expander and rebuild bind inputs and outputs by name, not by position."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.expand import ExpansionCache
from spmd_compiler.expand.expander import expand_graph
from spmd_compiler.expand.values import MeshContext
from spmd_compiler.rebuild import finalize
from spmd_compiler.testing.models import MLP, megatron_mlp_plan, mse_train_step


def _traced():
    model = MLP(8, 16)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    mse_train_step(model, opt, x, x)  # Adam's state exists: the steady step
    return sc.trace(mse_train_step, model, opt, x, x)


def test_inputs_bind_by_name_whatever_their_order(mesh4):
    traced = _traced()
    placements = megatron_mlp_plan().resolve(traced, mesh4).placements
    mctx = MeshContext.of(mesh4, (1,))
    step = finalize(expand_graph(traced, mctx, placements, cache=ExpansionCache()))
    # the same inputs and placements listed in reverse: every placeholder finds its own
    shuffled = dataclasses.replace(traced, inputs=list(reversed(traced.inputs)))
    ex = expand_graph(shuffled, mctx, list(reversed(placements)), cache=ExpansionCache())
    by_label = {i.label: s for i, s in zip(traced.inputs, step.input_specs)}
    for inp, spec in zip(shuffled.inputs, finalize(ex).input_specs):
        assert tuple(spec.placements) == tuple(by_label[inp.label].placements), inp.label
    assert tuple(ex.input_value("param", "l1.weight").spec.placements) == (Shard(0),)
    assert tuple(ex.input_value("optim", "l2.weight", "exp_avg").spec.placements) == (Shard(1),)
    assert tuple(ex.input_value("param", "l2.bias").spec.placements) == (Replicate(),)
    with pytest.raises(KeyError, match="no traced input param 'l3.weight'"):
        ex.input_value("param", "l3.weight")


def test_placements_must_cover_every_input(mesh4):
    traced = _traced()
    placements = megatron_mlp_plan().resolve(traced, mesh4).placements
    with pytest.raises(ValueError, match=r"got \d+ placements for the \d+ inputs of the traced step"):
        expand_graph(traced, MeshContext.of(mesh4, (0,)), placements[:-1])
