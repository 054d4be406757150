"""Step time of compiled train steps against the hand-built wrappers, on real gloo processes.

For the same GPT, data, optimizer (AdamW) and plan, in one run:

    dp    compiled data parallel          vs DistributedDataParallel
    fsdp  compiled FSDP (fsdp_axes)       vs FSDP2 fully_shard (per block + root)
    tp    compiled Megatron TP            vs eager DTensor, parallelize_module (same styles)
    2d    compiled dp x tp                vs eager 2-D: parallelize_module on tp + per-parameter
                                             gradient all_reduce over dp

**Paired timing.** Each process builds both sides (separate copies of the same model)
and alternates them step by step, swapping which goes first every step, so both see the
same machine state; a slow patch on a shared machine slows both. The figure quoted is
the median of the per-step ratios compiled / peer (below 1: compiled is faster), next to
each side's median step time. World size 2 for dp, fsdp and tp (one process per core on
a 2-core machine); 2-D needs 4 (2 x 2, two processes per core).

**Bytes.** Collective buffer bytes per rank per step of the compiled program on a world
of 4 (fake process group, compile only), next to the analytic minimum for the plan.

**Compute floor.** A third side in the rotation runs the compiled per-rank program with
every collective replaced by a local op of the same shape (`_without_collectives`): the
time of the plan's computation alone. peer / floor is the largest speedup any program
for the plan could show on this machine with these kernels, were communication free.

**Width sweep.** Eager DTensor's cost is per op, the compiled step's is mostly compute;
the TP pair is repeated at several model widths to show where the ratio goes.

``--profile`` adds where the compiled step's time goes (torch.profiler on rank 0).
Writes benchmarks/results/step_time.md.

**Strongest peers** (``--strong``, dp, tp and fsdp, world 2): our ``backend="eager"`` and
``backend="inductor"`` against DDP and DDP + ``torch.compile`` (dp), and a hand-written
Megatron TP without DTensor (tp; :mod:`peers`), FSDP2 and FSDP2 + ``torch.compile`` (fsdp),
all in one rotation; with ``--profile``
the inductor side's top ops. Writes benchmarks/results/step_time_inductor.md. Usage:

    python benchmarks/step_time.py [--steps 30] [--layers 2] [--dim 128] [--tp-dims 32 64 128 256] [--profile]
    python benchmarks/step_time.py --strong --kinds dp tp --layers 2 --dim 128 --steps 10 --profile
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import platform
import random
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # peers.py

import spmd_compiler as sc  # noqa: E402
from spmd_compiler.runtime.launch import run_processes  # noqa: E402
from spmd_compiler.testing.models import GPT, GPTConfig, gpt_2d_plan, gpt_fsdp_plan, gpt_tp_plan, train_step  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "step_time.md"
PEERS = {"dp": "DDP", "fsdp": "FSDP2 fully_shard", "tp": "eager DTensor TP", "2d": "eager DTensor TP + dp all_reduce"}
TIMING_WORLD = {"dp": 2, "fsdp": 2, "tp": 2, "2d": 4}


def _cfg(args: Any, dim: int | None = None) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, seq=args.seq, dim=dim or args.dim, heads=args.heads, layers=args.layers)


def _batch(step: int, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _plan(kind: str, world: int) -> tuple[Any, dict[str, int]]:
    return {
        "dp": (None, {"dp": world}),
        "fsdp": (gpt_fsdp_plan(reshard_after_forward=False), {"dp": world}),  # as its FSDP2 peer
        "tp": (gpt_tp_plan(), {"tp": world}),
        "2d": (gpt_2d_plan(), {"dp": world // 2, "tp": 2}),
    }[kind]


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}


def _peer(kind: str, model: torch.nn.Module, world: int) -> torch.nn.Module:
    """The hand-built distributed model for ``kind``."""
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
    dp group (one all_reduce per parameter) once it is accumulated."""
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


