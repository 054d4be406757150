"""``python benchmarks/compile_time.py --dynamic``: symbolic batch sizes (issue #17).

Two measurements, both for data-parallel plans in the simulator (one process, a fake
mesh; see docs/dynamic_shapes.md):

    loop        a training loop over 10 batch sizes (``SIZES``) with ``dynamic=True``
                against ``dynamic=False``: compiles and seconds spent compiling
                (trace, expansion of every rank, passes), and the loop's total seconds
    step time   rank 0's per-rank program of each kind run directly on the fake process
                group (collectives return at once, so this is the program's own cost),
                for the same rank-0 inputs; the two alternate rep by rep, the order
                swapped every rep, and the figure is the median of the per-rep ratios
                symbolic / concrete (the issue's target: at most 1.02)

Writes benchmarks/results/compile_time_dynamic.md.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch

from _table import results_path, write_results
from spmd_compiler.testing import fake_mesh
from spmd_compiler.testing.harness import SimulatedTraining
from spmd_compiler.testing.models import GPT, MLP, mse_train_step, train_step
from spmd_compiler.testing.simulate import example_inputs

RESULTS = results_path("compile_time_dynamic")
SIZES = [33, 32, 17, 8, 5, 31, 16, 7, 1, 24]


class _TimedSimulation(SimulatedTraining):
    """SimulatedTraining that adds up the seconds its compiles take."""

    compile_seconds = 0.0

    def _compile(self, batch: tuple) -> None:
        t0 = time.perf_counter()
        super()._compile(batch)
        self.compile_seconds += time.perf_counter() - t0


def _models() -> dict[str, tuple[Callable[[], Any], Callable[..., Any], Callable[[int], tuple], str]]:
    def mlp() -> Any:
        torch.manual_seed(0)
        model = MLP(64, 256)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def gpt() -> Any:
        torch.manual_seed(0)
        model = GPT(vocab=64, seq=16, dim=32, heads=2, layers=2)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    return {
        "mlp": (mlp, mse_train_step, lambda b: (torch.randn(b, 64), torch.randn(b, 64)), "MLP 64-256-64, SGD, MSE"),
        "gpt": (gpt, train_step, lambda b: (torch.randint(0, 64, (b, 16)), torch.randint(0, 64, (b, 16))),
                "GPT (vocab 64, seq 16, dim 32, 2 heads, 2 layers), AdamW, cross-entropy"),
    }


def loop(name: str, world: int, dynamic: bool) -> dict:
    make, step_fn, batch, _ = _models()[name]
    model, opt = make()
    sim = _TimedSimulation(step_fn, model, opt, fake_mesh((world,), ("dp",)), dynamic=dynamic)
    t0 = time.perf_counter()
    for b in SIZES:
        sim.step(*batch(b))
    return {"compiles": sim.compiles, "compile s": sim.compile_seconds, "loop s": time.perf_counter() - t0,
            "reasons": sim.reasons[1:]}


def _program(name: str, world: int, b: int, dynamic: bool) -> Any:
    make, step_fn, batch, _ = _models()[name]
    model, opt = make()
    sim = SimulatedTraining(step_fn, model, opt, fake_mesh((world,), ("dp",)), dynamic=dynamic)
    sim.step(*batch(b))
    return sim.expansions[(0,)]


def step_ratio(name: str, world: int, b: int, reps: int) -> dict:
    """Median ratio symbolic / concrete of rank 0's program at global batch ``b``."""
    sym = _program(name, world, b, dynamic=True)
    conc = _program(name, world, b, dynamic=False)
    assert sym.size_symbols and not conc.size_symbols, "expected one symbolic and one concrete program"
    base = example_inputs(conc.gm)  # the coordinate(s), then the rank's inputs
    ncoord = len(conc.mctx.shape)
    sizes = [b] * len(sym.size_symbols)
    feeds = {
        "sym": lambda: base[:ncoord] + sizes + base[ncoord:],
        "conc": lambda: base[:ncoord] + base[ncoord:],
    }
    inputs = {k: copy.deepcopy(f()) for k, f in feeds.items()}  # each side updates its own parameters
    gms = {"sym": sym.gm, "conc": conc.gm}
    for _ in range(3):  # warm-up
        for k in gms:
            gms[k](*inputs[k])
    times: dict[str, list[float]] = {"sym": [], "conc": []}
    for r in range(reps):
        for k in (("sym", "conc") if r % 2 else ("conc", "sym")):
            t0 = time.perf_counter()
            gms[k](*inputs[k])
            times[k].append(time.perf_counter() - t0)
    ratios = [s / c for s, c in zip(times["sym"], times["conc"])]
    return {
        "batch": b, "sym ms": 1e3 * statistics.median(times["sym"]), "conc ms": 1e3 * statistics.median(times["conc"]),
        "ratio": statistics.median(ratios), "sym nodes": len(sym.gm.graph.nodes), "conc nodes": len(conc.gm.graph.nodes),
        "size nodes": sum(1 for n in sym.gm.graph.nodes if n.meta.get("spmd_size_expr")),
    }


