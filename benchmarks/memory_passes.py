"""What the two memory passes cost in step time (issue #18).

``optimize/memory.py`` adds ``rematerialize`` (a saved elementwise activation is computed
again in backward) and ``budget_prefetch`` (FSDP gathers held back to the latest-gather
peak); both are default passes for every plan. They lowered FSDP's peak to 0.79x FSDP2's
(results/memory_fsdp.md); this measures the other side of the trade: the compiled step
with the passes, the same step without them (``passes_disabled``), and the peer (DDP,
FSDP2), in one run on real gloo processes, the three interleaved in a new order every
step. Ratios are medians of per-step ratios.

    python benchmarks/memory_passes.py [--kinds dp fsdp] [--steps 20]

Writes benchmarks/results/memory_passes.md.
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _table.py, gpt_setup.py

import torch  # noqa: E402

import spmd_compiler as sc  # noqa: E402
from _table import results_path, write_results  # noqa: E402
from gpt_setup import PEERS, TIMING_WORLD, _batch, _cfg, _local_batch, _peer, _plan  # noqa: E402
from spmd_compiler.runtime.launch import run_processes  # noqa: E402
from spmd_compiler.testing.models import GPT, train_step  # noqa: E402

MEMORY_PASSES = ("rematerialize", "budget_prefetch")


def _worker(rank: int, world: int, kind: str, args: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(_cfg(args))
    models = {"with": copy.deepcopy(model), "without": copy.deepcopy(model), "peer": _peer(kind, copy.deepcopy(model), world)}
    opts = {side: torch.optim.AdamW(m.parameters(), lr=1e-3) for side, m in models.items()}
    plan, mesh = _plan(kind, world)
    steps = {"with": sc.compile(train_step, mesh=mesh, plan=plan),
             "without": sc.compile(train_step, mesh=mesh, plan=plan, passes_disabled=MEMORY_PASSES)}

    def run(side: str, i: int) -> float:
        ids, tg = _local_batch(kind, *_batch(i, args), world, rank)
        t0 = time.perf_counter()
        loss = (train_step if side == "peer" else steps[side])(*((models[side], opts[side], ids, tg)))
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        loss.item()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"with": [], "without": [], "peer": []}
    sides = list(times)
    for i in range(args.warmup + args.steps):
        order = sides[:]
        random.Random(i).shuffle(order)  # the same order on every rank
        got = {side: run(side, i) for side in order}
        if i >= args.warmup:
            for side in sides:
                times[side].append(got[side])
    recomputed = sum(1 for n in steps["with"].last.gm.graph.nodes if "spmd_remat" in n.meta)
    return {
        **{f"{side} ms": 1e3 * statistics.median(t) for side, t in times.items()},
        "with / without": statistics.median(a / b for a, b in zip(times["with"], times["without"])),
        "with / peer": statistics.median(a / b for a, b in zip(times["with"], times["peer"])),
        "without / peer": statistics.median(a / b for a, b in zip(times["without"], times["peer"])),
        "nodes with": len(steps["with"].last.gm.graph.nodes), "nodes without": len(steps["without"].last.gm.graph.nodes),
        "recomputed": recomputed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", default=["dp", "fsdp"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=str(results_path("memory_passes")))
    args = p.parse_args()
    rows = []
    for kind in args.kinds:
        r = run_processes(_worker, TIMING_WORLD[kind], kind, args, timeout=3600)[0]
        rows.append((kind, r))
        print(f"{kind}: with/without {r['with / without']:.3f}, with/peer {r['with / peer']:.3f}", flush=True)
    table = ["| plan | peer | with passes ms | without ms | peer ms | with / without | with / peer | without / peer | nodes with / without | recomputed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, r in rows:
        table.append(f"| {kind} | {PEERS[kind]} | {r['with ms']:.1f} | {r['without ms']:.1f} | {r['peer ms']:.1f} | "
                     f"{r['with / without']:.3f} | {r['with / peer']:.3f} | {r['without / peer']:.3f} | "
                     f"{r['nodes with']} / {r['nodes without']} | {r['recomputed']} |")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = [
        "# Step time of the memory passes (`rematerialize`, `budget_prefetch`)",
        "",
        f"`python benchmarks/memory_passes.py --kinds {' '.join(args.kinds)} --steps {args.steps}` on {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, one thread per rank, load average {load:.1f} at the end.",
        f"GPT layers {args.layers}, dim {args.dim}, seq {args.seq}, batch {args.batch}; world {', '.join(f'{k} {TIMING_WORLD[k]}' for k in args.kinds)};"
        " FSDP with reshard_after_forward=False as its FSDP2 peer. Medians of per-step ratios, sides interleaved.",
        "",
        *table,
        "",
    ]
    write_results(args.out, text, show=table)


if __name__ == "__main__":
    main()
