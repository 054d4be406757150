"""Train a small GPT on synthetic data with spmd-compiler, on any number of processes.

    torchrun --standalone --nproc-per-node=4 examples/train_gpt.py --strategy 2d --check

Strategies (the same ``train_step``, a different plan each):
    dp    data parallel: parameters replicated, batch split over all ranks
    fsdp  FSDP: every parameter stored split along dim 0, batch split over all ranks
    tp    Megatron tensor parallel over all ranks: batch replicated
    2d    data parallel over "dp" x Megatron tensor parallel over "tp" (needs an even world)

Runs on CPU with gloo; on GPUs with NCCL the same script runs unchanged. With --check,
rank 0 also trains the same model on one device from the same initial weights and data
and compares the loss curves (float32; tolerance --tolerance, relative). Only public
API: the model, the plans and the batch split are written out here.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(y)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def train_step(model, optimizer, ids, targets):
    """Plain single-device code: forward, loss, backward, update."""
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def megatron(axis: int, ndim: int) -> dict:
    """Megatron TP on mesh axis ``axis``: q/k/v and fc split by output features, out and
    proj by input features (their outputs are summed across the axis)."""
    def on(p):
        placements = [Replicate()] * ndim
        placements[axis] = p
        return placements
    return {"blocks.*.[qkv].*": on(Shard(0)), "blocks.*.fc.*": on(Shard(0)),
            "blocks.*.out.weight": on(Shard(1)), "blocks.*.proj.weight": on(Shard(1))}


def mesh_and_plan(strategy: str, world: int) -> tuple[dict, sc.Plan]:
    if strategy == "dp":  # the default plan: parameters Replicate, batch Shard(0)
        return {"dp": world}, sc.Plan()
    if strategy == "fsdp":
        return {"dp": world}, sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",))
    if strategy == "tp":
        return {"tp": world}, sc.Plan(params=megatron(0, 1), default_input=[Replicate()])
    if world % 2:
        raise SystemExit(f"--strategy 2d needs an even number of processes, got {world}")
    return {"dp": world // 2, "tp": 2}, sc.Plan(params=megatron(1, 2), default_input=[Shard(0), Replicate()])


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


def global_batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (a noisy copy task), the same on every rank."""
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return ids, torch.roll(ids, shifts=-1, dims=1)


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
    model = GPT(args.vocab, args.seq, args.dim, args.heads, args.layers).to(device)
    reference = copy.deepcopy(model) if args.check and rank == 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = sc.compile(train_step, mesh=mesh_shape, plan=plan)

    # each rank passes its part of the batch: split on "dp", whole on "tp"
    dp = step.mesh.get_local_rank("dp") if "dp" in mesh_shape else 0
    parts = mesh_shape.get("dp", 1)
    # under `python -m spmd_compiler explain` the process group is a fake one: the steps
    # compile and are explained but do not run, so there is no loss to show
    explaining = dist.get_backend() == "fake"
    if rank == 0:
        print(f"spmd-compiler: {args.strategy} on mesh {mesh_shape} ({world} x {dist.get_backend()}), GPT {args.layers} layers x dim {args.dim}")
    losses, times = [], []
    for i in range(args.steps):
        ids, targets = (t.chunk(parts)[dp].to(device) for t in global_batch(i, args))
        start = time.perf_counter()
        loss = step(model, optimizer, ids, targets).item()
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if rank == 0 and not explaining:
            print(f"step {i:3d}  loss {loss:.4f}  {times[-1] * 1000:8.1f} ms{'  (compile)' if i == 0 else ''}", flush=True)

    ok = True
    if rank == 0 and not explaining:
        steady = sorted(times[1:]) or times
        print(f"median step time after the first: {steady[len(steady) // 2] * 1000:.1f} ms; programs compiled: {step.compiles}")
        print("collectives per rank per step:")
        print(step.comm_summary().table())
        if reference is not None:
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
            ref = [train_step(reference, ref_opt, *(t.to(device) for t in global_batch(i, args))).item() for i in range(args.steps)]
            worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))
            ok = worst <= args.tolerance
            print(f"single-device check: max relative loss difference {worst:.2e} over {args.steps} steps "
                  f"(tolerance {args.tolerance:.0e}): {'PASS' if ok else 'FAIL'}")
    if not explaining:
        status = torch.tensor([0 if ok else 1], device=device)  # NCCL moves device tensors only
        dist.broadcast(status, src=0)
        ok = status.item() == 0
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
