"""Collective launches and exposed communication per step, compiled against the peers.

For the GPT, plans, peers and worlds of ``step_time.py`` (dp: DDP, fsdp: FSDP2, tp: eager
DTensor TP, 2d: eager DTensor TP + per-parameter dp all_reduce; gloo, world 2, 2-D 2 x 2),
every rank builds both sides and alternates them under ``torch.profiler``, a few steps
each, in an order swapped every round. From each trace, per step:

* **launches**: the collectives the run launched, counted from the trace: every ``c10d::``
  operator the main thread called (``allreduce_``, ``_allgather_base_``,
  ``_reduce_scatter_base_``, ``broadcast_``...: the process group calls of functional
  collectives, DDP's reducer, FSDP2 and the step check alike), next to the compiled
  program's static count per process group, how many of those are buckets (one
  collective fused from several values), and its bytes per step against ``step_time``'s
  analytic minimum for the plan.
* **exposed communication**: main-thread time during which a gloo collective is in
  flight (a ``gloo:*`` event on a gloo worker thread) and the main thread runs no
  operator of its own (it blocks in a ``wait_tensor``, in a process-group call, in DDP's
  reducer waiting for a bucket, in an FSDP2 wait, or sits between ops). Share = exposed / step time, both from
  the same profiled steps; ``wait_tensor`` is the compiled side's blocking waits alone.

Absolute times are noise on a shared machine (the profiler adds its own cost to both
sides); launch counts are exact, and the shares are what to compare. Usage:

    python benchmarks/comm_profile.py [--kinds dp fsdp tp 2d] [--rounds 5] [--steps 3]
    python benchmarks/comm_profile.py --accumulate 5   # launches per accumulation window

Writes benchmarks/results/comm_profile.md (``--accumulate``: comm_profile_accumulation.md,
see ``comm_accumulation.py``).
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # gpt_setup.py, _table.py

import gpt_setup as gs  # noqa: E402
from _table import results_path, write_results  # noqa: E402

import spmd_compiler as sc  # noqa: E402
from spmd_compiler.runtime.launch import run_processes  # noqa: E402
from spmd_compiler.testing.models import GPT, train_step  # noqa: E402

RESULTS = results_path("comm_profile")
PEER_NAMES = {"dp": "DDP", "fsdp": "FSDP2", "tp": "eager DTensor TP", "2d": "eager DTensor 2-D"}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _is_wait(name: str) -> bool:
    return "wait" in name.lower()


def trace_counts(events: list[Any], steps: int) -> dict[str, Any]:
    """Launches, exposed communication and wait_tensor time per step (ms) from the
    FunctionEvents of ``steps`` profiled steps."""
    by_thread = collections.Counter(e.thread for e in events if e.name.startswith("aten::"))
    main = by_thread.most_common(1)[0][0]
    mine = [e for e in events if e.thread == main]
    launches = collections.Counter(e.name for e in mine if e.name.startswith("c10d::"))
    # busy: the main thread inside an operator of its own (innermost events); waits and
    # process-group calls are not (DDP's buffer broadcast blocks inside c10d::broadcast_)
    busy = _union([(e.time_range.start, e.time_range.end) for e in mine
                   if not e.cpu_children and not _is_wait(e.name) and not e.name.startswith(("c10d::", "gloo:"))])
    inflight = _union([(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("gloo:")])
    start = min(e.time_range.start for e in mine)
    end = max(e.time_range.end for e in mine)
    idle, cursor = [], start
    for a, b in busy:
        if a > cursor:
            idle.append((cursor, a))
        cursor = max(cursor, b)
    if end > cursor:
        idle.append((cursor, end))
    exposed = _length(_intersect(inflight, idle))
    waits = sum(e.time_range.end - e.time_range.start for e in mine if e.name == "_c10d_functional::wait_tensor")
    return {
        "launches": sum(launches.values()) / steps,
        "by_op": {k: v / steps for k, v in sorted(launches.items())},
        "exposed_ms": exposed / 1e3 / steps,
        "wait_ms": waits / 1e3 / steps,
        "inflight_ms": _length(inflight) / 1e3 / steps,
    }


def _static(step: Any) -> dict[str, Any]:
    """The compiled program's collectives: per process group launches and buckets, bytes,
    and what each single (unbucketed) launch is."""
    summary = step.comm_summary()
    singles = collections.Counter()
    for n in step.last.gm.graph.nodes:
        comm = n.meta.get("spmd_comm")
        if comm is not None and len(comm.get("bucket") or ()) < 2:
            singles[f"{n.meta.get('spmd_phase')} {comm['kind']} on {comm['axis_name']}: {comm['reason'].split(':')[0][:70]}"] += 1
    return {
        "groups": [(g.axis, g.launches, g.buckets, g.bucketed) for g in summary.groups],
        "launches": summary.total_count,
        "bytes": summary.total_bytes,
        "singles": dict(singles),
    }


class _TimedWait:
    """A ``wait_tensor`` that adds its blocking time to ``acc[label]``."""

    def __init__(self, label: str, acc: dict[str, list[float]]) -> None:
        self.label, self.acc = label, acc
        self.__name__ = "timed_wait"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = torch.ops._c10d_functional.wait_tensor.default(x)
        self.acc[self.label][0] += time.perf_counter() - t0
        return out


def _wait_label(wait: Any) -> str:
    coll = wait.args[0]
    comm = coll.meta.get("spmd_comm", {})
    members = len(comm.get("bucket") or ())
    why = f"bucket of {members}" if members > 1 else comm.get("reason", "?").split(":")[0][:60]
    return f"{coll.meta.get('spmd_phase')} {comm.get('kind')} on {comm.get('axis_name')}: {why}"


def _timed_waits(step: Any, run: Any, steps: int) -> tuple[dict[str, tuple[float, int]], float]:
    """Blocking time (ms per step) and count of the compiled program's waits, by what they
    wait for, and the step time (ms): the runner that ran last, rebuilt with every wait
    timed, for ``steps`` steps."""
    from spmd_compiler.driver.guard import first_effect
    from spmd_compiler.runtime.executor import compile_runner

    prog = step.last
    folded = getattr(prog, "folded_runner", None) is not None
    gm = prog.folded_gm if folded else prog.gm
    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    waits = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops._c10d_functional.wait_tensor.default]
    for w in waits:
        w.target = _TimedWait(_wait_label(w), acc)
        acc[w.target.label][1] += 1
    try:
        timed = compile_runner(gm, guard=True, check_before=first_effect(gm))
    finally:
        for w in waits:
            w.target = torch.ops._c10d_functional.wait_tensor.default
    attr = "folded_runner" if folded else "runner"
    original = getattr(prog, attr)
    setattr(prog, attr, timed)
    try:
        t0 = time.perf_counter()
        for k in range(steps):
            run(k)
        wall = time.perf_counter() - t0
    finally:
        setattr(prog, attr, original)
    return {label: (v[0] * 1e3 / steps, v[1]) for label, v in acc.items()}, wall * 1e3 / steps


def _worker(rank: int, world: int, kind: str, args: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(gs._cfg(args))
    models = {"ours": copy.deepcopy(model), "peer": gs._peer(kind, copy.deepcopy(model), world)}
    opts = {side: torch.optim.AdamW(m.parameters(), lr=1e-3) for side, m in models.items()}
    plan, mesh = gs._plan(kind, world)
    step = sc.compile(train_step, mesh=mesh, plan=plan)

    def run(side: str, i: int) -> None:
        ids, tg = gs._local_batch(kind, *gs._batch(i, args), world, rank)
        if side == "peer":
            loss = train_step(models[side], opts[side], ids, tg)
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        else:
            loss = step(models[side], opts[side], ids, tg)
        loss.item()

    i = 0
    for _ in range(args.warmup):  # compiles (first and steady AdamW state), warms both sides
        for side in ("ours", "peer"):
            run(side, i)
        i += 1
    got: dict[str, list[dict[str, Any]]] = {"ours": [], "peer": []}
    for r in range(args.rounds):
        for side in (("ours", "peer") if r % 2 == 0 else ("peer", "ours")):
            dist.barrier()  # every rank starts the round together: no skew left from the other side
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for k in range(args.steps):
                    run(side, i + k)
                wall = (time.perf_counter() - t0) / args.steps
            counts = trace_counts(list(prof.events()), args.steps)
            counts["step_ms"] = wall * 1e3
            got[side].append(counts)
        i += args.steps
    dist.barrier()
    waits, waits_step_ms = _timed_waits(step, lambda k: run("ours", i + k), args.rounds * args.steps)
    out: dict[str, Any] = {"static": _static(step), "checks": dict(step.checks), "waits": waits, "waits_step_ms": waits_step_ms}
    for side, rounds in got.items():
        out[side] = {
            "launches": statistics.median(c["launches"] for c in rounds),
            "launches_min_max": (min(c["launches"] for c in rounds), max(c["launches"] for c in rounds)),
            "by_op": rounds[-1]["by_op"],
            "step_ms": statistics.median(c["step_ms"] for c in rounds),
            "exposed_ms": statistics.median(c["exposed_ms"] for c in rounds),
            "share": statistics.median(c["exposed_ms"] / c["step_ms"] for c in rounds),
            "wait_ms": statistics.median(c["wait_ms"] for c in rounds),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["dp", "fsdp", "tp", "2d"])
    p.add_argument("--rounds", type=int, default=5, help="profiled rounds per side, alternating")
    p.add_argument("--steps", type=int, default=3, help="steps per profiled round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--accumulate", type=int, default=0, metavar="N",
                   help="instead: launches per gradient-accumulation window of N calls (dp and fsdp of --kinds: compiled "
                        "with and without Plan(defer_grad_sync=True), DDP/FSDP2 syncing or not), in comm_profile_accumulation.md")
    args = p.parse_args()
    if args.accumulate:
        if args.accumulate < 2:
            p.error(f"--accumulate {args.accumulate}: expected a window of at least 2 calls")
        args.accumulate_kinds = [k for k in args.kinds if k in ("dp", "fsdp")]
        if not args.accumulate_kinds:
            p.error(f"--accumulate with --kinds {args.kinds}: expected dp or fsdp among them")
        import comm_accumulation

        comm_accumulation.run(args)
        return

    rows = []
    for kind in args.kinds:
        world = gs.TIMING_WORLD[kind]
        got = run_processes(_worker, world, kind, args, timeout=3600)[0]
        minimum = gs.analytic_min(kind, args, world)
        rows.append((kind, world, got, minimum))
        o, q = got["ours"], got["peer"]
        print(f"{kind}: launches {o['launches']:.0f} (static {got['static']['launches']}) vs {PEER_NAMES[kind]} {q['launches']:.0f}; "
              f"exposed {o['share']:.0%} vs {q['share']:.0%}", flush=True)

    head = ("| plan | world | launches/step run (static) | groups: launches / buckets (values) | step check | "
            "bytes/step / minimum | exposed ms (share) | wait_tensor ms | step ms | peer | peer launches/step | "
            "peer exposed ms (share) | peer step ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    singles, ops = [], []
    for kind, world, got, minimum in rows:
        s, o, q = got["static"], got["ours"], got["peer"]
        groups = "; ".join(f"{a}: {n} / {b} ({v})" for a, n, b, v in s["groups"])
        spread = "" if o["launches_min_max"][0] == o["launches_min_max"][1] else f" [{o['launches_min_max'][0]:g}-{o['launches_min_max'][1]:g}]"
        lines.append(
            f"| {kind} | {world} | {o['launches']:g}{spread} ({s['launches']}) | {groups} | {', '.join(sorted(got['checks']))} | "
            f"{s['bytes']:,} / {minimum:,} = {s['bytes'] / minimum:.3f} | {o['exposed_ms']:.1f} ({o['share']:.0%}) | {o['wait_ms']:.1f} | "
            f"{o['step_ms']:.1f} | {PEER_NAMES[kind]} | {q['launches']:g} | {q['exposed_ms']:.1f} ({q['share']:.0%}) | {q['step_ms']:.1f} |"
        )
        singles += [f"| {kind} | {what} | {n} |" for what, n in sorted(s["singles"].items())]
        ops.append(f"| {kind} | " + ", ".join(f"{k.removeprefix('c10d::')} {v:g}" for k, v in o["by_op"].items())
                   + " | " + ", ".join(f"{k.removeprefix('c10d::')} {v:g}" for k, v in q["by_op"].items()) + " |")
    wait_lines = ["| plan | wait for | waits/step | blocked ms/step | share of step |", "|---|---|---|---|---|"]
    for kind, world, got, minimum in rows:
        step_ms = got["waits_step_ms"]
        total = sum(ms for ms, _ in got["waits"].values())
        wait_lines.append(f"| {kind} | all waits (step {step_ms:.1f} ms) | {sum(n for _, n in got['waits'].values())} | {total:.2f} | {total / step_ms:.1%} |")
        for label, (ms, n) in sorted(got["waits"].items(), key=lambda kv: -kv[1][0]):
            wait_lines.append(f"| {kind} | {label} | {n} | {ms:.2f} | {ms / step_ms:.1%} |")
    reading = []
    for kind, world, got, minimum in rows:
        s, o = got["static"], got["ours"]
        top = max(got["waits"].items(), key=lambda kv: kv[1][0]) if got["waits"] else ("none", (0.0, 0))
        extra = o["launches"] - s["launches"]
        reading.append(
            f"* {kind}: {o['launches']:g} launches per step in the run, {s['launches']} in the program"
            + (f" (+{extra:g}: the standalone step check)" if extra > 0 else "")
            + f"; {sum(b for _, _, b, _ in s['groups'])} of them buckets. Longest wait: {top[0]} "
            f"({top[1][0]:.1f} ms, {top[1][0] / got['waits_step_ms']:.0%} of the step)."
        )
    text = [
        "# Collective launches and exposed communication per step",
        "",
        f"`python benchmarks/comm_profile.py{''.join(' ' + a for a in sys.argv[1:])}` on {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, gloo, one thread per process, rank 0's trace.",
        f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, global batch {args.batch}, AdamW.",
        f"Each side profiled {args.rounds} rounds x {args.steps} steps, alternating (order swapped every round); medians over rounds.",
        "Launches (run): `c10d::` process-group calls per step in the trace; (static): collectives of the compiled program.",
        "Groups: per process group, the program's launches / how many are buckets (values fused into them).",
        "Exposed: main-thread time with a gloo collective in flight and no operator of its own running; share = exposed / step time.",
        "",
        "\n".join(lines),
        "",
        "\n".join(reading),
        "",
        "## Launches by process-group call (per step, compiled | peer)",
        "",
        "| plan | compiled | peer |",
        "|---|---|---|",
        "\n".join(ops),
        "",
        "## Where the compiled step blocks (each wait timed by the runner, no profiler, same number of steps)",
        "",
        "\n".join(wait_lines),
        "",
        "## Single (unbucketed) launches of the compiled programs",
        "",
        "| plan | collective: why | per step |",
        "|---|---|---|",
        "\n".join(singles),
        "",
    ]
    write_results(args.out, text)


if __name__ == "__main__":
    main()
