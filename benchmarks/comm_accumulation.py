"""Collective launches per gradient-accumulation window, compiled against DDP and FSDP2.

A window is ``--accumulate N`` calls of the GPT step (``comm_profile.py``'s sizes, gloo,
world 2): N - 1 calls that run ``backward()`` only, then one that also runs
``optimizer.step(); zero_grad()``. For data parallel (dp) and FSDP (fsdp, parameters kept
gathered for backward as by FSDP2's ``reshard_after_forward=False``), four sides each, from
the same weights:

* **compiled**: every call reduces its gradients (buckets);
* **compiled, defer_grad_sync**: ``Plan(defer_grad_sync=True)``: the calls that accumulate
  keep their gradients unreduced, the stepping call reduces them once;
* **DDP** / **FSDP2**: every call syncs;
* **DDP no_sync** / **FSDP2 no sync**: the calls that accumulate run under
  ``model.no_sync()`` (FSDP2: ``set_requires_gradient_sync(False)``).

Launches are counted as in ``comm_profile.py`` (every ``c10d::`` process-group call on
the main thread of rank 0's trace), per window, after two warm-up windows (the compiles,
with and without AdamW's state); the compiled sides also give their programs' static
count per call. A compiled window switches program three times (no gradient at the call,
gradients in, stepping); a switch to a cached program exchanges no signatures (its id
rides in the step check, ``driver/fold.py``), so the run count minus the programs' is
what the checks and switches cost. Usage:

    python benchmarks/comm_profile.py --accumulate 5 [--rounds 3]

Writes benchmarks/results/comm_profile_accumulation.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import platform
import statistics
import sys
from typing import Any

import torch
import torch.nn.functional as F

import gpt_setup as gs
from _table import results_path, write_results

import spmd_compiler as sc
from spmd_compiler.runtime.launch import run_processes
from spmd_compiler.testing.models import GPT

RESULTS = results_path("comm_profile_accumulation")
KINDS = {"dp": "DDP", "fsdp": "FSDP2"}
WORLD = 2


def sides(kind: str) -> tuple[str, ...]:
    peer = KINDS[kind]
    return ("compiled", "compiled, defer_grad_sync", peer, f"{peer} no_sync")


def accumulating_step(model: Any, optimizer: Any, ids: torch.Tensor, targets: torch.Tensor, do_step: bool, window: int) -> torch.Tensor:
    """The usual accumulation loop body: the loss of 1/window of the batch, backward, and
    an optimizer step at the window's last call."""
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()) / window
    loss.backward()
    if do_step:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _measure(kind: str, rank: int, world: int, args: Any) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from comm_profile import trace_counts

    names = sides(kind)
    peer, quiet_side = names[2], names[3]
    torch.manual_seed(0)
    base = GPT(gs._cfg(args))
    models = {s: copy.deepcopy(base) for s in names}
    models[peer], models[quiet_side] = (gs._peer(kind, models[s], world) for s in (peer, quiet_side))
    opts = {s: torch.optim.AdamW(m.parameters(), lr=1e-3) for s, m in models.items()}
    plan, mesh = gs._plan(kind, world)
    plan = plan or sc.Plan()
    steps = {s: sc.compile(accumulating_step, mesh=mesh, plan=dataclasses.replace(plan, defer_grad_sync=s.endswith("defer_grad_sync")))
             for s in names if s.startswith("compiled")}
    n = args.accumulate

    def quiet(side: str, do_step: bool) -> Any:
        if side != quiet_side:
            return contextlib.nullcontext()
        if kind == "dp":
            return models[side].no_sync() if not do_step else contextlib.nullcontext()
        models[side].set_requires_gradient_sync(do_step)
        return contextlib.nullcontext()

    def window(side: str, w: int) -> list[tuple[int, int]]:
        static = []
        for k in range(n):
            ids, tg = gs._local_batch(kind, *gs._batch(w * n + k, args), world, rank)
            do_step = k == n - 1
            if side in steps:
                steps[side](models[side], opts[side], ids, tg, do_step, n).item()
                summary = steps[side].comm_summary()
                static.append((sum(g.launches for g in summary.groups), summary.total_bytes))
            else:
                with quiet(side, do_step):
                    accumulating_step(models[side], opts[side], ids, tg, do_step, n).item()
        return static

    w = 0
    for _ in range(2):  # compiles: without, then with AdamW's state
        for side in names:
            window(side, w)
        w += 1
    launches: dict[str, list[float]] = {s: [] for s in names}
    static: dict[str, list[tuple[int, int]]] = {}
    for r in range(args.rounds):
        for side in (names if r % 2 == 0 else names[::-1]):
            torch.distributed.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                static[side] = window(side, w)
            launches[side].append(trace_counts(list(prof.events()), 1)["launches"])
        w += 1
    unwrap = lambda m: m.module if hasattr(m, "module") else m  # noqa: E731
    ref = {name: _full(p) for name, p in unwrap(models[quiet_side]).named_parameters()}
    parity = {side: max(_full(p).sub(ref[name]).abs().max().item() for name, p in unwrap(models[side]).named_parameters())
              for side in names}
    checks = {s: dict(steps[s].checks) for s in steps}
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    return {"launches": {s: statistics.median(v) for s, v in launches.items()}, "static": static, "parity": parity,
            "windows": w, "grad_bytes": grad_bytes, "checks": checks}


