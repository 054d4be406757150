"""Peak-memory passes: rematerialized activations, prefetch within the peak (spmd_compiler/optimize/memory.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.dump import memory_trace
from spmd_compiler.optimize import PassSpec, default_passes, run_passes
from spmd_compiler.optimize.graph_utils import is_collective, is_wait, positions, prep_chain
from spmd_compiler.optimize.live_bytes import LiveBytes
from spmd_compiler.optimize.memory import _storage_last_use
from spmd_compiler.optimize.overlap import is_param_gather
from spmd_compiler.testing import assert_training_matches, fake_mesh
from spmd_compiler.testing.models import GPT, GPTConfig, gpt_fsdp_plan, train_step

MiB = 1 << 20
aten = torch.ops.aten


def _passes(*, skip=(), backend="gloo"):
    """The default passes, the budget counting ``backend``'s staging buffers (the benchmark's gloo)."""
    out = [PassSpec(p.name, p.fn, {"backend": backend}) if p.name == "budget_prefetch" else p for p in default_passes()]
    return [p for p in out if p.name not in skip]


@pytest.fixture(scope="module")
def bench_steps():
    """The per-rank FSDP programs of benchmarks/memory.py (GPT 2 x 128, vocab 512, seq 64,
    global batch 8, world 2), before the passes, for both reshard settings."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=512, seq=64, dim=128, heads=4, layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (8, 64))
    train_step(model, opt, ids, ids)  # AdamW state
    traced = sc.trace(train_step, model, opt, ids, ids)
    mesh = fake_mesh((2,), ("dp",))
    return {r: sc.expand(traced, mesh, gpt_fsdp_plan(reshard_after_forward=r)) for r in (True, False)}


def _peak(step, passes):
    gm, _ = run_passes(copy.deepcopy(step.gm), passes)
    return gm, memory_trace(gm, backend="gloo")


def test_benchmark_fsdp_static_peak_drops(bench_steps):
    # before these passes: 10.7 MiB (reshard_after_forward=True, at block 1's gelu_backward,
    # block 0's gather and its gloo staging held through block 1's backward) and 11.1 MiB
    # (False, at the loss's backward, both blocks' gelu outputs saved)
    old = {r: _peak(s, _passes(skip=("rematerialize", "budget_prefetch")))[1].peak_bytes for r, s in bench_steps.items()}
    assert old[True] > 10.6 * MiB and old[False] > 11.0 * MiB
    new = {}
    for r, step in bench_steps.items():
        gm, trace = _peak(step, _passes())
        new[r] = trace.peak_bytes
        # no saved gelu output lives into backward: each block computes it again there
        remat = [n for n in gm.graph.nodes if "spmd_remat" in n.meta and n.target is aten.gelu.default]
        assert len(remat) == 2 and all(n.meta["spmd_phase"] == "backward" for n in remat)
        assert not any(v.what == "forward gelu.default" for v in trace.at_peak)
    assert new[True] < 9.0 * MiB  # 8.9 MiB
    assert new[False] < 10.2 * MiB  # 10.1 MiB
    assert new[True] <= 0.84 * old[True] and new[False] <= 0.92 * old[False]


def test_budget_prefetch_keeps_collective_order_and_delays_only_where_the_peak_rises(bench_steps):
    step = bench_steps[True]
    before, unbudgeted = _peak(step, _passes(skip=("budget_prefetch",)))
    after, trace = _peak(step, _passes())
    assert trace.peak_bytes < unbudgeted.peak_bytes

    def order(gm):
        return [n.name for n in gm.graph.nodes if is_collective(n)]

    # the gathers keep their order among themselves; one moved past a gradient bucket's
    # reduce_scatter (the same decision on every rank: it depends on collectives' order only)
    gathers = lambda names: [x for x in names if x.startswith("all_gather")]  # noqa: E731
    assert gathers(order(after)) == gathers(order(before))
    moved = [n for n in after.graph.nodes if "spmd_prefetch_budget" in n.meta]
    assert moved and all(is_param_gather(n) and n.meta["spmd_phase"] == "backward" for n in moved)
    pos = positions(after)
    for g in (n for n in after.graph.nodes if is_collective(n) and is_param_gather(n)):
        (w,) = [u for u in g.users if is_wait(u)]
        assert pos[g] < pos[w]
    # where the budget held a block's gather back, issuing it one node earlier raises the static
    # peak (the root unit's was held in the first sweep against the peak of then, higher)
    held = [n for n in moved if "earlier would raise the peak" in n.meta["spmd_prefetch_budget"]]
    assert {n.meta["spmd_param_gather"] for n in held} >= {"blocks.0", "blocks.1"}
    for g in (n for n in held if n.meta["spmd_param_gather"].startswith("blocks.")):
        movers = sorted(prep_chain(g), key=lambda c: positions(after)[c]) + [g]
        earlier, home = movers[0].prev, g.next
        for m in movers:
            earlier.prepend(m)
        assert memory_trace(after, backend="gloo").peak_bytes > trace.peak_bytes, g.name
        for m in movers:
            home.prepend(m)
    assert memory_trace(after, backend="gloo").peak_bytes == trace.peak_bytes


