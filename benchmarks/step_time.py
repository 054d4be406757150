"""Step time of compiled train steps against the hand-built wrappers, on real gloo processes.

For the same GPT, data, optimizer (AdamW) and plan, in one run:

    dp    compiled data parallel          vs DistributedDataParallel
    fsdp  compiled FSDP (fsdp_axes)       vs FSDP2 fully_shard (per block + root)
    tp    compiled Megatron TP            vs eager DTensor, parallelize_module (same styles)
    2d    compiled dp x tp                vs eager 2-D: parallelize_module on tp + DDP on dp

Median step time over --steps steps after --warmup steps, the ratio per pair (compiled /
peer; below 1 is faster), and bytes moved per rank per step by the compiled program
next to the analytic minimum for the plan. Timing runs on world size 2 (one process per
core on a 2-core machine; 2-D uses dp=1 x tp=2), bytes on world size 4 (2-D: 2 x 2).
Writes benchmarks/results/step_time.md. Usage:

    python benchmarks/step_time.py [--steps 20] [--layers 2] [--dim 128]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import spmd_compiler as sc  # noqa: E402
from spmd_compiler.runtime.launch import run_processes  # noqa: E402
from spmd_compiler.testing.models import GPT, GPTConfig, gpt_2d_plan, gpt_fsdp_plan, gpt_tp_plan, train_step  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "step_time.md"


def _cfg(args: Any) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers)


def _batch(step: int, args: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, args.vocab, (rows, args.seq), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}


def _peer(kind: str, model: torch.nn.Module, world: int, rank: int) -> torch.nn.Module:
    """The hand-built distributed model for ``kind``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "dp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    if kind == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        tp = mesh
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
    for block in model.blocks:
        parallelize_module(block, tp, _styles())
        block.attn.heads //= tp.size()  # local heads, as torchtitan does with parallelize_module
    if kind == "2d" and mesh["dp"].size() > 1:
        _sync_gradients_over(model, mesh["dp"].get_group())
    return model


