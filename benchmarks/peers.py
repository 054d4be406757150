"""The strongest hand-built peers a user would pick, for ``step_time.py --strong``.

* :func:`megatron_tp`: Megatron tensor parallelism written by hand for the GPT of
  :mod:`spmd_compiler.testing.models`, no DTensor: q, k, v and fc are column-parallel
  (weight rows and bias split), out and proj row-parallel (weight columns split, bias
  added after the reduction). Megatron's ``f`` (identity forward, all_reduce backward)
  sits once before each attention and MLP, its ``g`` (all_reduce forward, identity
  backward) after them: 2 + 2 ``torch.distributed.all_reduce`` per layer. Replicated
  parameters see the same inputs on every rank, so they need no gradient reduction.
* :func:`ddp_compiled`: DistributedDataParallel with ``torch.compile`` on the model.

:func:`strong_main` runs ``step_time.py --strong``: our eager and inductor backends against
these (and FSDP2 with and without ``torch.compile``), every side in one rotation.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import spmd_compiler as sc
from spmd_compiler.testing.models import GPT, train_step


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all_reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all_reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _shard(p: torch.Tensor, dim: int, rank: int, world: int) -> nn.Parameter:
    return nn.Parameter(p.detach().chunk(world, dim)[rank].clone())


class MegatronBlock(nn.Module):
    """A GPT Block with its attention and MLP split over the default group."""

    def __init__(self, block: nn.Module, rank: int, world: int) -> None:
        super().__init__()
        attn = block.attn
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.heads, self.head_dim = attn.heads // world, attn.head_dim
        self.register_buffer("mask", attn.mask, persistent=False)
        for name in ("q", "k", "v"):
            lin = getattr(attn, name)
            setattr(self, f"{name}_w", _shard(lin.weight, 0, rank, world))
            setattr(self, f"{name}_b", _shard(lin.bias, 0, rank, world))
        self.out_w, self.out_b = _shard(attn.out.weight, 1, rank, world), attn.out.bias
        self.fc_w, self.fc_b = _shard(block.fc.weight, 0, rank, world), _shard(block.fc.bias, 0, rank, world)
        self.proj_w, self.proj_b = _shard(block.proj.weight, 1, rank, world), block.proj.bias

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = _CopyToParallel.apply(x)
        q = F.linear(x, self.q_w, self.q_b).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = F.linear(x, self.k_w, self.k_b).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = F.linear(x, self.v_w, self.v_b).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return _ReduceFromParallel.apply(F.linear(y, self.out_w)) + self.out_b

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(_CopyToParallel.apply(x), self.fc_w, self.fc_b))
        return _ReduceFromParallel.apply(F.linear(h, self.proj_w)) + self.proj_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln1(x))
        return x + self._mlp(self.ln2(x))


def megatron_tp(model: nn.Module, rank: int, world: int) -> nn.Module:
    """``model`` (a GPT) with every block replaced by a hand-written Megatron block."""
    model.blocks = nn.ModuleList(MegatronBlock(b, rank, world) for b in model.blocks)
    return model


def ddp_compiled(model: nn.Module) -> nn.Module:
    """DistributedDataParallel with torch.compile (inductor) on the wrapped model."""
    from torch.nn.parallel import DistributedDataParallel

    return torch.compile(DistributedDataParallel(model))


STRONG_PEERS = {"dp": {"ddp": "DDP", "ddp_compiled": "DDP + torch.compile"},
                "tp": {"megatron": "hand-written Megatron TP (no DTensor)"},
                "fsdp": {"fsdp2": "FSDP2 fully_shard", "fsdp2_compiled": "FSDP2 + torch.compile"}}


def _strong_worker(rank: int, world: int, kind: str, args: Any) -> dict[str, Any]:
    """``--strong``: our eager and inductor backends against the strongest peers of ``kind``
    (benchmarks/peers.py), every side in one rotation; profile of the inductor side."""
    from gpt_setup import _batch, _cfg, _local_batch, _peer, _plan

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(_cfg(args))
    builders = {"ddp": lambda m: _peer("dp", m, world), "ddp_compiled": ddp_compiled,
                "megatron": lambda m: megatron_tp(m, rank, world), "fsdp2": lambda m: _peer("fsdp", m, world),
                "fsdp2_compiled": lambda m: torch.compile(_peer("fsdp", m, world))}
    plan, mesh = _plan(kind, world)
    ours = {"eager": sc.compile(train_step, mesh=mesh, plan=plan),
            "inductor": sc.compile(train_step, mesh=mesh, plan=plan, backend="inductor")}
    peers = list(STRONG_PEERS[kind])
    models = {side: copy.deepcopy(model) for side in ours} | {p: builders[p](copy.deepcopy(model)) for p in peers}
    opts = {side: torch.optim.AdamW(m.parameters(), lr=1e-3) for side, m in models.items()}

    def run(side: str, i: int) -> float:
        ids, tg = _local_batch(kind, *_batch(i, args), world, rank)
        t0 = time.perf_counter()
        loss = ours[side](models[side], opts[side], ids, tg) if side in ours else train_step(models[side], opts[side], ids, tg)
        loss.item()
        return time.perf_counter() - t0

    sides = [*ours, *peers]
    times: dict[str, list[float]] = {side: [] for side in sides}
    first: dict[str, float] = {}
    for i in range(args.warmup + args.steps):
        order = sides[i % len(sides):] + sides[: i % len(sides)]
        got = {side: run(side, i) for side in order}
        if i == 0:
            first = got
        if i >= args.warmup:
            for side in sides:
                times[side].append(got[side])
    out: dict[str, Any] = {"median": {side: statistics.median(t) for side, t in times.items()}, "first": first}
    out["ratio"] = {(a, b): statistics.median(x / y for x, y in zip(times[a], times[b])) for a in ours for b in peers}
    out["ratio"][("inductor", "eager")] = statistics.median(x / y for x, y in zip(times["inductor"], times["eager"]))
    out["inductor_compile_s"] = round(sum(p.step.timings.get("backend inductor", 0.0) for p in ours["inductor"]._programs.values()), 1)
    out["inductor_fallback"] = getattr(getattr(ours["inductor"].last, "runner", None), "failed", None)
    out["launches"] = {side: _launches(lambda i: run(side, i), args) for side in sides}
    out["top_ops"] = _top_ops(rank, lambda i: run("inductor", i), args) if args.profile else None
    if args.profile:  # the inductor program again, with inductor's Python wrapper, so its matmuls show
        ours["inductor (profiled)"] = sc.compile(train_step, mesh=mesh, plan=plan, backend="inductor")
        models["inductor (profiled)"] = copy.deepcopy(model)
        opts["inductor (profiled)"] = torch.optim.AdamW(models["inductor (profiled)"].parameters(), lr=1e-3)
        with _python_wrapper():
            for i in range(3):
                run("inductor (profiled)", i)
        sides = ["eager", "inductor (profiled)", *peers]
        out["breakdown"] = {side: _breakdown(rank, lambda i, s=side: run(s, i), args) for side in sides}
    return out


def _launches(step: Any, args: Any) -> int:
    """Collective launches (``c10d::`` ops under torch.profiler) in one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(args.warmup + args.steps)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::"))


