"""compile(dynamic=True) across real processes (gloo): the ranks agree on the global batch
sizes in the step check (driver/sizes.py); one compile serves every batch size, equal to
one device. Plus the pure functions (global sizes, torch.chunk layout) without processes.

Tolerance: float64, 1e-10 on parameters after every step.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.driver.sizes import ShardedDim, global_sizes, sharded_dims
from gloo_launch import run_processes
from spmd_compiler.testing.models import MLP, megatron_mlp_plan

DIM = ShardedDim(leaf=0, dim=0, axis=0, path="batch[0]")


# ----------------------------------------------------------------------------- pure functions

def test_global_sizes_sum_the_ranks_of_the_axis():
    assert global_sizes([DIM], [((0,), [4]), ((1,), [3])], (2,)) == [7]
    assert global_sizes([DIM], [((0,), [3]), ((1,), [3]), ((2,), [1])], (3,)) == [7]
    assert global_sizes([DIM], [((0,), [1]), ((1,), [1]), ((2,), [0])], (3,)) == [2]  # an empty shard
    assert global_sizes([DIM], [((0,), [0]), ((1,), [0])], (2,)) == [0]
    # a 2x2 mesh, batch split over axis 0 only: each group of axis 0 holds the batch
    two_d = [((0, 0), [3]), ((0, 1), [3]), ((1, 0), [2]), ((1, 1), [2])]
    assert global_sizes([DIM], two_d, (2, 2)) == [5]


def test_a_batch_not_laid_out_as_torch_chunk_is_refused_naming_every_rank():
    with pytest.raises(ValueError) as e:
        global_sizes([DIM], [((0,), [1]), ((1,), [3])], (2,))
    msg = str(e.value)
    assert "rank 0: 1, rank 1: 3" in msg and "global 4" in msg and "[2, 2]" in msg and "fix:" in msg, msg
    with pytest.raises(ValueError, match=r"rank 0: 2, rank 1: 3, rank 2: 2"):  # tensor_split's layout, not chunk's
        global_sizes([DIM], [((0,), [2]), ((1,), [3]), ((2,), [2])], (3,))
    with pytest.raises(ValueError, match="different global sizes"):  # groups of the axis disagree
        global_sizes([DIM], [((0, 0), [3]), ((0, 1), [2]), ((1, 0), [2]), ((1, 1), [2])], (2, 2))


def test_sharded_dims_follow_the_plan():
    x, y = torch.zeros(4, 3), torch.zeros(4)
    dims = sharded_dims(sc.Plan(), (x, y), {}, 1)
    assert [(d.leaf, d.dim, d.axis, d.path) for d in dims] == [(0, 0, 0, "batch[0]"), (1, 0, 0, "batch[1]")]


def test_the_batch_size_of_a_sequence_sharded_leaf_is_a_dim_of_no_axis():
    """``Shard(1)``: dim 0 (the batch size) rides in the exchange, unsplit; every rank
    must hold the same size of it. The split sequence (dim 1) is static in the program:
    its local size stays in the signature (a new length compiles again)."""
    ids = torch.zeros(5, 4, dtype=torch.long)
    dims = sharded_dims(sc.Plan(default_input=[sc.Shard(1)]), (ids, ids), {}, 1)
    assert [(d.leaf, d.dim, d.axis) for d in dims] == [(0, 0, None), (1, 0, None)]
    # beside a batch split along dim 0 (DP x sequence): only the batch size
    dims = sharded_dims(sc.Plan(default_input=[sc.Shard(0), sc.Shard(1)]), (ids,), {}, 2)
    assert [(d.leaf, d.dim, d.axis) for d in dims] == [(0, 0, 0)]
    whole = ShardedDim(leaf=0, dim=0, axis=None, path="batch[0]")
    assert global_sizes([whole, DIM], [((0,), [5, 2]), ((1,), [5, 2])], (2,)) == [5, 4]
    with pytest.raises(ValueError, match=r"sizes \[3, 5\] in dim 0.*fix:"):
        global_sizes([whole], [((0,), [5]), ((1,), [3])], (2,))


def test_a_replicated_batch_size_is_a_dim_of_no_axis_unless_another_leaf_is_split():
    """Tensor parallel (the batch replicated): dim 0 of every leaf rides in the exchange,
    unsplit. Beside a batch split on dim 0, a replicated leaf is an extra input (class
    weights, a mask): its size stays static."""
    x, w = torch.zeros(5, 3), torch.zeros(7)
    dims = sharded_dims(sc.Plan(default_input=[sc.Replicate()]), (x, x), {}, 1)
    assert [(d.leaf, d.dim, d.axis) for d in dims] == [(0, 0, None), (1, 0, None)]
    dims = sharded_dims(sc.Plan(inputs={"batch[1]": [sc.Replicate()]}), (x, w), {}, 1)
    assert [(d.leaf, d.dim, d.axis) for d in dims] == [(0, 0, 0)]


# ----------------------------------------------------------------------------- gloo

def mse_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def branching_step(model, optimizer, x, y):
    out = model(x)
    if x.shape[0] == 6:  # pins this size: its own program, the others share one
        out = out * 2
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def threshold_step(model, optimizer, x, y):
    out = model(x)
    if x.shape[0] > 4:  # a guard on the size (4 < s or s <= 4), not a pin: both sides stay symbolic
        out = out * 2
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """torch.chunk's piece of rank ``rank`` (empty past the end)."""
    c = -(-t.shape[0] // world)
    return t[min(rank * c, t.shape[0]) : min((rank + 1) * c, t.shape[0])]


def _train(rank: int, world: int, fn, sizes, replicated: bool = False, **options) -> dict:
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    # plain SGD: no optimizer state appears after the first step (that would be a second compile)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = sc.compile(fn, mesh=(world,), dynamic=True, **options)
    errs = []
    for i, b in enumerate(sizes):
        g = torch.Generator().manual_seed(100 + i)
        x, y = (torch.randn(b, 16, dtype=torch.float64, generator=g) for _ in range(2))
        loss = step(model, opt, x, y) if replicated else step(model, opt, _rows(x, rank, world), _rows(y, rank, world))
        errs.append(abs(loss.item() - fn(ref, ref_opt, x, y).item()))
        errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    return {"err": max(errs), "compiles": step.compiles, "checks": dict(step.checks), "programs": len(step._programs),
            "size_inputs": sum(n.op == "placeholder" and n.name.startswith("size_") for n in step.last.gm.graph.nodes)}


def _replicated(plan: sc.Plan) -> sc.Plan:
    """``plan`` with every batch tensor Replicate: each rank passes the whole batch (with
    the default Shard(0) that would be every rank passing the global batch, refused)."""
    return dataclasses.replace(plan, default_input=[sc.Replicate()])


def _two_ranks(rank: int, world: int) -> dict:
    logs: list[tuple[str, str]] = []
    handler = logging.Handler()
    handler.emit = lambda r: logs.append((r.name, r.getMessage()))  # type: ignore[method-assign]
    logging.getLogger("spmd_compiler").addHandler(handler)  # INFO: the compile's logs run too
    logging.getLogger("spmd_compiler").setLevel(logging.INFO)
    out = {"train": _train(rank, world, mse_step, [8, 5, 3, 8, 1, 7])}
    out["tp"] = _train(rank, world, mse_step, [8, 5, 3, 1, 7], replicated=True, plan=_replicated(megatron_mlp_plan()))  # the batch replicated
    del logs[:]
    out["branch"] = _train(rank, world, branching_step, [6, 5, 7, 6, 9])
    out["branch_logs"] = [m for name, m in logs if name == "spmd_compiler.driver.dynamic"]
    del logs[:]
    out["threshold"] = _train(rank, world, threshold_step, [8, 3, 2, 8, 3])
    out["threshold_logs"] = [m for _, m in logs if "agreeing on the program anew" in m or "kept beside" in m]
    out["threshold_one"] = _train(rank, world, threshold_step, [8, 3, 8], cache_size=1)  # room for one program
    # rank 0 holds 1 row, rank 1 holds 3: not torch.chunk's layout of 4 rows
    torch.manual_seed(0)
    model = MLP().double()
    step = sc.compile(mse_step, mesh=(world,), dynamic=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)  # each rank its own rows (equal rows on every rank would be the global batch copied)
    step(model, opt, torch.randn(2, 16, dtype=torch.float64), torch.randn(2, 16, dtype=torch.float64))
    rows = 1 if rank == 0 else 3
    try:
        step(model, opt, torch.randn(rows, 16, dtype=torch.float64), torch.randn(rows, 16, dtype=torch.float64))
        out["layout"] = None
    except ValueError as e:
        out["layout"] = str(e)
    return out


def test_two_ranks_one_compile_serves_every_batch_size():
    for rank, res in enumerate(run_processes(_two_ranks, 2, timeout=400)):
        train = res["train"]
        assert train["err"] < 1e-10, (rank, train)
        assert train["compiles"] == 1, (rank, train)  # 8, 5, 3, 8, 1, 7: one program
        assert train["size_inputs"] == 1, train
        assert train["checks"] == {"standalone": 5}, train  # no resync: a new size reuses the program
        tp = res["tp"]  # Megatron TP, the batch replicated: its size is a symbol too
        assert tp["err"] < 1e-10 and tp["compiles"] == 1 and tp["size_inputs"] == 1, (rank, tp)
        # the branch on the size: 6 gets its own program (one INFO log), 5 a symbolic one serving 7 and 9
        branch = res["branch"]
        assert branch["err"] < 1e-10 and branch["compiles"] == 2, (rank, branch)
        assert len(res["branch_logs"]) == 1 and "one program per batch shape" in res["branch_logs"][0], res["branch_logs"]
        # 8 compiles (guard 4 < s); 3 breaks it on every rank and compiles a second program
        # (guard s <= 4) kept beside the first; 2 reuses it; 8 and 3 each pick theirs again:
        # 2 compiles, not 4 (a resync per switch, no compile)
        threshold = res["threshold"]
        assert threshold["err"] < 1e-10 and threshold["compiles"] == 2 and threshold["programs"] == 2, (rank, threshold)
        logs = res["threshold_logs"]
        assert sum("break a size guard" in m and "agreeing on the program anew" in m for m in logs) == 3, logs
        assert sum("kept beside 1 other" in m for m in logs) == 1, logs
        # cache_size=1 bounds them: the second evicts the first, which 8 compiles again
        one = res["threshold_one"]
        assert one["err"] < 1e-10 and one["compiles"] == 3 and one["programs"] == 1, (rank, one)
        msg = res["layout"]
        assert msg is not None and "rank 0: 1, rank 1: 3" in msg and "fix:" in msg, (rank, msg)


def _three_ranks(rank: int, world: int) -> dict:
    return _train(rank, world, mse_step, [9, 7, 2, 1, 6])  # 3,3,1 and 1,1,0 and 1,0,0


def test_three_ranks_uneven_and_empty_shards():
    for rank, res in enumerate(run_processes(_three_ranks, 3, timeout=400)):
        assert res["err"] < 1e-10 and res["compiles"] == 1, (rank, res)


def _sequence_ranks(rank: int, world: int) -> dict:
    """The batch split along the sequence (``Shard(1)``): B varies freely, a new sequence
    length compiles again; equal to one device after every step."""
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = sc.compile(mse_step, mesh=(world,), dynamic=True, plan=sc.Plan(default_input=[sc.Shard(1)]))
    errs, compiles = [], []
    for i, (b, t) in enumerate([(5, 4), (3, 4), (2, 6), (4, 4), (1, 6), (3, 5)]):
        g = torch.Generator().manual_seed(100 + i)
        x, y = (torch.randn(b, t, 16, dtype=torch.float64, generator=g) for _ in range(2))
        mine = [_rows(v.transpose(0, 1), rank, world).transpose(0, 1).contiguous() for v in (x, y)]  # torch.chunk's piece of T
        loss = step(model, opt, *mine)
        errs.append(abs(loss.item() - mse_step(ref, ref_opt, x, y).item()))
        errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
        compiles.append(step.compiles)
    return {"err": max(errs), "compiles": compiles,
            "size_inputs": sum(n.op == "placeholder" and n.name.startswith("size_") for n in step.last.gm.graph.nodes)}


def test_two_ranks_sequence_split_one_program_per_sequence_length():
    for rank, res in enumerate(run_processes(_sequence_ranks, 2, timeout=400)):
        assert res["err"] < 1e-10, (rank, res)
        # T = 4 (B 5, 3), 6, back to 4 (its program kept: no compile), 6 again, then 5 (uneven over 2 ranks)
        assert res["compiles"] == [1, 1, 2, 2, 2, 3], (rank, res)
        assert res["size_inputs"] == 1, res  # B only


def _dumping_ranks(rank: int, world: int, root: str) -> dict:
    import json
    import os

    os.environ["SPMD_COMPILER_DUMP_RANKS"] = "all"  # rank 1 writes its own folder too
    train = _train(rank, world, threshold_step, [7, 8, 3], dump_dir=root)  # compiles at 7 (guard 4 < s) and at 3
    out = {"train": train, "dumps": []}
    for folder in sorted(p for p in os.listdir(root) if p.endswith(f"rank{rank}")):
        path = os.path.join(root, folder)
        meta = json.load(open(os.path.join(path, "meta.json")))
        out["dumps"].append({"sizes": open(os.path.join(path, "sizes.txt")).read(), "memory": meta["memory"]})
    return out


def test_dumps_of_a_dynamic_program_show_each_ranks_sizes_at_the_compiling_call(tmp_path):
    """compile(dynamic=True, dump_dir=...) on 2 gloo ranks dumps each symbolic program with
    the sizes of the call that compiled it: each rank's local size expression and value,
    and the memory trace at this rank's rows (rank 1 holds 3 of 7, not rank 0's 4)."""
    for rank, res in enumerate(run_processes(_dumping_ranks, 2, str(tmp_path), timeout=400)):
        train = res["train"]
        assert train["err"] < 1e-10 and train["compiles"] == 2, (rank, train)
        first, second = res["dumps"]
        assert "| last call: 7" in first["sizes"] and "| last call: 3" in second["sizes"], res["dumps"]
        mine = "  <- this program"
        first["sizes"], second["sizes"] = (re.sub(r"\bs\d+\b", "s", d["sizes"]) for d in (first, second))
        assert f"rank 0 (axis0=0): ceil(s/2) = 4{mine if rank == 0 else ''}\n" in first["sizes"], first["sizes"]
        assert f"rank 1 (axis0=1): s - ceil(s/2) = 3{mine if rank == 1 else ''}\n" in first["sizes"], first["sizes"]
        assert f"rank 1 (axis0=1): s - ceil(s/2) = 1{mine if rank == 1 else ''}\n" in second["sizes"], second["sizes"]
        rows = [(4, 3), (2, 1)]  # this rank's rows of 7 and of 3
        for dump, (r0, r1) in zip(res["dumps"], rows):
            local = r0 if rank == 0 else r1
            assert dump["memory"]["input_bytes"]["batch"] == 2 * local * 16 * 8, (rank, dump["memory"])
            assert re.fullmatch(rf"batch sizes of the call: s\d+ = {7 if r0 == 4 else 3} \(this rank: u\d+ = {local}\)",
                                dump["memory"]["at"]), dump
