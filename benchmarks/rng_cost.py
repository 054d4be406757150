"""What the RNG contract costs: dropout of a batch-sharded activation, per rank.

For worlds 2, 4 and 8 (data parallel, fake process group, no communication involved:
the dropout program has none), times one rank's compiled program of
``dropout(x, 0.1) * 2`` on its local shard of a fixed global activation, with

    local    eager dropout of the local shard alone (what a rank would do with no
             contract: numbers differ from one device, and equal shards get equal masks)
    exact    rng="exact": the global mask drawn on every rank, the local slice kept
    fast     rng="fast": a per-shard generator draws the local elements

and prints a table of milliseconds and ratios to ``local`` (one run, same process);
writes benchmarks/results/rng_cost.md. Usage:

    python benchmarks/rng_cost.py [--shape 16 256 512] [--worlds 2 4 8] [--repeats 20]
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _table.py

from _table import results_path, write_results  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

from spmd_compiler.testing import fake_mesh, run_spmd  # noqa: E402


def _program(world: int, x: torch.Tensor, rng: str):
    run = run_spmd(lambda t: torch.nn.functional.dropout(t, 0.1) * 2, [x], fake_mesh((world,), ("dp",)), [[Shard(0)]], rng=rng)
    return run.steps[(0,)].gm


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs="+", default=[16, 256, 512])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(results_path("rng_cost")))
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(*args.shape)
    rows = []
    for world in args.worlds:
        local = x.chunk(world)[0].contiguous()
        coords = [0]
        t_local = _time(lambda: torch.nn.functional.dropout(local, 0.1) * 2, args.repeats)
        exact, fast = _program(world, x, "exact"), _program(world, x, "fast")
        with torch.no_grad():
            t_exact = _time(lambda: exact(*coords, local), args.repeats)
            t_fast = _time(lambda: fast(*coords, local), args.repeats)
        rows.append((world, tuple(local.shape), t_local, t_exact, t_fast))
    lines = [
        f"# RNG contract cost: dropout of a batch-sharded activation (global {tuple(args.shape)}, float32)",
        "",
        f"One rank's program, best of {args.repeats}; {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. Ratios to `local` (eager dropout of the shard alone).",
        "",
        "| world | local shape | local ms | exact ms | fast ms | exact / local | fast / local |",
        "|---|---|---|---|---|---|---|",
    ]
    for world, shape, tl, te, tf in rows:
        lines.append(f"| {world} | {shape} | {tl:.2f} | {te:.2f} | {tf:.2f} | {te / tl:.2f}x | {tf / tl:.2f}x |")
    write_results(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
