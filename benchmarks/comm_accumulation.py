"""Collective launches per gradient-accumulation window, compiled against DDP.

A window is ``--accumulate N`` calls of the GPT step (``comm_profile.py``'s sizes, data
parallel, gloo, world 2): N - 1 calls that run ``backward()`` only, then one that also
runs ``optimizer.step(); zero_grad()``. Four sides, each from the same weights:

* **compiled**: ``compile(plan=Plan())``: every call reduces its gradients (buckets);
* **compiled, defer_grad_sync**: ``Plan(defer_grad_sync=True)``: the calls that accumulate
  keep their gradients unreduced, the stepping call reduces them once;
* **DDP**: every call syncs (its reducer's buckets);
* **DDP no_sync**: the calls that accumulate run under ``model.no_sync()``.

Launches are counted as in ``comm_profile.py`` (every ``c10d::`` process-group call on
the main thread of rank 0's trace), per window, after two warm-up windows (the compiles,
with and without AdamW's state); the compiled sides also give their programs' static
count per call. A compiled window switches program three times (no gradient at the call,
gradients in, stepping), and each switch is a signature exchange (``driver/guard.py``):
those launches are in the run count, not in the programs'. Usage:

    python benchmarks/comm_profile.py --accumulate 5 [--rounds 3]

Writes benchmarks/results/comm_profile_accumulation.md.
"""

from __future__ import annotations

import contextlib
import copy
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
SIDES = ("compiled", "compiled, defer_grad_sync", "DDP", "DDP no_sync")
WORLD = 2


def accumulating_step(model: Any, optimizer: Any, ids: torch.Tensor, targets: torch.Tensor, do_step: bool, window: int) -> torch.Tensor:
    """The usual accumulation loop body: the loss of 1/window of the batch, backward, and
    an optimizer step at the window's last call."""
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()) / window
    loss.backward()
    if do_step:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def _worker(rank: int, world: int, args: Any) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from comm_profile import trace_counts

    torch.manual_seed(0)
    torch.set_num_threads(1)
    base = GPT(gs._cfg(args))
    models = {s: copy.deepcopy(base) for s in SIDES}
    models["DDP"], models["DDP no_sync"] = (gs._peer("dp", models[s], world) for s in ("DDP", "DDP no_sync"))
    opts = {s: torch.optim.AdamW(m.parameters(), lr=1e-3) for s, m in models.items()}
    steps = {s: sc.compile(accumulating_step, mesh={"dp": world}, plan=sc.Plan(defer_grad_sync=s.endswith("defer_grad_sync")))
             for s in SIDES if s.startswith("compiled")}
    n = args.accumulate

    def window(side: str, w: int) -> list[tuple[int, int]]:
        static = []
        for k in range(n):
            ids, tg = gs._local_batch("dp", *gs._batch(w * n + k, args), world, rank)
            do_step = k == n - 1
            if side in steps:
                steps[side](models[side], opts[side], ids, tg, do_step, n).item()
                summary = steps[side].comm_summary()
                static.append((sum(g.launches for g in summary.groups), summary.total_bytes))
            else:
                quiet = models[side].no_sync() if side == "DDP no_sync" and not do_step else contextlib.nullcontext()
                with quiet:
                    accumulating_step(models[side], opts[side], ids, tg, do_step, n).item()
        return static

    w = 0
    for _ in range(2):  # compiles: without, then with AdamW's state
        for side in SIDES:
            window(side, w)
        w += 1
    launches: dict[str, list[float]] = {s: [] for s in SIDES}
    static: dict[str, list[tuple[int, int]]] = {}
    for r in range(args.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            torch.distributed.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                static[side] = window(side, w)
            launches[side].append(trace_counts(list(prof.events()), 1)["launches"])
        w += 1
    ref = {name: p.detach() for name, p in models["DDP no_sync"].module.named_parameters()}
    parity = {
        side: max((p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).sub(ref[name]).abs().max().item()
                  for name, p in (models[side].module if hasattr(models[side], "module") else models[side]).named_parameters())
        for side in SIDES
    }
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    return {"launches": {s: statistics.median(v) for s, v in launches.items()}, "static": static, "parity": parity,
            "windows": w, "grad_bytes": grad_bytes}


def run(args: Any) -> None:
    got = run_processes(_worker, WORLD, args, timeout=3600)[0]
    n = args.accumulate
    lines = ["| side | launches / window (run) | program launches per call | bytes / window | max abs param diff vs DDP no_sync |",
             "|---|---|---|---|---|"]
    for side in SIDES:
        if got["static"].get(side):
            per_call = ", ".join(str(c) for c, _ in got["static"][side])
            nbytes = f"{sum(b for _, b in got['static'][side]):,} (programs)"
        else:
            syncs = n if side == "DDP" else 1
            per_call, nbytes = "-", f"{syncs * got['grad_bytes']:,} (gradients x {syncs} syncs)"
        lines.append(f"| {side} | {got['launches'][side]:g} | {per_call} | {nbytes} | {got['parity'][side]:.2e} |")
    ours, deferred = got["launches"]["compiled"], got["launches"]["compiled, defer_grad_sync"]
    text = [
        "# Collective launches per gradient-accumulation window",
        "",
        f"`python benchmarks/comm_profile.py{''.join(' ' + a for a in sys.argv[1:])}` on {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, gloo, world {WORLD}, data parallel, rank 0's trace.",
        f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, global batch {args.batch}, AdamW.",
        f"A window: {n - 1} calls that accumulate, then one that steps. Medians over {args.rounds} profiled windows per side "
        f"(order swapped every round), after 2 warm-up windows; parameters compared after {got['windows']} windows.",
        "Launches (run): `c10d::` process-group calls per window, signature exchanges at program switches included; "
        "program launches: the compiled program's collectives, per call of the window.",
        "",
        "\n".join(lines),
        "",
        f"defer_grad_sync launches {deferred:g} per window against {ours:g} without it "
        f"({ours - deferred:g} fewer); DDP: {got['launches']['DDP']:g} syncing every call, {got['launches']['DDP no_sync']:g} under no_sync.",
        "",
    ]
    write_results(args.out if args.out != str(results_path("comm_profile")) else RESULTS, text)
