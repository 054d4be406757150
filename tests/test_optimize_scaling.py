"""The passes' work grows linearly with the program: counted, not timed.

A pass that rebuilds a whole-program analysis per candidate (a memory trace per gather
tried, positions per fused unit, every optimizer node checked at every wait) costs the
program times its layers: minutes on an 80-layer step. Here each default pass runs on
the 2-D (FSDP x Megatron TP) per-rank program of the zoo's torchtitan Llama at two
depths, and the work it does, counted as nodes visited by walks of the graph and
dependency lists read, may grow at most a little faster than the program (8%: the counts are exact, no timing)."""

from __future__ import annotations

import copy
import pathlib
import sys

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

import spmd_compiler as sc
from spmd_compiler.optimize import default_passes, run_passes
from spmd_compiler.testing import fake_mesh

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "zoo"))
from titan_llama import Transformer, tp_params, train_step  # noqa: E402


def _program(layers: int) -> fx.GraphModule:
    torch.manual_seed(0)
    model = Transformer(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (4, 16))
    for p in model.parameters():  # AdamW's state exists: the steady step
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    params = {k: [Shard(1) if v[-1] == Shard(0) else Shard(0), v[-1]] for k, v in tp_params(2).items()}
    plan = sc.Plan(params={**params, "*": [Shard(0), sc.Replicate()]}, default_input=[Shard(0), sc.Replicate()], fsdp_axes=(0,))
    traced = sc.trace(train_step, model, opt, ids, ids)
    return sc.expand(traced, fake_mesh((2, 2), ("dp", "tp")), plan).gm


class _Work:
    """Counts nodes yielded by walks of any graph and ``all_input_nodes`` reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        node_list = fx.graph._node_list
        walk, inputs = node_list.__iter__, fx.Node.all_input_nodes

        def counted_walk(nl):
            for n in walk(nl):
                self.count += 1
                yield n

        def counted_inputs(node):
            self.count += 1
            return inputs.fget(node)

        monkeypatch.setattr(node_list, "__iter__", counted_walk)
        monkeypatch.setattr(fx.Node, "all_input_nodes", property(counted_inputs))


@pytest.fixture(scope="module")
def programs():
    return {n: _program(n) for n in (2, 6)}


def test_every_default_pass_does_linear_work(programs, monkeypatch):
    passes = default_passes()
    gms = {n: copy.deepcopy(gm) for n, gm in programs.items()}
    sizes = {n: len(gm.graph.nodes) for n, gm in gms.items()}
    growth = sizes[6] / sizes[2]
    work = _Work(monkeypatch)
    per_pass: dict[str, dict[int, int]] = {}
    for spec in passes:
        for n in gms:
            work.count = 0
            gms[n], _ = run_passes(gms[n], [spec])
            per_pass.setdefault(spec.name, {})[n] = work.count
    slow = {name: round(w[6] / w[2], 2) for name, w in per_pass.items() if w[6] > 1.08 * growth * w[2]}
    assert not slow, f"work grows faster than the program ({growth:.2f}x nodes): {slow}; counts {per_pass}"
