"""Pipelined GPT steps: step time against torch.distributed.pipelining, bubbles, memory.

In one run, on real gloo processes:

1. **Timing** (world 2 = pp 2, one process per core on a 2-core machine): for GPipe and
   1F1B and m = 1, 2, 4, 8 micro-batches, the median step time of our compiled pipeline
   and of torch.distributed.pipelining (``PipelineStage`` + ``ScheduleGPipe`` /
   ``Schedule1F1B``, the same two halves of the same GPT, AdamW after the schedule), and
   our measured bubble (the share of the step a rank is not computing, from the runtime's
   timeline, mean over ranks) next to the ideal ``(p - 1) / (m + p - 1)``.
2. **Activation memory** (world 4 = pp 4, no timing): the most bytes of micro-batch
   values the first stage holds at once during a step, GPipe against 1F1B, for
   m = 1, 2, 4, 8. GPipe keeps every micro-batch's activations until the backward
   starts; 1F1B keeps at most p.

Writes benchmarks/results/pipeline.md. Usage:

    python benchmarks/pipeline.py [--steps 10] [--layers 4] [--dim 256]
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
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _table.py

import spmd_compiler as sc  # noqa: E402
from _table import results_path, write_results  # noqa: E402
from spmd_compiler.pipeline.timeline import bubble_fractions  # noqa: E402
from spmd_compiler.runtime.launch import run_processes  # noqa: E402
from spmd_compiler.testing.models import GPT, GPTConfig, train_step  # noqa: E402

RESULTS = results_path("pipeline")
SCHEDULES = ("GPipe", "1F1B")


def _cfg(args: Any) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers)


def _batch(step: int, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _split(args: Any, pp: int) -> dict[str, Any]:
    per = args.layers // pp
    return {f"blocks.{per * s}": sc.SplitPoint.BEGINNING for s in range(1, pp)}


def _ours(rank: int, world: int, args: Any, configs: list[tuple[str, int]], timed: bool) -> dict[Any, Any]:
    torch.set_num_threads(1)
    out: dict[Any, Any] = {}
    for schedule, m in configs:
        torch.manual_seed(0)
        model = GPT(_cfg(args))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = sc.compile(train_step, mesh={"pp": world}, pipeline=sc.Pipeline(chunks=m, schedule=schedule, split=_split(args, world)))
        steps = args.warmup + (args.steps if timed else 1)
        times, bubbles = [], []
        for i in range(steps):
            ids, tg = _batch(i, args)
            t0 = time.perf_counter()
            step(model, opt, ids, tg).item()
            times.append(time.perf_counter() - t0)
            if timed and i >= args.warmup:
                bubbles.append(statistics.mean(bubble_fractions(step.gather_timeline())))
        res = {"peak": step.last.pipeline.peak_activation_bytes}
        if timed:
            res.update(median=statistics.median(times[args.warmup:]), bubble=statistics.median(bubbles))
            if (schedule, m) == configs[-1]:
                res["timeline"] = step.timeline_text(width=64)
        out[(schedule, m)] = res
    return out


class _First(nn.Module):
    def __init__(self, gpt: GPT, upto: int) -> None:
        super().__init__()
        self.tok, self.pos, self.blocks = gpt.tok, gpt.pos, nn.ModuleList(gpt.blocks[:upto])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for b in self.blocks:
            x = b(x)
        return x


class _Last(nn.Module):
    def __init__(self, gpt: GPT, start: int) -> None:
        super().__init__()
        self.blocks, self.ln, self.head = nn.ModuleList(gpt.blocks[start:]), gpt.ln, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _torch_pipelining(rank: int, world: int, args: Any, configs: list[tuple[str, int]]) -> dict[Any, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    assert world == 2, "the peer splits the GPT into two halves"
    torch.set_num_threads(1)
    out: dict[Any, Any] = {}
    for schedule, m in configs:
        if schedule == "1F1B" and m < world:
            out[(schedule, m)] = None  # torch's Schedule1F1B needs m >= stages
            continue
        torch.manual_seed(0)
        gpt = GPT(_cfg(args))
        half = args.layers // 2
        mod = _First(gpt, half) if rank == 0 else _Last(gpt, half)
        opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
        stage = PipelineStage(mod, rank, world, torch.device("cpu"))
        cls = ScheduleGPipe if schedule == "GPipe" else Schedule1F1B
        sched = cls(stage, n_microbatches=m, loss_fn=_lm_loss)
        times = []
        for i in range(args.warmup + args.steps):
            ids, tg = _batch(i, args)
            t0 = time.perf_counter()
            if rank == 0:
                sched.step(ids)
            else:
                losses: list[torch.Tensor] = []
                sched.step(target=tg, losses=losses)
                torch.stack(losses).mean().item()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        out[(schedule, m)] = {"median": statistics.median(times[args.warmup:])}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps; the first two compile (AdamW state appears)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args()
    if args.warmup < 2:
        p.error("--warmup must be >= 2: the first step compiles, the second recompiles with the optimizer state")
    configs = [(s, m) for s in SCHEDULES for m in args.chunks]

    t0 = time.perf_counter()
    ours = run_processes(_ours, 2, args, configs, True, timeout=3600)
    peer = run_processes(_torch_pipelining, 2, args, configs, timeout=3600)[0]
    mem = run_processes(_ours, 4, args, configs, False, timeout=3600)[0]
    print(f"measured in {time.perf_counter() - t0:.0f} s", flush=True)

    pp = 2
    head = "| schedule | micro-batches | ours ms | torch.distributed.pipelining ms | ours / torch | bubble measured | bubble ideal (p-1)/(m+p-1) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key in configs:
        s, m = key
        o, t = ours[0][key], peer[key]
        t_ms, ratio = (f"{t['median'] * 1e3:.1f}", f"{o['median'] / t['median']:.2f}") if t else ("n/a (needs m >= p)", "")
        lines.append(f"| {s} | {m} | {o['median'] * 1e3:.1f} | {t_ms} | {ratio} | {o['bubble']:.2f} | {(pp - 1) / (m + pp - 1):.2f} |")
    timing = "\n".join(lines)
    head = ("| pp | micro-batches | GPipe peak activation bytes (stage 0) | 1F1B peak activation bytes (stage 0) | "
            "1F1B / GPipe | expected min(p, m) / m |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for world, peaks in ((2, ours[0]), (4, mem)):
        for m in args.chunks:
            g, f = peaks[("GPipe", m)]["peak"], peaks[("1F1B", m)]["peak"]
            lines.append(f"| {world} | {m} | {g:,} | {f:,} | {f / g:.2f} | {min(world, m) / m:.2f} |")
    memory = "\n".join(lines)
    last = configs[-1]
    print(timing, memory, ours[0][last]["timeline"], sep="\n\n")
    text = [
        "# Pipeline parallelism",
        "",
        f"`python benchmarks/pipeline.py` on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, one thread per process.",
        f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, batch {args.batch}, AdamW, float32.",
        "",
        f"## Step time and bubble (pp = 2, two halves of {args.layers // 2} blocks)",
        "",
        f"Median of {args.steps} steps after {args.warmup} warm-up steps. Both sides run the same model halves, data and optimizer in the same run.",
        "The bubble is 1 - (time in F/B/O) / (step wall time) per rank, averaged over ranks: it includes the optimizer and transfer waits,",
        "so it sits above the ideal; the ideal counts equal-cost micro-batches and free communication.",
        "",
        timing,
        "",
        f"Timeline of the last step of {last[0]} with m = {last[1]} (rank rows; digits forward, letters backward, O optimizer, ~ receive wait):",
        "",
        "```",
        ours[0][last]["timeline"],
        "```",
        "",
        "## Activation memory",
        "",
        "Most bytes of micro-batch values (activations saved for backward, received inputs) held at once on stage 0 during a step,",
        "from the runtime's accounting of live tensors (distinct storages); pp = 2 from the timing run, pp = 4 from a separate run.",
        "The global batch is fixed, so a micro-batch is 1/m of it: GPipe runs every forward before any backward and holds the",
        "whole batch's activations whatever m is; 1F1B holds at most p micro-batches on stage 0, min(p, m) / m of the batch.",
        "",
        memory,
        "",
    ]
    write_results(RESULTS, text)


if __name__ == "__main__":
    main()