def _worker(rank: int, world: int, args: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {kind: _measure(kind, rank, world, args) for kind in args.accumulate_kinds}


def _table(kind: str, got: dict[str, Any], n: int) -> list[str]:
    lines = ["| side | launches / window (run) | program launches per call | bytes / window | max abs param diff vs " + sides(kind)[3] + " |",
             "|---|---|---|---|---|"]
    for side in sides(kind):
        if got["static"].get(side):
            per_call = ", ".join(str(c) for c, _ in got["static"][side])
            nbytes = f"{sum(b for _, b in got['static'][side]):,} (programs)"
        else:
            syncs = 1 if side.endswith("no_sync") else n
            gathers = " + parameter gathers" if kind == "fsdp" else ""
            per_call, nbytes = "-", f"{syncs * got['grad_bytes']:,} (gradients x {syncs} syncs{gathers})"
        lines.append(f"| {side} | {got['launches'][side]:g} | {per_call} | {nbytes} | {got['parity'][side]:.2e} |")
    ours, deferred = got["launches"]["compiled"], got["launches"]["compiled, defer_grad_sync"]
    programs = {s: sum(c for c, _ in got["static"][s]) for s in ("compiled", "compiled, defer_grad_sync")}
    peer = sides(kind)[2]
    return [
        f"## {kind} (against {peer})",
        "",
        "\n".join(lines),
        "",
        f"defer_grad_sync launches {deferred:g} per window against {ours:g} without it ({ours - deferred:g} fewer); beyond "
        f"the programs' collectives (step checks, program switches): {deferred - programs['compiled, defer_grad_sync']:g} "
        f"and {ours - programs['compiled']:g}. {peer}: {got['launches'][peer]:g} syncing every call, "
        f"{got['launches'][sides(kind)[3]]:g} without syncing until the stepping call.",
        "",
    ]


def run(args: Any) -> None:
    got = run_processes(_worker, WORLD, args, timeout=3600)[0]
    n = args.accumulate
    text = [
        "# Collective launches per gradient-accumulation window",
        "",
        f"`python benchmarks/comm_profile.py{''.join(' ' + a for a in sys.argv[1:])}` on {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, gloo, world {WORLD}, rank 0's trace.",
        f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, global batch {args.batch}, AdamW.",
        f"A window: {n - 1} calls that accumulate, then one that steps. Medians over {args.rounds} profiled windows per side "
        f"(order swapped every round), after 2 warm-up windows; parameters compared at the end.",
        "Launches (run): `c10d::` process-group calls per window, step checks and program switches included; "
        "program launches: the compiled program's collectives, per call of the window. A program switch exchanges "
        "no signatures (the program id rides in the step check, docs/architecture.md).",
        "",
    ]
    for kind in args.accumulate_kinds:
        text += _table(kind, got[kind], n)
    write_results(args.out if args.out != str(results_path("comm_profile")) else RESULTS, text)
