"""Scheduling for overlap (spmd_compiler/optimize/schedule.py): compute moves into the gap
between a collective and its wait, never across a mutation, a random op or a marker."""

from __future__ import annotations

import torch

import spmd_compiler as sc
from spmd_compiler.optimize import bucket_gradients_pass, overlap_pass, schedule_for_overlap_pass
from spmd_compiler.optimize.bucketing import gradient_reductions
from spmd_compiler.optimize.graph_utils import is_collective, is_wait, mutation_edges, positions
from spmd_compiler.testing import assert_distributed, assert_training_matches
from spmd_compiler.testing.models import GPT, MLP, gpt_tp_plan, mse_train_step, train_step

aten = torch.ops.aten


_TRACED: dict = {}


def _gpt_step(mesh, plan, rows=8):
    """A fresh expansion (the passes under test rewrite its graph in place) of a steady
    step traced once per module: expansion does not modify the traced step."""
    if rows not in _TRACED:
        model = GPT(vocab=64, seq=8, dim=32, heads=4, layers=2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        ids = torch.randint(0, 64, (rows, 8))
        train_step(model, opt, ids, ids)  # Adam state exists: the steady step
        _TRACED[rows] = sc.trace(train_step, model, opt, ids, ids)
    return sc.expand(_TRACED[rows], mesh, plan)


def _work_in_flight(gm):
    """For each collective: the compute nodes between it and its wait."""
    pos = positions(gm)
    out = {}
    nodes = list(gm.graph.nodes)
    for c in (n for n in nodes if is_collective(n)):
        w = next(u for u in c.users if is_wait(u))
        out[c] = [n for n in nodes[int(pos[c]) + 1 : int(pos[w])] if n.op == "call_function" and not is_collective(n)]
    return out


def test_tp_backward_all_reduces_overlap_weight_gradients():
    from spmd_compiler.testing import fake_mesh

    step = _gpt_step(fake_mesh((2,), ("tp",)), gpt_tp_plan())
    gm = overlap_pass(step.gm)
    backward = [c for c in gm.graph.nodes if is_collective(c) and c.meta["spmd_phase"] == "backward"]
    assert len(backward) == 4  # Megatron: one all_reduce per sub-layer in backward
    before = _work_in_flight(gm)
    schedule_for_overlap_pass(gm)
    after = _work_in_flight(gm)
    matmuls = [sum(n.target is aten.mm.default for n in after[c]) for c in backward]
    assert all(m >= 1 for m in matmuls), matmuls  # every one overlaps a weight-gradient matmul
    assert sum(len(after[c]) for c in backward) > sum(len(before[c]) for c in backward)
    moved = [n for n in gm.graph.nodes if "spmd_schedule" in n.meta]
    assert moved and "in flight" in moved[0].meta["spmd_schedule"]


def test_optimizer_updates_run_while_later_buckets_reduce(mesh4):
    step = _gpt_step(mesh4, sc.Plan(), rows=8)  # data parallel
    gm = bucket_gradients_pass(step.gm, bucket_mb=0.01, first_bucket_mb=0.004)
    gm = overlap_pass(gm)
    gm = schedule_for_overlap_pass(gm)
    pos = positions(gm)
    buckets = sorted(gradient_reductions(gm), key=lambda n: pos[n])
    assert len(buckets) >= 3
    last_wait = next(u for u in buckets[-1].users if is_wait(u))
    updates = [n for n in gm.graph.nodes if n.target is aten.addcdiv_.default]
    # parameters of the earlier buckets are updated before the last bucket has arrived
    assert 0 < sum(pos[u] < pos[last_wait] for u in updates) < len(updates)


def test_schedule_keeps_training_numerics(mesh4):
    batches = [(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)) for _ in range(3)]
    res = assert_training_matches(
        mse_train_step, MLP().double(), lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh4, sc.Plan(),
        passes=sc.optimize.default_passes(bucket_mb=0.0005, first_bucket_mb=0.0002),
    )
    assert_distributed(res, sharded=["batch[0]", "batch[1]"])
    gm = res.sim.expansions[(0,)].gm
    assert len(gradient_reductions(gm)) >= 2
    assert any("spmd_schedule" in n.meta for n in gm.graph.nodes)


def _graph(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def test_mutation_edges_order_reads_and_writes():
    def f(x, y):
        a = x * 2  # read of x before the write
        x.add_(y)  # write
        b = x + 1  # read after the write
        return a, b

    gm = _graph(f, torch.randn(3), torch.randn(3))
    preds = mutation_edges(gm)
    write = next(n for n in gm.graph.nodes if n.target is aten.add_.Tensor)
    read_before = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    read_after = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert read_before in preds[write]  # write-after-read
    assert write in preds[read_after] or write in read_after.all_input_nodes  # read-after-write


def test_nothing_moves_across_a_random_op(mesh4):
    """A dropout between two reductions is a fence: RNG draws stay in program order."""

    def f(x, w):
        h = torch.nn.functional.dropout(x @ w, p=0.5, training=True)
        return (h.sum(0) * 3).sum(), x.t() @ h

    from spmd_compiler.testing import assert_distributed, run_spmd
    from torch.distributed.tensor import Replicate, Shard

    from spmd_compiler.optimize import default_passes

    # the two output reductions stay apart (fuse_all_reduces would send them in one launch)
    passes = [p for p in default_passes() if p.name != "fuse_all_reduces"]
    run = run_spmd(f, [torch.randn(8, 4), torch.randn(4, 4)], mesh4, [[Shard(0)], [Replicate()]], passes=passes)
    assert_distributed(run, sharded=["batch[0]"], collectives={"all_reduce/dp": 2})  # the two reductions around the dropout
    gm = next(iter(run.steps.values())).gm
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    rand = [i for i, n in enumerate(order) if isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags]
    assert rand
    before = {n: i for i, n in enumerate(order)}
    schedule_for_overlap_pass(gm)
    after = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "call_function")}
    r = order[rand[0]]
    for n in order:  # no node changed sides of the random op
        assert (before[n] < before[r]) == (after[n] < after[r]) or n is r


