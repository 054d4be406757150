"""``python benchmarks/compile_time.py --dynamic``: symbolic batch sizes (issue #17).

Two measurements per plan (``--plans``, :data:`PLANS`), in the simulator (one process, a
fake mesh; see docs/dynamic_shapes.md):

    loop        a training loop over 10 batch sizes (``SIZES``, even and uneven over the
                ranks) with ``dynamic=True`` against ``dynamic=False``: compiles and
                seconds spent compiling (trace, expansion of every rank, passes), and the
                loop's total seconds. The optimizer state exists before the loop (one
                eager step, as compile_time.py traces the steady step), so a compile is
                a batch size's, never the state's
    step time   rank 0's per-rank program of each kind run directly on the fake process
                group (collectives return at once, so this is the program's own cost),
                for the same rank-0 inputs; the two alternate rep by rep, the order
                swapped every rep, and the figure is the median of the per-rep ratios
                symbolic / concrete (the issue's target: at most 1.02). The collectives
                of both programs (by kind) and the ops whose counts differ are reported

Writes benchmarks/results/compile_time_dynamic.md.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import Shard

import spmd_compiler as sc
from _table import results_path, write_results
from spmd_compiler.testing import fake_mesh
from spmd_compiler.testing.harness import SimulatedTraining
from spmd_compiler.testing.models import GPT, MLP, _tp_params, gpt_2d_plan, gpt_fsdp_plan, mse_train_step, train_step
from spmd_compiler.testing.simulate import example_inputs

RESULTS = results_path("compile_time_dynamic")
SIZES = [33, 32, 17, 8, 5, 31, 16, 7, 1, 24]
GPT_CFG = {"vocab": 64, "seq": 16, "dim": 32, "heads": 4, "layers": 2}


@dataclass(frozen=True)
class Setup:
    """One plan of the benchmark: model and optimizer, step, a global batch of ``b``
    rows, the mesh for ``world`` ranks and the plan."""

    make: Callable[[], tuple[torch.nn.Module, Any]]
    step_fn: Callable[..., Any]
    batch: Callable[[int], tuple]
    mesh: Callable[[int], Any]
    plan: Callable[[], Any]
    text: str


def setups(cfg: dict | None = None) -> dict[str, Setup]:
    """The plans by name; ``cfg``: the GPT's config (default :data:`GPT_CFG`)."""
    cfg = dict(GPT_CFG if cfg is None else cfg)

    def mlp() -> Any:
        torch.manual_seed(0)
        model = MLP(64, 256)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def gpt() -> Any:
        torch.manual_seed(0)
        model = GPT(**cfg)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def ids(b: int) -> tuple:
        return torch.randint(0, cfg["vocab"], (b, cfg["seq"])), torch.randint(0, cfg["vocab"], (b, cfg["seq"]))

    def dp(world: int) -> Any:
        return fake_mesh((world,), ("dp",))

    def tp(world: int) -> Any:
        return fake_mesh((world,), ("tp",))

    def two_d(world: int) -> Any:
        return fake_mesh((world // 2, 2), ("dp", "tp"))

    def seq_tp() -> Any:  # Megatron TP, the batch split along the sequence (dim 1)
        return sc.Plan(params=_tp_params(1, 0), default_input=[Shard(1)])

    gpt_text = "GPT ({vocab} vocab, seq {seq}, dim {dim}, {heads} heads, {layers} layers), AdamW, cross-entropy".format(**cfg)
    return {
        "mlp": Setup(mlp, mse_train_step, lambda b: (torch.randn(b, 64), torch.randn(b, 64)), dp, lambda: None,
                     "MLP 64-256-64, SGD, MSE; data parallel on `world` ranks"),
        "dp": Setup(gpt, train_step, ids, dp, lambda: None, f"{gpt_text}; data parallel on `world` ranks"),
        "fsdp": Setup(gpt, train_step, ids, dp, gpt_fsdp_plan, "the GPT; `gpt_fsdp_plan()` (FSDP, reshard after forward) on `world` ranks"),
        "tp_seq": Setup(gpt, train_step, ids, tp, seq_tp,
                        "the GPT; Megatron TP on `world` ranks, the batch split along the sequence (`Shard(1)`; B symbolic, the split T static)"),
        "2d": Setup(gpt, train_step, ids, two_d, gpt_2d_plan, "the GPT; `gpt_2d_plan()`: dp `world/2` x Megatron tp 2"),
    }


PLANS = list(setups())


class _TimedSimulation(SimulatedTraining):
    """SimulatedTraining that adds up the seconds its compiles take."""

    compile_seconds = 0.0

    def _compile(self, batch: tuple) -> None:
        t0 = time.perf_counter()
        super()._compile(batch)
        self.compile_seconds += time.perf_counter() - t0


def _steady(s: Setup) -> tuple[torch.nn.Module, Any]:
    """Model and optimizer after one eager step: the optimizer state exists."""
    model, opt = s.make()
    s.step_fn(model, opt, *s.batch(8))
    return model, opt


def loop(name: str, world: int, dynamic: bool, sizes: list[int] = SIZES, cfg: dict | None = None) -> dict:
    """One step per batch size in ``sizes``: compiles, compile and loop seconds, the reasons
    of every compile after the first, and rank 0's program at the end with its last batch."""
    s = setups(cfg)[name]
    model, opt = _steady(s)
    sim = _TimedSimulation(s.step_fn, model, opt, s.mesh(world), s.plan(), dynamic=dynamic)
    t0 = time.perf_counter()
    for b in sizes:
        batch = s.batch(b)
        sim.step(*batch)
    return {"compiles": sim.compiles, "compile s": sim.compile_seconds, "loop s": time.perf_counter() - t0,
            "reasons": sim.reasons[1:], "program": sim.expansions[sim.coords[0]], "batch": batch}


def program(name: str, world: int, b: int, dynamic: bool, cfg: dict | None = None) -> tuple[Any, tuple]:
    """Rank 0's program compiled by a first step on a global batch of ``b`` rows, and that batch."""
    s = setups(cfg)[name]
    model, opt = _steady(s)
    sim = SimulatedTraining(s.step_fn, model, opt, s.mesh(world), s.plan(), dynamic=dynamic)
    batch = s.batch(b)
    sim.step(*batch)
    return sim.expansions[sim.coords[0]], batch


def collectives(gm: torch.fx.GraphModule) -> Counter:
    """The program's collectives by kind (all_reduce, all_gather, ...)."""
    return Counter(n.meta["spmd_comm"]["kind"] for n in gm.graph.nodes if "spmd_comm" in n.meta)


def op_differences(sym: torch.fx.GraphModule, conc: torch.fx.GraphModule, top: int = 8) -> list[tuple[str, int, int]]:
    """The call targets whose counts differ between the two programs, ``(target, symbolic,
    concrete)``, largest difference first; integer size arithmetic included."""
    def count(gm: torch.fx.GraphModule) -> Counter:
        return Counter(getattr(n.target, "__name__", str(n.target)) if n.op == "call_function" else n.op
                       for n in gm.graph.nodes if n.op not in ("placeholder", "output"))

    a, b = count(sym), count(conc)
    diff = [(k, a[k], b[k]) for k in set(a) | set(b) if a[k] != b[k]]
    return sorted(diff, key=lambda d: (-abs(d[1] - d[2]), d[0]))[:top]


def _feeds(sym: Any, conc: Any, batch: tuple) -> tuple[list, list]:
    """The same rank-0 inputs for both programs, by placeholder name; the symbolic one is
    fed the global sizes of ``batch`` as well (its ``size_*`` inputs)."""
    conc_names = [n.name for n in conc.gm.graph.find_nodes(op="placeholder")]
    conc_in = dict(zip(conc_names, example_inputs(conc.gm)))
    globals_ = {f"batch[{i}]": t for i, t in enumerate(batch)}
    sizes = {s.symbol: globals_[s.label].shape[s.dim] for s in sym.size_symbols}
    sym_in = []
    for n in sym.gm.graph.find_nodes(op="placeholder"):
        if n.name in conc_in:
            sym_in.append(conc_in[n.name])
        else:
            match = [v for k, v in sizes.items() if n.name == f"size_{k}"]
            assert len(match) == 1, f"placeholder {n.name} of the symbolic program has no value (sizes {sizes})"
            sym_in.append(match[0])
    assert len(sym_in) == len(conc_names) + len(sizes), "the programs' inputs differ beyond the sizes"
    return copy.deepcopy(sym_in), copy.deepcopy(list(conc_in.values()))  # each side updates its own parameters


def step_ratio(name: str, world: int, b: int, reps: int, cfg: dict | None = None) -> dict:
    """Median ratio symbolic / concrete of rank 0's program at global batch ``b``, and
    both programs' collectives and op differences."""
    sym, batch = program(name, world, b, dynamic=True, cfg=cfg)
    conc, _ = program(name, world, b, dynamic=False, cfg=cfg)
    assert sym.size_symbols and not conc.size_symbols, "expected one symbolic and one concrete program"
    inputs = dict(zip(("sym", "conc"), _feeds(sym, conc, batch)))
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
        "sym comms": collectives(sym.gm), "conc comms": collectives(conc.gm), "ops": op_differences(sym.gm, conc.gm),
    }


def _comms_text(c: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"


def run_dynamic(world: int, reps: int, plans: list[str] | None = None) -> None:
    plans = plans or PLANS
    unknown = [p for p in plans if p not in PLANS]
    if unknown:
        raise ValueError(f"--plans: expected names from {PLANS}, got {unknown}")
    loops, ratios = [], []
    for name in plans:
        row = {"plan": name}
        for dynamic in (True, False):
            r = loop(name, world, dynamic)
            row.update({f"{k} {'dyn' if dynamic else 'static'}": v for k, v in r.items() if k not in ("program", "batch")})
        loops.append(row)
        print(f"{name}: dynamic {row['compiles dyn']} compiles {row['compile s dyn']:.1f}s, "
              f"static {row['compiles static']} compiles {row['compile s static']:.1f}s", flush=True)
        for b in (64 * world, 64 * world - 1):  # even and uneven over the ranks
            r = step_ratio(name, world, b, reps)
            ratios.append({"plan": name, **r})
            print(f"{name} batch {b}: symbolic / concrete {r['ratio']:.3f}; collectives symbolic {_comms_text(r['sym comms'])}, "
                  f"concrete {_comms_text(r['conc comms'])}", flush=True)
    head = ["| plan | compiles dynamic=True | compiles dynamic=False | compile s dynamic=True | compile s dynamic=False | "
            "compile s static / dynamic | loop s dynamic=True | loop s dynamic=False |", "|---|---|---|---|---|---|---|---|"]
    for r in loops:
        head.append(f"| {r['plan']} | {r['compiles dyn']} | {r['compiles static']} | {r['compile s dyn']:.1f} | "
                    f"{r['compile s static']:.1f} | {r['compile s static'] / r['compile s dyn']:.1f}x | {r['loop s dyn']:.1f} | "
                    f"{r['loop s static']:.1f} |")
    steps = ["| plan | global batch | per-rank nodes symbolic | per-rank nodes concrete | integer size nodes | "
             "symbolic ms | concrete ms | symbolic / concrete (paired median) | collectives symbolic | collectives concrete |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ratios:
        steps.append(f"| {r['plan']} | {r['batch']} | {r['sym nodes']} | {r['conc nodes']} | {r['size nodes']} | "
                     f"{r['sym ms']:.2f} | {r['conc ms']:.2f} | {r['ratio']:.3f} | {_comms_text(r['sym comms'])} | "
                     f"{_comms_text(r['conc comms'])} |")
    ops = [f"* {r['plan']}, batch {r['batch']}: " + ("; ".join(f"`{t}` {a} / {b}" for t, a, b in r["ops"]) or "none")
           for r in ratios]
    again = [f"* {r['plan']}, dynamic=True, compile {i + 2}: {why}" for r in loops for i, why in enumerate(r["reasons dyn"])]
    text = "\n".join(head) + "\n\n" + "\n".join(steps)
    described = "; ".join(f"`{k}` = {setups()[k].text}" for k in plans)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# Compile time and step time with symbolic batch sizes (`dynamic=True`)",
        "",
        f"`python benchmarks/compile_time.py --dynamic --world {world} --reps {reps} --plans {','.join(plans)}` on "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, one thread; load average {load:.1f} at "
        "the end of the run (the machine is shared with other jobs: absolute seconds are inflated, ratios taken in one run "
        "are what to read).",
        f"Simulated mesh (`SimulatedTraining`, fake process group), `world` = {world}: {described}.",
        "",
        f"**Loop**: one training step for each batch size {SIZES}, the optimizer state created by one eager step before",
        "(so a compile is a size's). `compile s` counts every compile (trace, expansion of every rank, default passes);",
        "`loop s` the whole loop (compiles plus the simulated steps).",
        "",
        "\n".join(head),
        "",
        *(["Why a symbolic loop compiled more than once:", "", *again, ""] if again else []),
        "**Step time**: rank 0's per-rank program of each kind (symbolic: takes the global sizes as int inputs and",
        "computes the sizes that depend on them; concrete: `dynamic=False` for that batch), run directly on the fake process",
        f"group with the same rank-0 inputs, alternating (order swapped every rep), 3 warm-up then {reps} reps each;",
        "the ratio is the median of the per-rep ratios. Target of the issue: symbolic / concrete at most 1.02.",
        "",
        "\n".join(steps),
        "",
        "Ops whose counts differ, `target` symbolic / concrete (largest differences first, at most 8; integer size",
        "arithmetic of the symbolic program included):",
        "",
        *ops,
        "",
    ]
    write_results(RESULTS, lines, show=text)
