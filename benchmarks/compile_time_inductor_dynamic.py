"""``compile(..., backend="inductor")`` over 10 batch sizes: ``dynamic=True`` against one
program per shape (issue #17, docs/dynamic_shapes.md). Run by ``python
benchmarks/compile_time.py --dynamic --backend inductor [--world 2]``.

Real gloo processes (inductor's compiled code runs the collectives): a DP MLP (16 -> 32 ->
16, float64, SGD) trains over the batch sizes of ``SIZES`` on ``world`` ranks, each rank
holding torch.chunk's piece, once per mode. Per mode, rank 0's numbers: expansions
(``step.compiles``), inductor compiles (every program's runner, every segment and variant),
the seconds inductor took (``timings["backend inductor"]``), the wall time of the loop
(trace, expansion, inductor and the steps), and the largest difference from one device
(float64). Each mode runs in fresh processes with an empty inductor cache folder of its own
(``TORCHINDUCTOR_CACHE_DIR``), so every compile is cold. Writes
``benchmarks/results/compile_time_inductor_dynamic.md``.
"""

from __future__ import annotations

import copy
import os
import platform
import tempfile
import time

import torch

import spmd_compiler as sc
from _table import results_path, write_results
from spmd_compiler.runtime.launch import run_processes
from spmd_compiler.testing.models import MLP, mse_train_step

RESULTS = results_path("compile_time_inductor_dynamic")
SIZES = [33, 32, 17, 8, 5, 31, 16, 7, 1, 24]


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    c = -(-t.shape[0] // world)
    return t[min(rank * c, t.shape[0]) : min((rank + 1) * c, t.shape[0])]


def _loop(rank: int, world: int, dynamic: bool, sizes: list[int]) -> dict:
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = sc.compile(mse_train_step, mesh=(world,), dynamic=dynamic, backend="inductor", cache_size=len(sizes))
    err, t0 = 0.0, time.perf_counter()
    for i, b in enumerate(sizes):
        g = torch.Generator().manual_seed(100 + i)
        x, y = (torch.randn(b, 16, dtype=torch.float64, generator=g) for _ in range(2))
        loss = step(model, opt, _rows(x, rank, world), _rows(y, rank, world))
        err = max(err, abs(loss.item() - mse_train_step(ref, ref_opt, x, y).item()))
    wall = time.perf_counter() - t0
    err = max(err, max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    steps = [p.step for p in step._programs.values()]
    runners = [r for s in steps for r in (getattr(s, "runner", None), getattr(s, "folded_runner", None)) if r is not None]
    return {"expansions": step.compiles, "inductor": sum(r.compiles for r in runners),
            "inductor_s": sum(s.timings.get("backend inductor", 0.0) for s in steps), "wall_s": wall, "err": err}


def measure(world: int, dynamic: bool, sizes: list[int] = SIZES) -> dict:
    """One mode's numbers (rank 0), in fresh processes with a cold inductor cache."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="spmd_inductor_cache_") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            return run_processes(_loop, world, dynamic, sizes, timeout=3000)[0]
        finally:
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def run_inductor_dynamic(world: int = 2) -> None:
    rows = {}
    for dynamic in (True, False):
        rows[dynamic] = measure(world, dynamic)
        print(f"dynamic={dynamic}: {rows[dynamic]}", flush=True)
    d, s = rows[True], rows[False]
    table = [
        "| mode | expansions | inductor compiles | inductor seconds | loop wall seconds | max error vs one device |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("dynamic=True", d), ("per shape", s)):
        table.append(f"| {name} | {r['expansions']} | {r['inductor']} | {r['inductor_s']:.1f} | {r['wall_s']:.1f} | {r['err']:.1e} |")
    ratio = f"per shape / dynamic: {s['inductor_s'] / max(d['inductor_s'], 1e-9):.1f}x the inductor seconds, " \
            f"{s['wall_s'] / max(d['wall_s'], 1e-9):.1f}x the loop's wall time"
    lines = [
        "# Compile time with backend=\"inductor\": dynamic=True against per shape",
        "",
        f"`python benchmarks/compile_time.py --dynamic --backend inductor --world {world}` on {platform.machine()}, "
        f"{os.cpu_count()} cores (shared with other jobs: seconds are inflated, the ratio is from one run), "
        f"torch {torch.__version__}, one thread per rank, {world} gloo ranks.",
        f"DP MLP (16 -> 32 -> 16, float64, SGD), batch sizes {', '.join(map(str, SIZES))}; rank 0's numbers; each mode in",
        "fresh processes with an empty inductor cache folder (every compile cold).",
        "",
        *table,
        "",
        ratio + ".",
        "",
    ]
    write_results(RESULTS, lines)