def _top_ops(rank: int, step: Any, args: Any, n: int = 5, top: int = 10) -> list[tuple[str, float]] | None:
    """The ops with the most self CPU time in one step of ``step`` (rank 0), ms per step."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) if rank == 0 else contextlib.nullcontext() as prof:
        wall = sum(step(args.warmup + args.steps + i) for i in range(n)) / n
    if rank != 0:
        return None
    rows = sorted(((e.key, e.self_cpu_time_total / 1e3 / n) for e in prof.key_averages()), key=lambda r: -r[1])[:top]
    return [("step (profiled, wall)", wall * 1e3), *rows]


_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
# the peer's blocking all_reduces wait inside these autograd functions (their self time is the wait)
_PEER_WAITS = ("_ReduceFromParallel", "_CopyToParallelBackward")
BREAKDOWN = ("matmuls", "fused kernels", "other ops", "collective launches", "collective waits", "python and rest")


def _breakdown(rank: int, step: Any, args: Any, n: int = 10) -> dict[str, float] | None:
    """Where one step's time goes on rank 0, in ms per step, by torch.profiler's self CPU
    times: matmuls (the same aten kernels on every side), inductor's generated kernels
    (the self time of its compiled graph's call: kernels and their wrapper), other aten
    ops, collective launches (``c10d::`` ops) and waits (``wait_tensor``; the hand-written
    peer waits inside its autograd functions), and the rest of the wall time (Python,
    the optimizer's and autograd's bookkeeping, allocation)."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) if rank == 0 else contextlib.nullcontext() as prof:
        wall = sum(step(args.warmup + args.steps + 10 + i) for i in range(n)) / n
    if rank != 0:
        return None
    cats = dict.fromkeys(BREAKDOWN, 0.0)
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3 / n
        if e.key in _MATMULS:
            cats["matmuls"] += ms
        elif e.key.startswith("## Call CompiledFxGraph"):
            cats["fused kernels"] += ms
        elif e.key.startswith("c10d::"):
            cats["collective launches"] += ms
        elif "wait_tensor" in e.key or e.key in _PEER_WAITS:
            cats["collective waits"] += ms
        elif e.key.startswith(("aten::", "_c10d_functional::")):
            cats["other ops"] += ms
    cats["python and rest"] = max(0.0, wall * 1e3 - sum(cats.values()))
    cats["step (profiled)"] = wall * 1e3
    return cats


@contextlib.contextmanager
def _python_wrapper() -> Iterator[None]:
    """Inductor compiles with its Python wrapper while this is open: the profile then sees
    the matmuls and collectives the generated code calls (the C++ wrapper's calls are
    invisible to torch.profiler). For ``--profile`` only: the timed inductor side keeps
    the C++ wrapper."""
    from spmd_compiler import _private_torch as pt

    compile_ = pt.inductor_compile
    pt.inductor_compile = lambda *a, **k: compile_(*a, **{**k, "cpp_wrapper": False})
    try:
        yield
    finally:
        pt.inductor_compile = compile_


def strong_main(args: Any) -> None:
    """Run the ``--strong`` comparison and write its table to ``args.out``."""
    import os
    import platform
    import sys

    from _table import write_results

    from spmd_compiler.runtime.launch import run_processes

    text = ["# Step time: our eager and inductor backends against the strongest peers", "",
            f"`python benchmarks/step_time.py{''.join(' ' + a for a in sys.argv[1:])}` on {platform.machine()}, "
            f"{os.cpu_count()} cores (shared with other jobs: absolute times are noise, ratios are paired), "
            f"torch {torch.__version__}, gloo, world 2, one thread per process.",
            f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, "
            f"global batch {args.batch}, AdamW. All sides alternate step by step in the same processes "
            f"({args.warmup} warm-up steps, then {args.steps}); a ratio is the median of per-step ratios (below 1: ours faster).", ""]
    for kind in args.kinds:
        if kind not in STRONG_PEERS:
            continue
        got = run_processes(_strong_worker, 2, kind, args, timeout=3600)[0]
        names = {"eager": 'ours, backend="eager"', "inductor": 'ours, backend="inductor"',
                 "inductor (profiled)": 'ours, backend="inductor" (Python wrapper)', **STRONG_PEERS[kind]}
        text += [f"## {kind}", "", "| side | median step ms | first step s (compile) |", "|---|---|---|"]
        text[-2:] = ["| side | median step ms | first step s (compile) | collective launches per step |", "|---|---|---|---|"]
        text += [f"| {names[s]} | {ms * 1e3:.1f} | {got['first'][s]:.1f} | {got['launches'][s]} |" for s, ms in got["median"].items()]
        text += ["", "| ours / peer (paired median) | ratio |", "|---|---|"]
        text += [f"| {names[a]} / {names[b]} | {r:.2f} |" for (a, b), r in got["ratio"].items()]
        text += ["", "Collective launches: `c10d::` ops in one profiled step; ours include the step guard's one all_reduce.",
                 f"Inductor compile time of our programs (summed, rank 0): {got['inductor_compile_s']}; "
                 f"fallback: {got['inductor_fallback'] or 'none'}.", ""]
        if got.get("breakdown") and got["breakdown"].get("eager"):
            cols = [*BREAKDOWN, "step (profiled)"]
            text += ["Where each side's step goes (rank 0, torch.profiler self CPU time, ms per step, 10 steps; the inductor "
                     "program is compiled again with inductor's Python wrapper so that its matmuls and collectives show):", "",
                     "| side | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
            text += [f"| {names.get(s, s)} | " + " | ".join(f"{b[c]:.2f}" for c in cols) + " |"
                     for s, b in got["breakdown"].items()]
            text += [""]
        if got["top_ops"]:
            text += ['Top ops of the backend="inductor" step by self CPU time (rank 0, torch.profiler, ms per step):', "",
                     "| op | ms |", "|---|---|", *(f"| `{k}` | {v:.2f} |" for k, v in got["top_ops"]), ""]
        print("\n".join(text[-30:]), flush=True)
    write_results(args.out, text, show=())  # each kind's table was printed as it finished