def _local_batch(kind: str, ids: torch.Tensor, tg: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind in ("dp", "fsdp"):
        return ids.chunk(world)[rank], tg.chunk(world)[rank]
    if kind == "2d":
        dp_rank = rank // 2
        return ids.chunk(world // 2)[dp_rank], tg.chunk(world // 2)[dp_rank]
    return ids, tg


def _without_collectives(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the per-rank program with every collective replaced by a local op of the same
    output shape (all_reduce: a copy; all_gather: the shard repeated; reduce_scatter: the first
    chunk). Its step time is the program's compute alone: the floor any implementation of the
    plan reaches with these kernels if communication cost nothing. Numbers it computes are wrong;
    only its time is used."""
    gm = copy.deepcopy(gm)
    g, aten, c10d = gm.graph, torch.ops.aten, torch.ops._c10d_functional
    for n in list(g.nodes):
        if n.op != "call_function" or getattr(n.target, "namespace", None) != "_c10d_functional":
            continue
        if n.target is c10d.wait_tensor.default:
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
            continue
        x = n.args[0]
        with g.inserting_before(n):
            if n.target is c10d.all_reduce.default:
                local = g.call_function(aten.clone.default, (x,))
            elif n.target is c10d.all_gather_into_tensor.default:
                local = g.call_function(aten.repeat.default, (x, [n.args[1]] + [1] * (x.meta["val"].dim() - 1)))
            elif n.target is c10d.reduce_scatter_tensor.default:
                chunk = g.call_function(aten.slice.Tensor, (x, 0, 0, x.meta["val"].shape[0] // n.args[2]))
                local = g.call_function(aten.clone.default, (chunk,))
            else:
                raise NotImplementedError(f"no local stand-in for {n.target}")
        local.meta = dict(n.meta)
        n.replace_all_uses_with(local)
        g.erase_node(n)
    g.lint()
    gm.recompile()
    return gm


def _pair_worker(rank: int, world: int, kind: str, args: Any, dim: int, profile: bool) -> dict[str, Any]:
    from spmd_compiler.runtime.executor import compile_runner

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(_cfg(args, dim))
    models = {"ours": copy.deepcopy(model), "floor": copy.deepcopy(model), "peer": _peer(kind, copy.deepcopy(model), world),
              "unguarded": copy.deepcopy(model), "standalone": copy.deepcopy(model)}
    opts = {side: torch.optim.AdamW(m.parameters(), lr=1e-3) for side, m in models.items()}
    plan, mesh = _plan(kind, world)
    steps = {side: sc.compile(train_step, mesh=mesh, plan=plan) for side in ("ours", "floor", "unguarded", "standalone")}
    steps["floor"].fold_guard = steps["standalone"].fold_guard = False  # the per-step check as its own all_reduce

    def run(side: str, i: int) -> float:
        ids, tg = _local_batch(kind, *_batch(i, args), world, rank)
        t0 = time.perf_counter()
        if side == "peer":
            loss = train_step(models[side], opts[side], ids, tg)
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        else:
            loss = steps[side](models[side], opts[side], ids, tg)
        loss.item()
        return time.perf_counter() - t0

    for i in range(2):  # compile the floor's step (first and steady AdamW state), then drop its collectives
        run("floor", i)
        run("unguarded", i)
    steps["floor"].last.runner = compile_runner(_without_collectives(steps["floor"].last.gm), guard=True)
    steps["unguarded"]._guard.group = None  # the same program without the per-step agreement check
    times: dict[str, list[float]] = {"ours": [], "peer": [], "floor": [], "unguarded": [], "standalone": []}
    sides = list(times)
    for i in range(args.warmup + args.steps):
        order = sides[:]  # a new order every step, the same on every rank: no side always follows the
        random.Random(i).shuffle(order)  # floor (whose missing collectives let the ranks drift apart)
        got = {side: run(side, i) for side in order}
        if i >= args.warmup:
            for side in sides:
                times[side].append(got[side])
    out: dict[str, Any] = {side: statistics.median(t) for side, t in times.items()}
    out["ratio"] = statistics.median(a / b for a, b in zip(times["ours"], times["peer"]))
    out["floor_ratio"] = statistics.median(a / b for a, b in zip(times["floor"], times["peer"]))
    out["guard_ratio"] = statistics.median(a / b for a, b in zip(times["ours"], times["unguarded"]))
    out["standalone_ratio"] = statistics.median(a / b for a, b in zip(times["standalone"], times["unguarded"]))
    out["unguarded_ratio"] = statistics.median(a / b for a, b in zip(times["unguarded"], times["peer"]))
    out["check"] = ", ".join(sorted(k for k in steps["ours"].checks if not k.startswith("resync")))  # the path the steps took
    out["compiles"] = steps["ours"].compiles
    if profile:
        out["profile"] = _profile(rank, lambda i: run("ours", i), args)
    return out


def _profile(rank: int, step: Any, args: Any) -> dict[str, float] | None:
    """Where one compiled step's time goes, in ms (rank 0): collective waits, matmuls,
    other ops, and the rest (Python between ops, allocation)."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    n = 5
    with profile(activities=[ProfilerActivity.CPU]) if rank == 0 else contextlib.nullcontext() as prof:
        wall = sum(step(args.warmup + args.steps + i) for i in range(n)) / n
    if rank != 0:
        return None
    cats = {"collective wait": 0.0, "matmul": 0.0, "other ops": 0.0}
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3 / n
        if "wait_tensor" in e.key or e.key.startswith("c10d::"):
            cats["collective wait"] += ms
        elif e.key in ("aten::mm", "aten::bmm", "aten::addmm"):
            cats["matmul"] += ms
        elif e.key.startswith(("aten::", "_c10d_functional::")):
            cats["other ops"] += ms
    cats["python and rest"] = max(0.0, wall * 1e3 - sum(cats.values()))
    cats["step (profiled)"] = wall * 1e3
    return cats


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


def compiled_bytes(kind: str, args: Any, world: int = 4) -> tuple[int, int]:
    """(collectives, bytes) per rank per step of the compiled program on a fake world."""
    from spmd_compiler.testing import fake_mesh

    torch.manual_seed(0)
    model = GPT(_cfg(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan, shape = _plan(kind, world)
    mesh = fake_mesh(tuple(shape.values()), tuple(shape))
    step = sc.compile(train_step, mesh=mesh, plan=plan, check_ranks=False)
    ids, tg = _local_batch(kind, *_batch(0, args), world, 0)
    step(model, opt, ids, tg)
    step(model, opt, ids, tg)  # the steady step (AdamW state exists)
    s = step.comm_summary()
    import torch.distributed as dist

    dist.destroy_process_group()
    return s.total_count, s.total_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kinds", nargs="+", default=["dp", "fsdp", "tp", "2d"])
    p.add_argument("--tp-dims", nargs="*", type=int, default=[32, 64, 128, 256])
    p.add_argument("--profile", action="store_true")
    p.add_argument("--strong", action="store_true", help="our eager and inductor backends against hand-written Megatron TP, "
                   "DDP and DDP + torch.compile (writes results/step_time_inductor.md)")
    p.add_argument("--out", default=None, help="where to write the table (default: results/step_time.md, "
                   "or results/step_time_inductor.md with --strong)")
    args = p.parse_args()
    if args.strong:
        args.out = args.out or str(RESULTS.with_name("step_time_inductor.md"))
        from peers import strong_main

        return strong_main(args)
    args.out = args.out or str(RESULTS)

    rows, profiles = [], {}
    for kind in args.kinds:
        world = TIMING_WORLD[kind]
        res = run_processes(_pair_worker, world, kind, args, args.dim, args.profile, timeout=3600)
        got = res[0]
        count, nbytes = compiled_bytes(kind, args)
        minimum = analytic_min(kind, args, 4)
        rows.append((kind, world, got, count, nbytes, minimum))
        if got.get("profile"):
            profiles[kind] = got["profile"]
        print(f"{kind}: compiled {got['ours'] * 1e3:.1f} ms, peer {got['peer'] * 1e3:.1f} ms, paired ratio {got['ratio']:.2f}, "
              f"compute floor {got['floor'] * 1e3:.1f} ms; "
              f"bytes {nbytes} vs minimum {minimum}", flush=True)
    sweep = []
    for dim in args.tp_dims:
        got = run_processes(_pair_worker, 2, "tp", args, dim, False, timeout=3600)[0]
        sweep.append((dim, got))
        print(f"tp dim {dim}: compiled {got['ours'] * 1e3:.1f} ms, eager {got['peer'] * 1e3:.1f} ms, speedup {1 / got['ratio']:.2f}x, "
              f"ceiling {1 / got['floor_ratio']:.2f}x", flush=True)

    head = ("| plan | peer | world (timing) | compiled ms | peer ms | compiled / peer (paired median) | "
            "compute floor ms | floor / peer | step check | with / without the check | standalone check / without | "
            "without the check / peer | collectives (world 4) | bytes/rank/step (world 4) | analytic minimum | bytes / minimum |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for kind, world, got, count, nbytes, minimum in rows:
        lines.append(
            f"| {kind} | {PEERS[kind]} | {world} | {got['ours'] * 1e3:.1f} | {got['peer'] * 1e3:.1f} | {got['ratio']:.2f} | "
            f"{got['floor'] * 1e3:.1f} | {got['floor_ratio']:.2f} | {got['check']} | {got['guard_ratio']:.3f} | "
            f"{got['standalone_ratio']:.3f} | {got['unguarded_ratio']:.2f} | "
            f"{count} | {nbytes:,} | {minimum:,} | {nbytes / minimum:.2f} |"
        )
    sweep_lines = ["| dim | compiled TP ms | eager DTensor TP ms | speedup (eager / compiled, paired median) | "
                   "compute floor ms | ceiling (eager / floor) |", "|---|---|---|---|---|---|"]
    for dim, got in sweep:
        sweep_lines.append(f"| {dim} | {got['ours'] * 1e3:.1f} | {got['peer'] * 1e3:.1f} | {1 / got['ratio']:.2f}x | "
                           f"{got['floor'] * 1e3:.1f} | {1 / got['floor_ratio']:.2f}x |")
    text = [
        "# Step time",
        "",
        f"`python benchmarks/step_time.py{''.join(' ' + a for a in sys.argv[1:])}` on {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, gloo, one thread per process.",
        f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, global batch {args.batch}, AdamW.",
        f"Compiled and peer alternate step by step in the same processes, in an order shuffled every step ({args.warmup} warm-up steps, then {args.steps} rounds);",
        "the ratio is the median of the per-step ratios. Bytes: sum of collective buffer sizes per rank per step of the compiled",
        "program (all_gather: its output; others: their input) against what a hand-written program for the plan moves (`analytic_min`).",
        "Compute floor: the same compiled per-rank program with every collective replaced by a local op of the same shape,",
        "timed in the same rotation: what the plan's computation costs if communication were free. floor / peer bounds",
        "the ratio any implementation of the plan with these kernels can reach here.",
        "Step check (that every rank runs the same program): the path the compiled steps took (`folded`: carried by the",
        "program's first all_reduce/all_gather, no extra collective; `standalone`: its own one-element all_reduce,",
        "overlapping the forward). Two more sides in the rotation: the same step with the check switched off (`without`),",
        "and with the standalone check forced (`compile(...)` then `step.fold_guard = False`).",
        "",
        "\n".join(lines),
        "",
        f"## Tensor parallel against eager DTensor, by model width (world 2, {args.layers} layers)",
        "",
        "\n".join(sweep_lines),
        "",
    ]
    if profiles:
        cols = list(next(iter(profiles.values())))
        text += ["## Where the compiled step's time goes (rank 0, ms per step, under torch.profiler)", "",
                 "| plan | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
        for kind, prof in profiles.items():
            text.append(f"| {kind} | " + " | ".join(f"{prof[c]:.1f}" for c in cols) + " |")
        text.append("")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(text))
    print("\n".join(text))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
