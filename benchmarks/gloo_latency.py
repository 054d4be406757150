"""What a synchronous all_reduce costs inside a step on this machine, and how much of it
overlap can hide: the bound behind the tensor-parallel row of ``step_time.py``.

Megatron TP waits for eight all_reduces per step (two per block, forward and backward,
in the benchmark's 2-layer GPT), and the four in forward have no independent work in
the step to hide behind. On 2 processes (world 2, gloo, one thread each) this script
times, per all_reduce of an activation-sized buffer:

    alone        back-to-back all_reduces (the transport's latency)
    after work   the same all_reduce right after a few matmuls on each rank
                 (the TP pattern: compute, then wait for the sum)
    overlapped   issued before the same matmuls and waited after them
                 (the best any overlap schedule can do)

and reports the cost of each over the matmuls alone. Writes
benchmarks/results/gloo_latency.md. Usage:

    python benchmarks/gloo_latency.py [--kb 64 128 256] [--iters 60]
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
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _table.py

from _table import results_path, write_results  # noqa: E402
from spmd_compiler.runtime.launch import run_processes  # noqa: E402

RESULTS = results_path("gloo_latency")
ROUNDS = 8  # all_reduces per measured "step", as in the benchmark's Megatron TP step


def _worker(rank: int, world: int, kbs: list[int], iters: int, matmuls: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    a, b = torch.randn(512, 128), torch.randn(128, 256)

    def work() -> None:
        for _ in range(matmuls):
            a @ b

    out: dict[str, Any] = {}
    for kb in kbs:
        x = torch.randn(kb * 256)
        modes = {
            "work": lambda: work(),
            "alone": lambda: dist.all_reduce(x),
            "after work": lambda: (work(), dist.all_reduce(x)),
            "overlapped": lambda: (lambda w: (work(), w.wait()))(dist.all_reduce(x, async_op=True)),
        }
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(iters + 5):
            for m, fn in modes.items():
                t0 = time.perf_counter()
                for _ in range(ROUNDS):
                    fn()
                if i >= 5:
                    times[m].append((time.perf_counter() - t0) / ROUNDS)
        out[kb] = {m: statistics.median(t) * 1e3 for m, t in times.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kb", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--matmuls", type=int, default=4)
    args = p.parse_args()
    res = run_processes(_worker, 2, args.kb, args.iters, args.matmuls, timeout=1800)
    lines = [
        "# gloo all_reduce cost inside a step",
        "",
        f"`python benchmarks/gloo_latency.py` on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        "world 2, gloo, one thread per process.",
        f"ms per all_reduce (median over {args.iters} runs of {ROUNDS}); work = {args.matmuls} matmuls [512,128]x[128,256] per rank.",
        "Cost = time of the pattern minus the work alone. Rank 0 | rank 1.",
        "",
        "| buffer | work ms | alone ms | after work: cost ms | overlapped: cost ms | hidden by overlap |",
        "|---|---|---|---|---|---|",
    ]
    for kb in args.kb:
        r = [res[0][kb], res[1][kb]]
        cost = [x["after work"] - x["work"] for x in r]
        hid = [x["overlapped"] - x["work"] for x in r]
        share = [1 - h / c if c > 0 else 0.0 for h, c in zip(hid, cost)]
        lines.append(
            f"| {kb} KiB | {r[0]['work']:.2f} | {r[0]['alone']:.2f} \\| {r[1]['alone']:.2f} | {cost[0]:.2f} \\| {cost[1]:.2f} | "
            f"{hid[0]:.2f} \\| {hid[1]:.2f} | {share[0]:.0%} \\| {share[1]:.0%} |"
        )
    write_results(RESULTS, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
