"""Compile time of a transformer train step (AdamW) with 2, 8 and 32 layers.

On a fake process group of world size 8 (no communication), for a 1-D FSDP-style plan
and a 2-D (dp=2 x tp=4) plan, in one run, measures:

    trace       make_fx of the whole step (batch sizes symbolic)
    expand      per-node expansion with the memo cache (what compile() does)
    uncached    the same expansion without the cache (every node built afresh)
    re-trace    uncached, plus a make_fx re-trace of every node's dispatch subgraph:
                what the per-node re-tracing of the removed torch.distributed._spmd paid
    rebuild     finishing the per-rank graph
    passes      the default optimization passes

checks that cached and uncached expansion give the same graph, prints a table, and
writes benchmarks/results/compile_time.md. Usage:

    python benchmarks/compile_time.py [--layers 2 8 32] [--skip-retrace-above 32]

``--dynamic`` measures symbolic batch sizes instead (issue #17, docs/dynamic_shapes.md;
the functions live in ``compile_time_dynamic.py``): per plan (``--plans``: mlp, dp,
fsdp, tp_seq, 2d; default all), a training loop over 10 batch sizes in the simulator
(``SimulatedTraining``, fake mesh of ``--world`` ranks) with ``dynamic=True`` against
``dynamic=False`` (compiles and compile seconds), and the step time of the symbolic
per-rank program against the concrete one at an even and an uneven batch (rank 0's
program run directly on the fake process group, interleaved repetitions, median ratio;
the collectives of both); writes benchmarks/results/compile_time_dynamic.md:

    python benchmarks/compile_time.py --dynamic [--world 4] [--reps 31] [--plans dp,fsdp,tp_seq,2d]

``--dynamic --backend inductor`` runs the DP MLP on ``--world`` real gloo ranks (default 2)
with ``backend="inductor"`` instead: expansions, inductor compiles and seconds over the 10
sizes, ``dynamic=True`` against per shape (``compile_time_inductor_dynamic.py``; writes
benchmarks/results/compile_time_inductor_dynamic.md).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _table.py, compile_time_dynamic.py

import spmd_compiler as sc  # noqa: E402
from _table import results_path, write_results  # noqa: E402
from spmd_compiler.expand import recipes as recipes_mod  # noqa: E402
from spmd_compiler.optimize import default_passes, run_passes  # noqa: E402
from spmd_compiler.driver import gc_paused  # noqa: E402
from spmd_compiler.testing import fake_mesh  # noqa: E402
from spmd_compiler.testing.models import GPT, gpt_2d_plan, gpt_fsdp_plan, train_step  # noqa: E402

RESULTS = results_path("compile_time")


def _retrace_build(orig):
    """Wrap recipes.build_recipe: after building a recipe, re-trace it with make_fx."""

    def build(ex, node, op, args, kwargs):
        recipe = orig(ex, node, op, args, kwargs)
        phs = [n for n in recipe.graph.nodes if n.op == "placeholder"]
        gm = fx.GraphModule(torch.nn.Module(), recipe.graph)
        vals = [torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v for v in (n.meta["val"] for n in phs)]
        make_fx(gm, tracing_mode="fake")(*vals)
        return recipe

    return build


def measure(layers: int, plan_name: str, retrace: bool) -> dict:
    if plan_name == "fsdp":
        mesh, plan = fake_mesh((8,), ("dp",)), gpt_fsdp_plan()
    else:
        mesh, plan = fake_mesh((2, 4), ("dp", "tp")), gpt_2d_plan()
    torch.manual_seed(0)
    model = GPT(vocab=256, seq=32, dim=64, heads=4, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (16, 32))
    train_step(model, opt, ids, ids)  # Adam state exists: trace the steady step
    t0 = time.perf_counter()
    with gc_paused():  # as compile() traces: no GC, symbols only for the sharded batch dim
        traced = sc.trace(train_step, model, opt, ids, ids, symbolic_dims={0: (0,), 1: (0,)})
    trace_s = time.perf_counter() - t0

    cache = sc.ExpansionCache()
    with gc_paused():
        cached = sc.expand(traced, mesh, plan, cache=cache)
        plain = sc.expand(traced, mesh, plan, cache=sc.ExpansionCache(enabled=False))
    assert cached.gm.code == plain.gm.code, "memoized expansion changed the graph"
    retrace_s = float("nan")
    if retrace:
        orig = recipes_mod.build_recipe
        recipes_mod.build_recipe = _retrace_build(orig)
        try:
            with gc_paused():
                r = sc.expand(traced, mesh, plan, cache=sc.ExpansionCache(enabled=False))
            retrace_s = r.timings["expand"]
        finally:
            recipes_mod.build_recipe = orig
    t0 = time.perf_counter()
    with gc_paused():
        gm, _ = run_passes(cached.gm, default_passes())
    passes_s = time.perf_counter() - t0
    return {
        "layers": layers,
        "plan": plan_name,
        "traced nodes": len(traced.gm.graph.nodes),
        "per-rank nodes": len(cached.gm.graph.nodes),
        "recipes": cache.stats()["entries"],
        "trace": trace_s,
        "expand": cached.timings["expand"],
        "uncached": plain.timings["expand"],
        "re-trace": retrace_s,
        "rebuild": cached.timings["rebuild"],
        "passes": passes_s,
    }


def table(rows: list[dict]) -> str:
    head = "| plan | layers | traced nodes | per-rank nodes | recipes | trace s | expand s | uncached s | re-trace s | rebuild s | passes s | uncached / expand | re-trace / expand | expand / trace | total s |"
    sep = "|" + "---|" * (head.count("|") - 1)
    out = [head, sep]
    for r in rows:
        total = r["trace"] + r["expand"] + r["rebuild"] + r["passes"]
        out.append(
            f"| {r['plan']} | {r['layers']} | {r['traced nodes']} | {r['per-rank nodes']} | {r['recipes']} | {r['trace']:.2f} | "
            f"{r['expand']:.2f} | {r['uncached']:.2f} | {r['re-trace']:.2f} | {r['rebuild']:.2f} | {r['passes']:.2f} | "
            f"{r['uncached'] / r['expand']:.1f}x | {r['re-trace'] / r['expand']:.1f}x | {r['expand'] / r['trace']:.2f} | {total:.1f} |"
        )
    return "\n".join(out)


def growth(rows: list[dict]) -> str:
    """Total compile time from the shallowest to the deepest step, against the layer ratio."""
    out = ["| plan | layers | total s | growth of total | growth of layers | growth of traced nodes |", "|---|---|---|---|---|---|"]
    for plan in dict.fromkeys(r["plan"] for r in rows):
        mine = [r for r in rows if r["plan"] == plan]
        if len(mine) < 2:
            continue
        lo, hi = mine[-2], mine[-1]

        def total(r: dict) -> float:
            return r["trace"] + r["expand"] + r["rebuild"] + r["passes"]

        out.append(
            f"| {plan} | {lo['layers']} -> {hi['layers']} | {total(lo):.1f} -> {total(hi):.1f} | {total(hi) / total(lo):.2f}x | "
            f"{hi['layers'] / lo['layers']:.2f}x | {hi['traced nodes'] / lo['traced nodes']:.2f}x |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--plans", nargs="+", default=None,
                   help="plans, space or comma separated: fsdp 2d (default); --dynamic: mlp dp fsdp tp_seq 2d (default all)")
    p.add_argument("--skip-retrace-above", type=int, default=32, help="skip the slow re-trace column above this depth")
    p.add_argument("--dynamic", action="store_true", help="measure dynamic=True against per-shape compiles instead")
    p.add_argument("--world", type=int, default=None, help="--dynamic: ranks of the simulated data-parallel mesh (4; inductor: gloo ranks, 2)")
    p.add_argument("--backend", choices=["eager", "inductor"], default="eager",
                   help="--dynamic: 'inductor' measures compile(backend='inductor') on gloo ranks (dp plan only)")
    p.add_argument("--reps", type=int, default=31, help="--dynamic: interleaved step-time repetitions")
    args = p.parse_args()
    torch.set_num_threads(1)
    plans = [x for arg in args.plans for x in arg.split(",") if x] if args.plans else None
    if args.dynamic and args.backend == "inductor":
        from compile_time_inductor_dynamic import run_inductor_dynamic

        run_inductor_dynamic(args.world or 2)
        return
    if args.dynamic:
        from compile_time_dynamic import run_dynamic

        run_dynamic(args.world or 4, args.reps, plans)
        return
    rows = []
    for plan in plans or ["fsdp", "2d"]:
        measure(1, plan, retrace=False)  # warm-up: first-use costs of DTensor's propagation
        for layers in args.layers:
            r = measure(layers, plan, retrace=layers <= args.skip_retrace_above)
            rows.append(r)
            print(f"{plan} {layers} layers: trace {r['trace']:.1f}s expand {r['expand']:.1f}s uncached {r['uncached']:.1f}s re-trace {r['re-trace']:.1f}s", flush=True)
    text = table(rows) + "\n\n" + growth(rows)
    print(text)
    lines = [
        "# Compile time",
        "",
        f"`python benchmarks/compile_time.py` on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, one thread.",
        "GPT (vocab 256, seq 32, dim 64, 4 heads) train step with AdamW, fake process group of world size 8:",
        "`fsdp` = every parameter Shard(0) over 8 ranks; `2d` = dp 2 x Megatron tp 4.",
        "`uncached` builds every node's recipe afresh; `re-trace` additionally re-traces each",
        "recipe with make_fx, the per-node cost of the removed `torch.distributed._spmd`.",
        "Cached and uncached expansion are checked to give the same graph. Every phase runs as `compile()` runs it:",
        "garbage collection paused, and only the batch dim the plans shard (dim 0) traced as a symbol.",
        "",
        text,
        "",
    ]
    write_results(RESULTS, lines)


if __name__ == "__main__":
    main()
