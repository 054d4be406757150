"""Memoized expansion gives exactly the graph (and numbers) of uncached expansion."""

from __future__ import annotations

import torch

import spmd_compiler as sc
from spmd_compiler.testing import group_axes_of, rank_coordinates, run_lockstep, shard_tensor
from spmd_compiler.testing.models import GPT, gpt_2d_plan, train_step
from spmd_compiler.trace.state import input_value


def test_cached_equals_uncached_2d_transformer(mesh2x2):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=3).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 32, (4, 8))
    train_step(model, opt, ids, ids)
    traced = sc.trace(train_step, model, opt, ids, ids)
    cache = sc.ExpansionCache()
    cached = sc.expand(traced, mesh2x2, gpt_2d_plan(), cache=cache)
    plain = sc.expand(traced, mesh2x2, gpt_2d_plan(), cache=sc.ExpansionCache(enabled=False))
    assert cache.hits > cache.misses  # layers 2 and 3 replay layer 1's recipes
    assert cached.gm.code == plain.gm.code
    # and the same numbers on every rank
    coords = rank_coordinates((2, 2))
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    globals_ = []
    for inp in traced.inputs:
        if inp.kind in ("param", "buffer"):
            globals_.append(state[inp.name].detach())
        elif inp.kind == "optim":
            globals_.append(opt.state[state[inp.name]][inp.key])
        elif inp.kind == "hparam":
            globals_.append(input_value(inp, traced.state, []))
        else:
            globals_.append(ids)
    outs = []
    for step in (cached, plain):
        inputs = {c: [shard_tensor(g, s.placements, (2, 2), c) for g, s in zip(globals_, step.input_specs)] for c in coords}
        outs.append(run_lockstep({c: step.gm for c in coords}, inputs, (2, 2), group_axes=group_axes_of(step)))
    for c in coords:
        for a, b in zip(outs[0][c], outs[1][c]):
            assert torch.equal(a, b)


def test_timings_per_phase(mesh4):
    from spmd_compiler.testing.models import MLP

    model = MLP()
    step = sc.compile(lambda m, o, x: train_step_sum(m, o, x), mesh=mesh4)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 16))
    t = step.timings()
    assert {"trace", "expand", "rebuild", "passes", "total"} <= set(t)
    assert any(k.startswith("pass ") for k in t)
    assert all(v >= 0 for v in t.values())


def train_step_sum(model, opt, x):
    loss = model(x).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_progress_silent_unless_info(capsys):
    import logging

    from spmd_compiler.expand.progress import Progress

    log = logging.getLogger("spmd_compiler.test_progress")
    log.setLevel(logging.WARNING)
    p = Progress("expanding", 10, log, delay=0.0)
    for i in range(10):
        p.update(i + 1)
    p.done()
    assert capsys.readouterr().err == ""
    log.setLevel(logging.INFO)
    records = []

    class H(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())

    log.addHandler(H())
    p = Progress("expanding", 8, log, delay=0.0)
    for i in range(8):
        p.update(i + 1)
    assert records and records[-1].startswith("expanding: 8/8 nodes (100%)")  # not a tty: log lines