def _sync_gradients_over(model: torch.nn.Module, group: Any) -> None:
    """Hand-written data parallel for the eager 2-D peer: average every gradient over the
    dp group (one all_reduce per parameter) right before the optimizer step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    size = dist.get_world_size(group)

    def hook(param: torch.Tensor) -> None:
        g = param.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        dist.all_reduce(local, group=group)
        local.div_(size)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)


def _worker(rank: int, world: int, kind: str, args: Any, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(_cfg(args))
    steps, warmup = args.steps, args.warmup
    times: list[float] = []
    out: dict[str, Any] = {}
    if mode == "compiled":
        plans = {"dp": (None, {"dp": world}), "fsdp": (gpt_fsdp_plan(), {"dp": world}), "tp": (gpt_tp_plan(), {"tp": world}),
                 "2d": (gpt_2d_plan(), {"dp": world // 2, "tp": 2})}
        plan, mesh = plans[kind]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = sc.compile(train_step, mesh=mesh, plan=plan)
        coord = None
        for i in range(warmup + steps):
            ids, tg = _batch(i, args, args.batch)
            if coord is None:
                coord = step.mesh.get_coordinate()
            if kind in ("dp", "fsdp"):
                ids, tg = ids.chunk(world)[rank], tg.chunk(world)[rank]
            elif kind == "2d":
                ids, tg = ids.chunk(world // 2)[coord[0]], tg.chunk(world // 2)[coord[0]]
            t0 = time.perf_counter()
            loss = step(model, opt, ids, tg)
            loss.item()
            times.append(time.perf_counter() - t0)
        summary = step.comm_summary()
        out["bytes"] = summary.total_bytes
        out["collectives"] = summary.total_count
        out["loss"] = float(loss)
    else:
        dmodel = _peer(kind, model, world, rank)
        opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-3)
        import torch.distributed as dist

        for i in range(warmup + steps):
            ids, tg = _batch(i, args, args.batch)
            if kind in ("dp", "fsdp"):
                ids, tg = ids.chunk(world)[rank], tg.chunk(world)[rank]
            elif kind == "2d":
                dp_rank = rank // 2
                ids, tg = ids.chunk(world // 2)[dp_rank], tg.chunk(world // 2)[dp_rank]
            t0 = time.perf_counter()
            loss = train_step(dmodel, opt, ids, tg)
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            loss.item()
            times.append(time.perf_counter() - t0)
        out["loss"] = float(loss)
    out["median"] = statistics.median(times[warmup:])
    return out


def _param_bytes(args: Any) -> dict[str, int]:
    model = GPT(_cfg(args))
    total = sum(p.numel() for p in model.parameters()) * 4
    tp_sharded = 0
    for name, p in model.named_parameters():
        if any(k in name for k in ("attn.q.", "attn.k.", "attn.v.", "fc.")) or name.endswith("attn.out.weight") or name.endswith("proj.weight"):
            tp_sharded += p.numel() * 4
    return {"total": total, "tp_sharded": tp_sharded}


def analytic_min(kind: str, args: Any, world: int) -> int:
    """Bytes of collective buffers per rank per step a hand-written program needs."""
    pb = _param_bytes(args)
    act = args.batch * args.seq * args.dim * 4  # one [B, T, D] float32 activation
    if kind == "dp":  # all_reduce every gradient, and the loss
        return pb["total"] + 4
    if kind == "fsdp":  # gather parameters once (kept for backward), reduce-scatter gradients
        return 2 * pb["total"] + 4
    if kind == "tp":  # Megatron: 2 all_reduces per block in forward and 2 in backward
        return 4 * args.layers * act
    dp = world // 2  # 2-D: TP on the local batch, then all_reduce of the local gradients over dp
    local_grads = pb["total"] - pb["tp_sharded"] + pb["tp_sharded"] // 2
    return 4 * args.layers * act // dp + local_grads + 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kinds", nargs="+", default=["dp", "fsdp", "tp", "2d"])
    args = p.parse_args()
    rows = []
    for kind in args.kinds:
        world_t = 4 if kind == "2d" else 2
        ours = run_processes(_worker, world_t, kind, args, "compiled", timeout=1800)[0]
        peer = run_processes(_worker, world_t, kind, args, "peer", timeout=1800)[0]
        bytes4 = run_processes(_worker, 4, kind, _short(args), "compiled", timeout=1800)[0]
        minimum = analytic_min(kind, args, 4)
        rows.append((kind, world_t, ours, peer, bytes4, minimum))
        print(f"{kind}: compiled {ours['median'] * 1e3:.1f} ms, peer {peer['median'] * 1e3:.1f} ms, "
              f"ratio {ours['median'] / peer['median']:.2f}; bytes {bytes4['bytes']} vs minimum {minimum}", flush=True)
    peers = {"dp": "DDP", "fsdp": "FSDP2 fully_shard", "tp": "eager DTensor TP", "2d": "eager DTensor TP + DDP"}
    head = "| plan | peer | world (timing) | compiled ms | peer ms | compiled / peer | collectives (world 4) | bytes/rank/step (world 4) | analytic minimum | bytes / minimum |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for kind, world_t, ours, peer, b4, minimum in rows:
        lines.append(
            f"| {kind} | {peers[kind]} | {world_t} | {ours['median'] * 1e3:.1f} | {peer['median'] * 1e3:.1f} | "
            f"{ours['median'] / peer['median']:.2f} | {b4['collectives']} | {b4['bytes']:,} | {minimum:,} | {b4['bytes'] / minimum:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    text = [
        "# Step time",
        "",
        f"`python benchmarks/step_time.py` on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, one thread per process.",
        f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, global batch {args.batch}, AdamW.",
        f"Median of {args.steps} steps after {args.warmup} warm-up steps; compiled and peer run the same model, data and plan in the same run.",
        "Bytes: sum of collective buffer sizes per rank per step of the compiled program (all_gather: its output; others: their input);",
        "the analytic minimum is what a hand-written program for the plan moves (see `analytic_min`).",
        "",
        table,
        "",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(text))
    print(f"wrote {RESULTS}")


def _short(args: Any) -> Any:
    import copy

    a = copy.copy(args)
    a.steps, a.warmup = 1, 1
    return a


if __name__ == "__main__":
    main()