def run_dynamic(world: int, reps: int) -> None:
    loops, ratios = [], []
    for name in _models():
        row = {"model": name}
        for dynamic in (True, False):
            r = loop(name, world, dynamic)
            row.update({f"{k} {'dyn' if dynamic else 'static'}": v for k, v in r.items()})
        loops.append(row)
        print(f"{name}: dynamic {row['compiles dyn']} compiles {row['compile s dyn']:.1f}s, "
              f"static {row['compiles static']} compiles {row['compile s static']:.1f}s", flush=True)
        for b in (64 * world, 64 * world - 1):  # even and uneven over the ranks
            r = step_ratio(name, world, b, reps)
            ratios.append({"model": name, **r})
            print(f"{name} batch {b}: symbolic / concrete {r['ratio']:.3f}", flush=True)
    head = ["| model | compiles dynamic=True | compiles dynamic=False | compile s dynamic=True | compile s dynamic=False | "
            "compile s static / dynamic | loop s dynamic=True | loop s dynamic=False |", "|---|---|---|---|---|---|---|---|"]
    for r in loops:
        head.append(f"| {r['model']} | {r['compiles dyn']} | {r['compiles static']} | {r['compile s dyn']:.1f} | "
                    f"{r['compile s static']:.1f} | {r['compile s static'] / r['compile s dyn']:.1f}x | {r['loop s dyn']:.1f} | "
                    f"{r['loop s static']:.1f} |")
    steps = ["| model | global batch | per-rank nodes symbolic | per-rank nodes concrete | integer size nodes | "
             "symbolic ms | concrete ms | symbolic / concrete (paired median) |", "|---|---|---|---|---|---|---|---|"]
    for r in ratios:
        steps.append(f"| {r['model']} | {r['batch']} | {r['sym nodes']} | {r['conc nodes']} | {r['size nodes']} | "
                     f"{r['sym ms']:.2f} | {r['conc ms']:.2f} | {r['ratio']:.3f} |")
    again = [f"* {r['model']}, dynamic=True, compile {i + 2}: {why}" for r in loops for i, why in enumerate(r["reasons dyn"])]
    text = "\n".join(head) + "\n\n" + "\n".join(steps)
    models = "; ".join(f"`{k}` = {v[3]}" for k, v in _models().items())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# Compile time and step time with symbolic batch sizes (`dynamic=True`)",
        "",
        f"`python benchmarks/compile_time.py --dynamic --world {world} --reps {reps}` on {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, one thread; load average {load:.1f} at the end of the run "
        "(the machine is shared with other jobs: absolute seconds are inflated, ratios taken in one run are what to read).",
        f"Data parallel on a simulated mesh of {world} ranks (`SimulatedTraining`, fake process group); {models}.",
        "",
        f"**Loop**: one training step for each batch size {SIZES}. `compile s` counts every compile (trace, expansion",
        "of every rank, default passes); `loop s` the whole loop (compiles plus the simulated steps).",
        "",
        "\n".join(head),
        "",
        *(["Why a symbolic loop compiled more than once:", "", *again, ""] if again else []),
        "**Step time**: rank 0's per-rank program of each kind (symbolic: takes the global batch size as an int input and",
        "computes the sizes that depend on it; concrete: `dynamic=False` for that batch), run directly on the fake process",
        f"group with the same rank-0 inputs, alternating (order swapped every rep), 3 warm-up then {reps} reps each;",
        "the ratio is the median of the per-rep ratios. Target of the issue: symbolic / concrete at most 1.02.",
        "",
        "\n".join(steps),
        "",
    ]
    write_results(RESULTS, lines, show=text)
