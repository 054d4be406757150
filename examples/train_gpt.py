"""Train a small GPT on synthetic data with spmd-compiler, on any number of processes.

    torchrun --standalone --nproc-per-node=4 examples/train_gpt.py --strategy 2d --check

Strategies (same ``train_step``, different plans):
    dp    data parallel: parameters replicated, batch split over all ranks
    fsdp  FSDP-style: every parameter split along dim 0, batch split over all ranks
    tp    Megatron tensor parallel over all ranks: batch replicated
    2d    data parallel over "dp" x Megatron tensor parallel over "tp" (needs an even world)

Runs on CPU with gloo; on GPUs with NCCL the same script runs unchanged. With --check,
rank 0 also trains the same model on one device from the same initial weights and data
and compares the loss curves (float32; tolerance --tolerance, relative).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler
from spmd_compiler.testing.models import GPT, GPTConfig, gpt_2d_plan, gpt_fsdp_plan, gpt_tp_plan, train_step


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=["dp", "fsdp", "tp", "2d"], default="2d")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with a single-device run on rank 0")
    p.add_argument("--tolerance", type=float, default=1e-3, help="max relative loss difference for --check")
    return p.parse_args()


def mesh_and_plan(strategy: str, world: int):
    if strategy == "dp":
        return {"dp": world}, spmd_compiler.Plan()
    if strategy == "fsdp":
        return {"dp": world}, gpt_fsdp_plan()
    if strategy == "tp":
        return {"tp": world}, gpt_tp_plan()
    if world % 2:
        raise SystemExit(f"--strategy 2d needs an even number of processes, got {world}")
    return {"dp": world // 2, "tp": 2}, gpt_2d_plan()


def batch_for_step(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: a noisy copy task, the same on every rank."""
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.roll(ids, shifts=-1, dims=1)
    return ids, targets


def local_shard(t: torch.Tensor, placements, mesh) -> torch.Tensor:
    """This rank's piece of a global batch tensor under ``placements``."""
    coord = mesh.get_coordinate()
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            t = t.tensor_split(mesh.size(axis), dim=p.dim)[coord[axis]]
    return t


def main() -> int:
    args = parse()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    mesh_shape, plan = mesh_and_plan(args.strategy, world)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers)
    model = GPT(cfg).to(device)
    reference = copy.deepcopy(model) if args.check and rank == 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step = spmd_compiler.compile(train_step, mesh=mesh_shape, plan=plan)
    mesh = step.mesh
    input_placements = plan.default_input or ([Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    if args.strategy in ("dp", "fsdp"):
        input_placements = [Shard(0)] * mesh.ndim

    # under `python -m spmd_compiler explain` the process group is a fake one: the steps
    # compile and are dumped but do not run (they return zeros), so there is no loss to show
    explaining = dist.get_backend() == "fake"
    if rank == 0:
        print(f"spmd-compiler: {args.strategy} on mesh {mesh_shape} ({world} x {dist.get_backend()}), GPT {args.layers} layers x dim {args.dim}")
    losses, times = [], []
    for i in range(args.steps):
        ids, targets = batch_for_step(i, args)
        ids = local_shard(ids, input_placements, mesh).to(device)
        targets = local_shard(targets, input_placements, mesh).to(device)
        start = time.perf_counter()
        loss = step(model, optimizer, ids, targets)
        value = float(loss)
        elapsed = time.perf_counter() - start
        losses.append(value)
        times.append(elapsed)
        if rank == 0 and not explaining:
            note = " (compile)" if i < 2 else ""
            print(f"step {i:3d}  loss {value:.4f}  step time {elapsed * 1000:8.1f} ms{note}", flush=True)

    if explaining:
        dist.destroy_process_group()
        return 0
    ok = True
    if rank == 0:
        steady = sorted(times[2:]) or times
        print(f"median step time after warm-up: {steady[len(steady) // 2] * 1000:.1f} ms; compiles: {step.compiles}")
        print("collectives per rank per step (last graph):")
        print(step.comm_summary().table())
        if reference is not None:
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
            ref_losses = []
            for i in range(args.steps):
                ids, targets = batch_for_step(i, args)
                ref_losses.append(train_step(reference, ref_opt, ids.to(device), targets.to(device)).item())
            worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
            ok = worst <= args.tolerance
            print(f"single-device check: max relative loss difference {worst:.2e} over {args.steps} steps "
                  f"(tolerance {args.tolerance:.0e}): {'PASS' if ok else 'FAIL'}")
    status = torch.tensor([0 if ok else 1], device=device)  # NCCL only moves device tensors
    dist.broadcast(status, src=0)
    dist.destroy_process_group()
    return int(status.item())


if __name__ == "__main__":
    sys.exit(main())
