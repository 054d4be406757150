"""What a ``dynamic=True`` step pays per call to check its size guards.

Compiles a data-parallel step (simulated ranks, ``dynamic=True``) whose trace records a
size guard (``if x.shape[0] > 4``) besides torch's own, and times, for every rank's
guards (what ``driver/sizes.py`` checks each call), on the same sizes in the same run:

    sympy      each guard substituted and evaluated with sympy (before: SizeGuards.failing)
    compiled   each distinct guard once, as a Python function (expand/size_checks.py)

Prints microseconds per call and the ratio; writes benchmarks/results/size_guards.md.
Usage:

    python benchmarks/size_guards.py [--worlds 2 4 8] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import time

import sympy
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _table.py

from _table import results_path, write_results  # noqa: E402

from spmd_compiler.driver.sizes import SizeProgram  # noqa: E402
from spmd_compiler.testing import SimulatedTraining, fake_mesh  # noqa: E402
from spmd_compiler.testing.models import MLP  # noqa: E402


def threshold_step(model, optimizer, x, y):
    out = model(x)
    if x.shape[0] > 4:
        out = out * 2
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _sympy_failing(guards, values):
    """The evaluation SizeGuards did before (one sympy substitution per guard and rank)."""
    for g in guards:
        subs = {**g.coordinates, **{k: sympy.Integer(v) for k, v in values.items()}}
        subs.update({k: subs[v] for k, v in g._replaced.items() if v in subs})
        for expr, where in g.conditions:
            if not bool(expr.xreplace(subs)):
                return str(expr)
    return None


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args()
    rows = ["| world | guards (all ranks) | distinct | sympy us/call | compiled us/call | ratio |", "|---|---|---|---|---|---|"]
    for world in args.worlds:
        torch.manual_seed(0)
        model = MLP(8, 16).double()
        sim = SimulatedTraining(threshold_step, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                fake_mesh((world,), ("dp",)), dynamic=True)
        sim.step(torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64))
        guards = [sim.expansions[c].size_guards for c in sim.coords]
        first = sim.expansions[sim.coords[0]]
        program = SizeProgram([], [], [s.symbol for s in first.size_symbols], [], guards)
        values = {s.symbol: 13 for s in first.size_symbols}
        assert _sympy_failing(guards, values) is None and all(c.broken(values) is None for c in program.checks())  # noqa: S101

        def compiled() -> None:
            for check in program.checks():
                check.broken(values)

        slow = _time(lambda: _sympy_failing(guards, values), max(args.repeats // 20, 20))
        fast = _time(compiled, args.repeats)
        n = sum(len(g) for g in guards)
        rows.append(f"| {world} | {n} | {len(program.checks())} | {slow:.1f} | {fast:.2f} | {slow / fast:.0f}x |")
    head = [
        "# Size guard checks per call (dynamic=True)",
        "",
        f"`python benchmarks/size_guards.py`; {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        "one process (the machine's load varies: compare the columns of one row, measured together).",
        "",
    ]
    write_results(results_path("size_guards"), head + rows)


if __name__ == "__main__":
    main()
