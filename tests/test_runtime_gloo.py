"""End-to-end on real gloo processes (4 ranks, forked): numerics on a 1-D and a 2x2
mesh, rank agreement, DCP.

These are the slowest tests (a few seconds each); keep them few and small.
Tolerance: float64, 1e-10 on loss and parameters.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
import torch

import spmd_compiler as sc
from gloo_launch import WorkerError, run_processes
from spmd_compiler.testing import assert_distributed
from spmd_compiler.testing.models import MLP, backward_step, megatron_mlp_plan, mse_train_step, optimizer_step

pytestmark = pytest.mark.gloo


def mse_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _data(step: int, batch: int = 8, dim: int = 16):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, dim, dtype=torch.float64, generator=g), torch.randn(batch, dim, dtype=torch.float64, generator=g)


def _numerics_and_agreement(rank: int, world: int) -> dict:
    out = {}
    sharded = {"dp": ["batch[0]", "batch[1]"], "fsdp": ["l1.weight", "l2.weight", "batch[0]"]}
    for name, plan in [("dp", None), ("fsdp", sc.Plan(params={"*": [sc.Shard(0)]}))]:
        torch.manual_seed(0)
        model = MLP().double()
        ref = copy.deepcopy(model)
        opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
        step = sc.compile(mse_step, mesh=(world,), plan=plan)
        errs = []
        for i in range(3):
            x, y = _data(i)
            loss = step(model, opt, x.chunk(world)[rank], y.chunk(world)[rank])
            errs.append(abs(loss.item() - mse_step(ref, ref_opt, x, y).item()))
        errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
        out[name] = max(errs)
        out[name + "_compiles"] = step.compiles
        # this rank's program holds its shards, at its own coordinate, and communicates
        out[name + "_comm"] = assert_distributed(step, sharded=sharded[name], collectives=1).collectives
    # rank 1 runs a different model: every rank must fail at compile, none may hang
    model = MLP().double() if rank != 1 else torch.nn.Sequential(MLP().double(), torch.nn.Tanh())
    step = sc.compile(mse_step, mesh=(world,))
    try:
        x, y = _data(0)
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), x.chunk(world)[rank], y.chunk(world)[rank])
        out["mismatch"] = None
    except sc.RankMismatchError as e:
        out["mismatch"] = str(e)
    return out


def _four_ranks(rank: int, world: int, ckpt: str) -> dict:
    """The 4-rank cases that need no fresh processes, in one launch, each on its own
    model and compiled step: the 2x2 mesh, the uninterrupted and the checkpointed DCP
    runs (the resumed run must be a restart: it has its own launch), then numerics and
    rank agreement (last: it ends with the rank mismatch)."""
    return {"two_d": _two_d(rank, world), "dcp_full": _train(rank, world, range(5), None, False),
            "dcp_first": _train(rank, world, range(3), ckpt, False), "numerics": _numerics_and_agreement(rank, world)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    return run_processes(_four_ranks, 4, ckpt, timeout=480), ckpt


def test_numerics_and_rank_agreement(four_ranks):
    results = [r["numerics"] for r in four_ranks[0]]
    for rank, res in enumerate(results):
        assert res["dp"] < 1e-10 and res["fsdp"] < 1e-10, res
        assert res["dp_compiles"] == 1 and res["fsdp_compiles"] == 1  # optimizer state created before the trace
        assert any(k.startswith("optimizer/all_reduce/") for k in res["dp_comm"]), res["dp_comm"]  # gradients reduced
        assert any(k.startswith("forward/all_gather/") for k in res["fsdp_comm"]), res["fsdp_comm"]  # parameters gathered
        assert res["mismatch"] is not None, f"rank {rank} did not detect the mismatch"
        assert "rank 1 compiled a different graph than ranks 0, 2, 3" in res["mismatch"] and "first difference at node" in res["mismatch"]


def _two_d(rank: int, world: int) -> dict:
    """Megatron MLP (tp) under data parallel (dp) on a 2x2 mesh, 3 steps of SGD with
    momentum against one device (not Adam: its update is nearly blind to a gradient's
    scale; gradients halved by a wrong reduction move its losses by 1e-7 only)."""
    torch.manual_seed(0)
    model = MLP(dim=8, hidden=16).double()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01) for m in (model, ref))
    step = sc.compile(mse_train_step, mesh={"dp": 2, "tp": 2}, plan=megatron_mlp_plan(ndim=2, axis=1))
    dp = step.mesh.get_coordinate()[0]
    losses = []
    for i in range(3):
        x, y = _data(i, dim=8)
        got = step(model, opt, x.chunk(2)[dp], y.chunk(2)[dp]).item()
        losses.append((got, mse_train_step(ref, ref_opt, x, y).item()))
    # tensors do not come back from a worker (their shared memory dies with it): errors do
    params = {n: ((p.full_tensor() - q).abs() / q.abs().clamp_min(1e-3)).max().item() for (n, p), q in zip(model.named_parameters(), ref.parameters())}
    local = {n: (tuple(p.to_local().shape), str(p.placements)) for n, p in model.named_parameters()}
    comms = {(r.phase, r.kind, r.axis) for r in step.comm_summary().rows}
    return {"losses": losses, "params": params, "local": local, "comms": comms, "coord": tuple(step.mesh.get_coordinate())}


def test_2x2_dp_tp_matches_one_device(four_ranks):
    results = [r["two_d"] for r in four_ranks[0]]
    assert sorted(r["coord"] for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, res in enumerate(results):
        for got, want in res["losses"]:
            assert got == pytest.approx(want, rel=1e-10, abs=1e-12), (rank, res["losses"])
        assert max(res["params"].values()) < 1e-10, (rank, res["params"])
        # split on tp (of 16x8, 16, 8x16), whole on dp
        assert res["local"] == {"l1.weight": ((8, 8), "(Replicate(), Shard(dim=0))"), "l1.bias": ((8,), "(Replicate(), Shard(dim=0))"),
                                "l2.weight": ((8, 8), "(Replicate(), Shard(dim=1))"), "l2.bias": ((8,), "(Replicate(), Replicate())")}
        # Megatron's one forward all_reduce on tp; the gradients and the loss on dp; nothing else
        assert res["comms"] == {("forward", "all_reduce", "tp"), ("optimizer", "all_reduce", "dp")}, res["comms"]  # the loss rides in the dp bucket


def _accumulation_over_calls(rank: int, world: int) -> dict:
    """Gradient accumulation over 4 calls of a compiled ``accumulate`` step, then a
    compiled ``apply`` step, twice, under DP and FSDP-style, against one device."""
    out = {}
    for name, plan in [("dp", None), ("fsdp", sc.Plan(params={"*": [sc.Shard(0)]}, fsdp_axes=(0,)))]:
        torch.manual_seed(0)
        model = MLP().double()
        ref = copy.deepcopy(model)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
        acc, app = sc.compile(backward_step, mesh=(world,), plan=plan), sc.compile(optimizer_step, mesh=(world,), plan=plan)
        errs, grads = [], []
        for i in range(6):  # calls 1-4 accumulate then apply; calls 5-6 accumulate
            x, y = _data(i)
            errs.append(abs(acc(model, opt, x.chunk(world)[rank], y.chunk(world)[rank]).item() - backward_step(ref, ref_opt, x, y).item()))
            g = model.l1.weight.grad  # what the user sees: a DTensor laid out like its parameter
            grads.append((type(g).__name__, str(g.placements), str(model.l1.weight.placements)))
            if i == 3:
                app(model, opt)
                optimizer_step(ref, ref_opt)
                errs.append(float(any(p.grad is not None for p in model.parameters())))
        for p, q in zip(model.parameters(), ref.parameters()):
            errs.append((p.full_tensor() - q).abs().max().item())
            errs.append((p.grad.full_tensor() - q.grad).abs().max().item())
        out[name] = max(errs)
        out[name + "_grads"] = grads
        out[name + "_compiles"] = (acc.compiles, app.compiles)
    # a gradient laid out otherwise than its parameter is refused before the program runs
    model.l1.weight.grad = model.l1.weight.grad.redistribute(placements=[sc.Replicate()])
    try:
        acc(model, opt, *(t.chunk(world)[rank] for t in _data(0)))
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_gradient_accumulation_over_calls():
    for res in run_processes(_accumulation_over_calls, 2, timeout=240):
        assert res["dp"] < 1e-10 and res["fsdp"] < 1e-10, res
        # accumulate compiles without and with gradients at the call (the momentum
        # buffers exist before the first trace); apply once
        assert res["dp_compiles"] == res["fsdp_compiles"] == (2, 1), res
        assert set(res["dp_grads"]) == {("DTensor", "(Replicate(),)", "(Replicate(),)")}, res["dp_grads"]
        assert set(res["fsdp_grads"]) == {("DTensor", "(Shard(dim=0),)", "(Shard(dim=0),)")}, res["fsdp_grads"]
        assert "expected a DTensor laid out like the parameter, placements [Shard(dim=0)]" in (res["refused"] or ""), res["refused"]


def _train(rank: int, world: int, steps: range, ckpt: str | None, load: bool) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0 if not load else 123)  # a resumed run starts from other weights
    model = MLP().double()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = sc.compile(mse_step, mesh=(world,), plan=sc.Plan(params={"l1.*": [sc.Shard(0)]}))
    if load:
        step.distribute(model, opt)
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    losses = []
    for i in steps:
        x, y = _data(i)
        losses.append(step(model, opt, x.chunk(world)[rank], y.chunk(world)[rank]).item())
    if ckpt and not load:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    return losses


def test_dcp_save_restart_resume(four_ranks):
    results, ckpt = four_ranks
    full, first = results[0]["dcp_full"], results[0]["dcp_first"]
    resumed = run_processes(_train, 4, range(3, 5), ckpt, True)[0]  # a restart: fresh processes
    assert first == pytest.approx(full[:3], abs=1e-12)
    assert resumed == pytest.approx(full[3:], abs=1e-12)


def _boom(rank, world):
    if rank == 2:
        raise ValueError("rank two fails")
    return rank


def test_worker_errors_are_reported():
    with pytest.raises(WorkerError, match="rank two fails"):
        run_processes(_boom, 4, timeout=60)


def test_local_functions_are_refused_with_a_fix():
    def local(rank, world):
        return rank

    with pytest.raises(TypeError, match="module level"):
        run_processes(local, 2, timeout=60)


def test_example_loss_parity(tmp_path):
    """The README's demo on 2 gloo processes, with numpy hidden: torch's wheel does not
    depend on numpy and neither does the library, so a fresh machine has none."""
    hidden = tmp_path / "no_numpy" / "numpy"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ModuleNotFoundError('numpy is hidden by the test', name='numpy')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(root, "examples", "train_gpt.py"), "--strategy", "dp", "--steps", "3", "--layers", "1", "--check"]
    path = os.pathsep.join([str(hidden.parent), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "single-device check" in proc.stdout and "PASS" in proc.stdout
    # and it was distributed: the printed summary has gradient all_reduces over dp
    assert re.search(r"^optimizer\s+all_reduce\s+dp\s+[1-9]", proc.stdout, re.M), proc.stdout[-3000:]
    assert "Failed to initialize NumPy" in proc.stderr  # the hiding worked
