"""All-or-nothing checkpoint loads (spmd_compiler/driver/checkpoint.py) on 2 real gloo
ranks: a truncated shard file and one whose tail is zeroed each raise one CheckpointError
naming the file, with the live model and optimizer (a fresh optimizer too) untouched; an
intact checkpoint loads bit for bit, resharded from an FSDP plan to a DP one."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.testing.models import MLP, mse_train_step

pytestmark = pytest.mark.gloo

FSDP = sc.Plan(params={"*": [sc.Shard(0)]}, fsdp_axes=(0,))


def _data(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 16, dtype=torch.float64, generator=g), torch.randn(8, 16, dtype=torch.float64, generator=g)


def _trained(rank: int, world: int, seed: int, steps: int, plan, fresh_optimizer: bool = False):
    torch.manual_seed(seed)
    model = MLP().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = sc.compile(mse_train_step, mesh=(world,), plan=plan)
    for i in range(steps):
        x, y = _data(i + seed)
        step(model, opt, x.chunk(world)[rank], y.chunk(world)[rank])
    if fresh_optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt, step


def _full(model, opt) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in model.state_dict().items()}
    for p, state in opt.state.items():
        name = next(n for n, q in model.named_parameters() if q is p)
        for k, v in state.items():
            out[f"optim.{name}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _damage(src: str, dst: str, how: str) -> None:
    shutil.copytree(src, dst)
    shards = sorted(n for n in os.listdir(dst) if n.endswith(".distcp"))
    name = os.path.join(dst, shards[0] if how == "truncate" else shards[-1])
    size = os.path.getsize(name)
    with open(name, "r+b") as f:
        if how == "truncate":
            f.truncate(size // 2)
        else:  # same size, the last 64 bytes zeroed (a zip's central directory)
            f.seek(size - 64)
            f.write(b"\0" * 64)


def _worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    ckpt = os.path.join(root, "ckpt")
    model, opt, step = _trained(rank, world, 0, 2, FSDP)
    step.save_checkpoint(model, opt, ckpt)
    saved = _full(model, opt)
    if rank == 0:
        _damage(ckpt, os.path.join(root, "truncated"), "truncate")
        _damage(ckpt, os.path.join(root, "zeroed"), "zero")
    dist.barrier()
    out: dict = {}
    for damaged in ("truncated", "zeroed"):
        for fresh in (False, True):
            other, other_opt, other_step = _trained(rank, world, 1, 1, FSDP, fresh_optimizer=fresh)
            before = _full(other, other_opt)
            try:
                other_step.load_checkpoint(other, other_opt, os.path.join(root, damaged))
                out[(damaged, fresh)] = ("loaded", None)
            except sc.CheckpointError as e:
                out[(damaged, fresh)] = (str(e), e.files)
            out[(damaged, fresh, "untouched")] = _same(before, _full(other, other_opt)) and (not fresh or not other_opt.state)
    # the intact one: bit for bit, resharded from FSDP to DP (replicated parameters)
    other, other_opt, other_step = _trained(rank, world, 1, 1, None)
    other_step.load_checkpoint(other, other_opt, ckpt)
    out["roundtrip"] = _same(saved, _full(other, other_opt))
    out["placements"] = {str(p.placements) for p in other.parameters()}
    x, y = _data(7)  # and it trains on: one more step equals the saved run's
    out["next"] = (other_step(other, other_opt, x.chunk(world)[rank], y.chunk(world)[rank]).item(),
                   step(model, opt, x.chunk(world)[rank], y.chunk(world)[rank]).item())
    return out


def test_damaged_checkpoint_leaves_the_model_untouched_and_an_intact_one_loads_exactly(tmp_path):
    for res in run_processes(_worker, 2, str(tmp_path), timeout=300):
        for damaged, file in (("truncated", "__0_0.distcp"), ("zeroed", "__1_0.distcp")):
            for fresh in (False, True):
                message, files = res[(damaged, fresh)]
                assert files == [file], (damaged, fresh, message)
                assert f"cannot load checkpoint {tmp_path / damaged} (damaged: {file})" in message
                assert "Nothing was loaded" in message and "fix: load an intact checkpoint" in message
                assert res[(damaged, fresh, "untouched")], (damaged, fresh)
        assert res["roundtrip"]
        assert res["placements"] == {"(Replicate(),)"}
        assert res["next"][0] == res["next"][1]


FUSED = sc.Plan(params={"l1.weight": [sc.fused_shard(0, 2)], "l1.bias": [sc.fused_shard(0, 2)], "l2.weight": [sc.fused_shard(1, 2)]},
                default_input=[sc.Replicate()])


def _fused_round_trip(rank: int, world: int, path: str) -> dict:
    """Megatron's MLP with ``fused_shard`` weights (each rank two separate ranges of a
    weight: DCP refused to save them, "overlapping chunks"): 2 steps, saved; a model with
    other weights loads it; the checkpoint read back whole on one device is the one-device
    model trained alike, and loaded under a DP plan too."""
    torch.manual_seed(0)
    model = MLP().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = sc.compile(mse_train_step, mesh=(world,), plan=FUSED, progress=False)
    for i in range(2):
        x, y = _data(i)
        step(model, opt, x, y)
    step.save_checkpoint(model, opt, path)
    live = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    state = [s["exp_avg"].to_local().clone() for s in opt.state.values()]
    out = {}
    for name, plan in (("fused", FUSED), ("dp", sc.Plan())):
        torch.manual_seed(1)
        other = MLP().double()
        other_opt = torch.optim.AdamW(other.parameters(), lr=0.01)
        sc.compile(mse_train_step, mesh=(world,), plan=plan, progress=False).load_checkpoint(other, other_opt, path)
        out[name] = {k: v.full_tensor() if name == "dp" else v.to_local() for k, v in other.state_dict().items()}
        if name == "fused":
            out["same"] = all(torch.equal(out[name][k], live[k]) for k in live)
            out["state"] = all(torch.equal(s["exp_avg"].to_local(), t) for s, t in zip(other_opt.state.values(), state))
    return {"same": out["same"], "state": out["state"], "dp": {k: v.tolist() for k, v in out["dp"].items()}}


def test_fused_shard_weights_save_and_load_as_the_whole_tensor(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_processes(_fused_round_trip, 2, path, timeout=300)
    torch.manual_seed(0)
    ref = MLP().double()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for i in range(2):
        mse_train_step(ref, ref_opt, *_data(i))
    for rank, res in enumerate(results):
        assert res["same"] and res["state"], (rank, res["same"], res["state"])  # bit for bit back into the fused layout
        for k, v in ref.state_dict().items():  # the checkpoint holds the global tensors (loaded under DP: whole on every rank)
            got = torch.tensor(res["dp"][k], dtype=torch.float64)
            assert torch.allclose(got, v, atol=1e-12, rtol=0), (rank, k, (got - v).abs().max())