@pytest.mark.parametrize("reshard", [True, False])
def test_memory_passes_keep_training_numerics(reshard):
    # float64, tight: the rematerialized gelu is bitwise forward's, and moving a gather changes no value
    mesh = fake_mesh((2,), ("dp",))
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2).double()
    batches = [(torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))) for _ in range(3)]
    res = assert_training_matches(
        train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh,
        gpt_fsdp_plan(reshard_after_forward=reshard), passes=_passes(), atol=1e-12, rtol=1e-12,
    )
    gms = [step.gm for step in res.sim.expansions.values()]
    assert len(gms) == 2 and all(sum("spmd_remat" in n.meta for n in g.graph.nodes) >= 2 for g in gms)


def _before_budget(step):
    gm, _ = run_passes(copy.deepcopy(step.gm), _passes(skip=("budget_prefetch",)))
    return gm


def test_live_bytes_is_the_memory_trace_through_moves(bench_steps):
    """LiveBytes counts the program once and recounts only the nodes a move passes: after
    every move, its counts are a fresh memory trace's, node for node."""
    from spmd_compiler.optimize.memory import _to_latest

    gm = _before_budget(bench_steps[True])
    pos = positions(gm)
    gathers = [n for n in gm.graph.nodes if is_collective(n) and is_param_gather(n)]
    assert len(gathers) >= 4 and all(_to_latest(gm, g, pos) for g in gathers)  # as the pass starts: each block in one piece
    live = LiveBytes(gm, backend="gloo")
    assert live.live == memory_trace(gm, backend="gloo").live
    for g in gathers:  # each gather (its copy-in with it) to the earliest place its inputs allow, in 3 steps
        block = sorted(prep_chain(g), key=pos.__getitem__) + [g]
        hi = live.index[block[0]]
        assert live.order[hi : hi + len(block)] == block
        ready = max(live.index[a] for b in block for a in b.all_input_nodes if a not in block) + 1
        for at in sorted({hi - (hi - ready) // 3, hi - 2 * (hi - ready) // 3, ready} - {hi}, reverse=True):
            predicted, end = live.peak_if_moved(block, at), live.index[block[0]] + len(block)
            anchor = live.order[at]
            live.move(block, at)
            for m in block:
                anchor.prepend(m)
            trace = memory_trace(gm, backend="gloo")
            assert live.order == list(gm.graph.nodes) and live.live == trace.live and live.peak == trace.peak_bytes
            assert predicted == max(trace.live[at:end])


def test_budget_prefetch_counts_the_program_once(bench_steps, monkeypatch):
    """The pass's cost grows with the program, not with the program times its gathers:
    one walk of the graph (dump.memory.storages), no whole memory trace per try."""
    from spmd_compiler.dump import memory as dump_memory
    from spmd_compiler.optimize import live_bytes
    from spmd_compiler.optimize.memory import budget_prefetch_pass

    gm = _before_budget(bench_steps[True])
    calls = {"storages": 0, "memory_trace": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(live_bytes, "storages", counting("storages", dump_memory.storages))
    monkeypatch.setattr(dump_memory, "memory_trace", counting("memory_trace", dump_memory.memory_trace))
    out = budget_prefetch_pass(gm, backend="gloo")
    assert calls == {"storages": 1, "memory_trace": 0}
    assert any("earlier would raise the peak" in n.meta.get("spmd_prefetch_budget", "") for n in out.graph.nodes)


def test_rematerialize_counts_last_uses_once(bench_steps, monkeypatch):
    """Each recomputed activation updates the last uses of the storages it touches
    instead of recounting the whole program."""
    from spmd_compiler.optimize import memory as opt_memory

    gm, _ = run_passes(copy.deepcopy(bench_steps[False].gm), _passes(skip=("rematerialize", "budget_prefetch")))
    calls = []
    monkeypatch.setattr(opt_memory, "_storage_last_use", lambda *a: calls.append(1) or _storage_last_use(*a))
    out = opt_memory.rematerialize_pass(gm)
    assert sum("spmd_remat" in n.meta for n in out.graph.nodes) >= 2 and len(calls) == 1
