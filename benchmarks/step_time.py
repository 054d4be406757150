"""Step time of compiled train steps against the hand-built wrappers, on real gloo processes.

For the same GPT, data, optimizer (AdamW) and plan, in one run:

    dp    compiled data parallel          vs DistributedDataParallel
    fsdp  compiled FSDP (fsdp_axes)       vs FSDP2 fully_shard (per block + root)
    fsdp_reshard  the same with reshard_after_forward=True on both sides (gathered again in backward;
                  not in the default --kinds)
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
every collective replaced by a local op of the same shape (`gpt_setup._without_collectives`): the
time of the plan's computation alone. peer / floor is the largest speedup any program
for the plan could show on this machine with these kernels, were communication free.

**Width sweep.** Eager DTensor's cost is per op, the compiled step's is mostly compute;
the TP pair is repeated at several model widths to show where the ratio goes.

``--profile`` adds where the compiled step's time goes (torch.profiler on rank 0).
Writes benchmarks/results/step_time.md.

**Pass variants** (``--variants default no-memory-passes``): each variant other than
``default`` is one more side in the rotation, our step compiled with the passes of
:data:`VARIANTS` disabled (``compile(..., passes_disabled=...)``), reported as its own
row with ratios paired against our default step and against the peer.

**Strongest peers** (``--strong``, dp, tp and fsdp, world 2): our ``backend="eager"`` and
``backend="inductor"`` against DDP and DDP + ``torch.compile`` (dp), and a hand-written
Megatron TP without DTensor (tp; :mod:`peers`), FSDP2 and FSDP2 + ``torch.compile`` (fsdp),
all in one rotation; with ``--profile``
the inductor side's top ops. Writes benchmarks/results/step_time_inductor.md. Usage:

    python benchmarks/step_time.py [--steps 30] [--layers 2] [--dim 128] [--tp-dims 32 64 128 256] [--profile]
    python benchmarks/step_time.py --strong --kinds dp tp --layers 2 --dim 128 --steps 10 --profile
    python benchmarks/step_time.py --kinds dp fsdp --tp-dims --variants default no-memory-passes \
        --out benchmarks/results/step_time_memory_passes.md
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
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # gpt_setup.py, peers.py, _table.py

import spmd_compiler as sc  # noqa: E402
from _table import results_path, write_results  # noqa: E402
from gpt_setup import (  # noqa: E402
    PEERS,
    TIMING_WORLD,
    _batch,
    _cfg,
    _local_batch,
    _peer,
    _plan,
    _without_collectives,
    analytic_min,
    compiled_bytes,
)
from spmd_compiler.runtime.launch import run_processes  # noqa: E402
from spmd_compiler.testing.models import GPT, train_step  # noqa: E402

RESULTS = results_path("step_time")
# --variants: name -> the passes our step is compiled without (optimize/runner.py names)
VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "no-memory-passes": ("rematerialize", "budget_prefetch"),
    "no-rematerialize": ("rematerialize",),
    "no-budget-prefetch": ("budget_prefetch",),
    "no-fuse-mean-reductions": ("fuse_mean_reductions",),
}


def _pair_worker(rank: int, world: int, kind: str, args: Any, dim: int, profile: bool) -> dict[str, Any]:
    from spmd_compiler.runtime.executor import compile_runner

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(_cfg(args, dim))
    models = {"ours": copy.deepcopy(model), "floor": copy.deepcopy(model), "peer": _peer(kind, copy.deepcopy(model), world),
              "unguarded": copy.deepcopy(model), "standalone": copy.deepcopy(model)}
    opts = {side: torch.optim.AdamW(m.parameters(), lr=1e-3) for side, m in models.items()}
    variants = [v for v in getattr(args, "variants", ["default"]) if v != "default"]
    for v in variants:
        models[f"ours:{v}"] = copy.deepcopy(model)
        opts[f"ours:{v}"] = torch.optim.AdamW(models[f"ours:{v}"].parameters(), lr=1e-3)
    plan, mesh = _plan(kind, world)
    steps = {side: sc.compile(train_step, mesh=mesh, plan=plan) for side in ("ours", "floor", "unguarded", "standalone")}
    for v in variants:
        steps[f"ours:{v}"] = sc.compile(train_step, mesh=mesh, plan=plan, passes_disabled=VARIANTS[v])
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
    times.update({f"ours:{v}": [] for v in variants})
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
    for v in variants:  # paired against our default step and against the peer, step by step
        t = times[f"ours:{v}"]
        out[f"ours:{v}/ours"] = statistics.median(a / b for a, b in zip(t, times["ours"]))
        out[f"ours:{v}/peer"] = statistics.median(a / b for a, b in zip(t, times["peer"]))
        out[f"ours:{v}/ours q1-q3"] = _quartiles([a / b for a, b in zip(t, times["ours"])])
    for side in ("ours", *(f"ours:{v}" for v in variants)):  # what the passes did to each program
        nodes = list(steps[side].last.gm.graph.nodes)
        out[f"{side} remat"] = sum("spmd_remat" in n.meta for n in nodes)
        out[f"{side} budgeted"] = sum("spmd_prefetch_budget" in n.meta for n in nodes)
    out["ours q1-q3"] = _quartiles([a / b for a, b in zip(times["ours"], times["peer"])])
    if profile:
        out["profile"] = _profile(rank, lambda i: run("ours", i), args)
    return out


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


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
    p.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS),
                   help="our step compiled without the passes each names (VARIANTS), one more side each in the rotation")
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

    load = [os.getloadavg()[0]]  # the machine may be shared: say how busy it was
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
    var_lines = ["| plan | our step | ms | / our default (paired median) | q1-q3 | / peer (paired median) | "
                 "recomputed nodes | budgeted gathers |", "|---|---|---|---|---|---|---|---|"]
    for kind, world, got, *_ in rows:
        q1, q3 = got["ours q1-q3"]
        var_lines.append(f"| {kind} | default | {got['ours'] * 1e3:.1f} | 1 | | {got['ratio']:.3f} (q1-q3 {q1:.3f}-{q3:.3f}) | "
                         f"{got['ours remat']} | {got['ours budgeted']} |")
        for v in args.variants:
            if v == "default":
                continue
            side = f"ours:{v}"
            q1, q3 = got[f"{side}/ours q1-q3"]
            var_lines.append(f"| {kind} | {v} (without {', '.join(VARIANTS[v])}) | {got[side] * 1e3:.1f} | "
                             f"{got[f'{side}/ours']:.3f} | {q1:.3f}-{q3:.3f} | {got[f'{side}/peer']:.3f} | "
                             f"{got[f'{side} remat']} | {got[f'{side} budgeted']} |")
    sweep_lines = ["| dim | compiled TP ms | eager DTensor TP ms | speedup (eager / compiled, paired median) | "
                   "compute floor ms | ceiling (eager / floor) |", "|---|---|---|---|---|---|"]
    for dim, got in sweep:
        sweep_lines.append(f"| {dim} | {got['ours'] * 1e3:.1f} | {got['peer'] * 1e3:.1f} | {1 / got['ratio']:.2f}x | "
                           f"{got['floor'] * 1e3:.1f} | {1 / got['floor_ratio']:.2f}x |")
    text = [
        "# Step time",
        "",
        f"`python benchmarks/step_time.py{''.join(' ' + a for a in sys.argv[1:])}` on {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, gloo, one thread per process; 1-minute load average {load[0]:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end.",
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
    ]
    if len(args.variants) > 1 or args.variants != ["default"]:
        text += [f"## Our step without some passes (`--variants {' '.join(args.variants)}`), in the same rotation", "",
                 "Each variant is our step compiled with `passes_disabled=` the passes it names; its ratios are medians",
                 "of the per-step ratios against our default step and against the peer (q1-q3: the quartiles of the",
                 "per-step ratio). Recomputed nodes / budgeted gathers: nodes the `rematerialize` pass added and",
                 "parameter gathers `budget_prefetch` placed, in the program the steps ran.", "",
                 "\n".join(var_lines), ""]
    if sweep:
        text += [f"## Tensor parallel against eager DTensor, by model width (world 2, {args.layers} layers)", "",
                 "\n".join(sweep_lines), ""]
    if profiles:
        cols = list(next(iter(profiles.values())))
        text += ["## Where the compiled step's time goes (rank 0, ms per step, under torch.profiler)", "",
                 "| plan | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
        for kind, prof in profiles.items():
            text.append(f"| {kind} | " + " | ".join(f"{prof[c]:.1f}" for c in cols) + " |")
        text.append("")
    write_results(args.out, text)


if __name__ == "__main__":
    main()