def test_work_a_collective_needs_through_a_write_is_not_sunk(mesh4):
    """x @ w reads w itself, not the write's result: the write through a view of w is
    needed by the all_reduce of the matmul through mutation order alone."""
    from spmd_compiler.testing import assert_spmd_matches
    from torch.distributed.tensor import Shard

    def f(x, w):
        w[:, :1].add_(1)
        return x @ w  # Partial over the sharded inner dim: all_reduce

    x, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    run = assert_spmd_matches(f, [x, w], mesh4, [[Shard(1)], [Shard(0)]], atol=1e-12)
    gm = next(iter(run.steps.values())).gm
    pos = positions(gm)
    write = next(n for n in gm.graph.nodes if n.target is aten.add_.Tensor)
    assert all(pos[write] < pos[c] for c in gm.graph.nodes if is_collective(c))


def test_tp_updates_run_inside_backward_waits():
    """Megatron's backward all_reduces are waited at once; the AdamW updates of layers
    whose gradients are already final run inside those waits, not after backward."""
    from spmd_compiler.testing import fake_mesh

    step = _gpt_step(fake_mesh((2,), ("tp",)), gpt_tp_plan())
    gm = overlap_pass(step.gm)
    schedule_for_overlap_pass(gm, updates_into_waits=False)
    updates = [n for n in gm.graph.nodes if n.target is aten.addcdiv_.default]
    backward = [c for c in gm.graph.nodes if is_collective(c) and c.meta["spmd_phase"] == "backward"]
    pos = positions(gm)
    last_wait = max(pos[next(u for u in c.users if is_wait(u))] for c in backward)
    assert all(pos[u] > last_wait for u in updates)  # without it: every update after backward

    step = _gpt_step(fake_mesh((2,), ("tp",)), gpt_tp_plan())
    gm = schedule_for_overlap_pass(overlap_pass(step.gm))
    pos = positions(gm)
    in_flight = _work_in_flight(gm)
    inside = [u for c in backward for u in in_flight[next(b for b in gm.graph.nodes if b.name == c.name)] if u.target is aten.addcdiv_.default]
    updates = [n for n in gm.graph.nodes if n.target is aten.addcdiv_.default]
    assert 0 < len(inside) < len(updates), (len(inside), len(updates))
    assert "optimizer work that runs while" in inside[0].meta["spmd_schedule"]
    # an update never precedes a read of the parameter it writes
    preds = mutation_edges(gm)
    for u in updates:
        assert all(pos[p] < pos[u] for p in list(u.all_input_nodes) + list(preds.get(u, ())))


def test_updates_into_waits_keep_tp_numerics():
    from spmd_compiler.testing import fake_mesh

    mesh = fake_mesh((2,), ("tp",))
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2).double()
    batches = [(torch.randint(0, 32, (4, 8)),) * 2 for _ in range(3)]
    res = assert_training_matches(train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), batches, mesh, gpt_tp_plan(),
                                  passes=sc.optimize.default_passes())
    assert_distributed(res, sharded=["blocks.0.fc.weight"], collectives={"backward/all_reduce/tp": 4})
    gm = res.sim.expansions[(0,)].gm
    assert any("optimizer work that runs while" in n.meta.get("spmd_schedule", "") for n in gm.graph.nodes)


def _writes_while_in_flight(gm):
    """Nodes that write the storage a collective reads, between its issue and its wait
    (a race: gloo and NCCL read collective inputs asynchronously until the wait)."""
    from spmd_compiler.optimize.graph_utils import alias_root, written_inputs

    nodes = list(gm.graph.nodes)
    assert any(is_collective(c) for c in nodes), "no collective: nothing could be written while in flight"
    out = []
    for i, c in enumerate(nodes):
        if not is_collective(c):
            continue
        end = max(nodes.index(u) for u in c.users if is_wait(u))
        roots = {alias_root(x) for x in c.all_input_nodes}
        out += [(c.name, n.name) for n in nodes[i + 1 : end] if roots & {alias_root(x) for x in written_inputs(n)}]
    return out


def test_no_write_to_a_collective_input_while_it_is_in_flight(mesh4):
    """Under FSDP the backward re-gathers parameter shards; AdamW's weight decay scales
    the same shards and is ready early (it needs no gradient): it must wait for the gather."""
    model = MLP().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(8, 16, dtype=torch.float64)
    mse_train_step(model, opt, x, x)
    step = sc.expand(sc.trace(mse_train_step, model, opt, x, x), mesh4, sc.Plan(params={"*": [sc.Shard(0)]}))
    from spmd_compiler.optimize import default_passes, run_passes
    from spmd_compiler.testing import fake_mesh

    gm, _ = run_passes(step.gm, default_passes())
    assert any("optimizer work that runs while" in n.meta.get("spmd_schedule", "") for n in gm.graph.nodes)
    assert _writes_while_in_flight(gm) == []
    tp = schedule_for_overlap_pass(overlap_pass(_gpt_step(fake_mesh((2,), ("tp",)), gpt_tp_plan()).gm))
    assert _writes_while_in_flight(tp) == []
