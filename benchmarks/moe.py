"""Expert parallelism by placement against a hand-written expert-parallel step, same run.

An MoE transformer (spmd_compiler.testing.moe: token-choice top-k routing, stacked SwiGLU
experts run with torch._grouped_mm, a scatter back) trains on 4 gloo processes with its
experts split over the 4 ranks:

    ours   ``sc.compile(moe_train_step, plan=Plan(params={"*.experts.*": [Shard(0)]}))``:
           the plan splits the stacked expert weights by expert; the compiler derives
           the dispatch and combine (docs/moe.md)
    peer   the same model written the way torchtitan writes expert parallelism: each
           rank holds its experts' slices, swaps per-expert counts with all_to_all_single,
           sends its routed rows with all_to_all_single (input/output split sizes read
           back to the host), permutes them to expert-major order, runs its experts,
           permutes back and returns them; autograd through the functional collectives;
           the other parameters' gradients all_reduced in one flat buffer; AdamW.

Both steps start from the same weights and batches; the table reports step time
(median over timed steps, ours / peer, lower is better), bytes per rank per step
against the analytic minimum, and each rank's peak memory of one step: the most tensor
bytes allocated above the step's start at any point of the step, from torch.profiler's
record of the CPU allocator (``benchmarks/memory.py``'s running sum, the same for both
sides). Bytes: every routed row that goes to another rank's expert
crosses the wire four times (dispatch and combine, forward and backward), so the
minimum per rank is ``2 x (rows it sends to + rows it receives from other ranks) x dim x
element bytes`` (it sends its rows out and the others' rows back, forward and backward);
both sides' ``all_to_all_single`` calls are counted as made (the rows each rank sends to
the others).

Usage: ``python benchmarks/moe.py [--steps 30] [--dim 256] [--experts 8] [--top-k 2] [--capacities none 1.5]``
(one table per expert_capacity of ours: unset, a receive buffer for every rank's rows; 1.5).
Writes benchmarks/results/moe.md. Take figures on a quiet machine (the load average is
printed); ratios from the same run are the figures to quote.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _table.py

from _table import results_path, write_results  # noqa: E402
from memory import _window, resident_timeline  # noqa: E402
import spmd_compiler as sc  # noqa: E402
from spmd_compiler.runtime.launch import run_processes  # noqa: E402
from spmd_compiler.testing.moe import MoEConfig, MoETransformer, moe_plan, moe_train_step  # noqa: E402

RESULTS = results_path("moe")


# ---------------------------------------------------------------- the hand-written peer
class _A2A(torch.autograd.Function):
    """``all_to_all_single`` with split sizes, and its backward (the swapped exchange)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        ctx.recv, ctx.send = recv, send
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv)
        return out, None, None


class _PeerExperts(torch.nn.Module):
    """This rank's experts (slices of the stacked weights) behind torchtitan-style dispatch."""

    def __init__(self, full: Any, rank: int, world: int) -> None:
        super().__init__()
        e = full.w1.shape[0] // world
        sl = slice(rank * e, (rank + 1) * e)
        self.w1 = torch.nn.Parameter(full.w1.detach()[sl].clone())
        self.w3 = torch.nn.Parameter(full.w3.detach()[sl].clone())
        self.w2 = torch.nn.Parameter(full.w2.detach()[sl].clone())
        self.world, self.local, self.rank = world, e, rank
        self.remote_rows = 0  # routed rows this rank sent to or got from other ranks (for the analytic minimum)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.to(torch.int64)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)  # per-expert counts: what every rank sends my experts
        grid = got.view(self.world, self.local)  # [source rank, local expert]
        send = counts.view(self.world, self.local).sum(1).tolist()
        recv = grid.sum(1).tolist()
        self.remote_rows += sum(send) - send[self.rank] + sum(recv) - recv[self.rank]
        y = _A2A.apply(x, recv, send)  # rows, source-major then expert
        expert_of_row = torch.repeat_interleave(torch.arange(self.local).repeat(self.world), grid.flatten())
        order = torch.argsort(expert_of_row, stable=True)  # -> expert-major
        y = y[order]
        offs = torch.cumsum(grid.sum(0), 0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(y, self.w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(y, self.w3.transpose(-2, -1), offs=offs)
        out = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        back = out.new_zeros(out.shape).index_copy(0, order, out)  # -> source-major
        return _A2A.apply(back, send, recv)


def _peer_model(model: torch.nn.Module, rank: int, world: int) -> torch.nn.Module:
    peer = copy.deepcopy(model)
    for layer in peer.layers:
        layer.moe.experts = _PeerExperts(layer.moe.experts, rank, world)
    return peer


def _peer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, targets: torch.Tensor, world: int) -> torch.Tensor:
    logits, aux = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    if model.cfg.aux_loss:
        loss = loss + model.cfg.aux_loss * aux
    loss.backward()
    dense = [p for n, p in model.named_parameters() if ".experts." not in n and p.grad is not None]
    flat = torch.cat([p.grad.flatten() for p in dense])
    dist.all_reduce(flat)
    flat /= world
    i = 0
    for p in dense:
        p.grad.copy_(flat[i:i + p.numel()].view_as(p))
        i += p.numel()
    # expert gradients: this rank's experts saw every rank's rows (sum over ranks' tokens); scale like the mean
    for n, p in model.named_parameters():
        if ".experts." in n and p.grad is not None:
            p.grad /= world
    opt.step()
    opt.zero_grad()
    dist.all_reduce(loss.detach().clone())
    return loss


# ---------------------------------------------------------------- measurement
class _Bytes:
    """Counts the rows each all_to_all_single sends to other ranks (bytes)."""

    def __init__(self) -> None:
        self.sent = 0
        self._orig = dist.all_to_all_single

    def __enter__(self) -> "_Bytes":
        rank = dist.get_rank()

        def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            if input_split_sizes is not None and input.dim() >= 2:
                row = input[0].numel() * input.element_size() if input.shape[0] else 0
                self.sent += sum(s for j, s in enumerate(input_split_sizes) if j != rank) * row
            return self._orig(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_to_all_single = self._orig


def _step_peak(fn: Any, batch: tuple, rank: int, world: int) -> int:
    """Bytes allocated above the step's start at the step's peak (one profiled step)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    ids, t = (x.chunk(world)[rank] for x in batch)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("moe_step"):
            fn(ids, t)
    start, end = _window(prof, "moe_step")
    line = resident_timeline(prof)
    before = next((b for ts, b in reversed(line) if ts < start), 0)
    return max([b for ts, b in line if start <= ts <= end] or [before]) - before


def _worker(rank: int, world: int, args: dict) -> dict:
    torch.set_num_threads(1)
    cfg = MoEConfig(vocab=args["vocab"], seq=args["seq"], dim=args["dim"], heads=4, layers=args["layers"], experts=args["experts"],
                    top_k=args["top_k"], hidden=args["hidden"])
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    peer = _peer_model(model, rank, world)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, cfg.vocab, (args["rows"] * world, cfg.seq), generator=g),
             torch.randint(0, cfg.vocab, (args["rows"] * world, cfg.seq), generator=g)) for _ in range(4)]
    _, plan = moe_plan("ep")
    if args["capacity"] is not None:
        plan = dataclasses.replace(plan, expert_capacity=args["capacity"])
    ours = sc.compile(moe_train_step, mesh=(world,), plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peer_opt = torch.optim.AdamW(peer.parameters(), lr=1e-3)
    out: dict[str, Any] = {}
    fns: dict[str, Any] = {}
    for name, fn in (("ours", lambda ids, t: ours(model, opt, ids, t)), ("peer", lambda ids, t: _peer_step(peer, peer_opt, ids, t, world))):
        for i in range(args["warmup"]):
            ids, t = data[i % len(data)]
            fn(ids.chunk(world)[rank], t.chunk(world)[rank])
        times, losses = [], []
        if name == "peer":
            for layer in peer.layers:
                layer.moe.experts.remote_rows = 0
        with _Bytes() as counted:
            for i in range(args["steps"]):
                ids, t = data[i % len(data)]
                dist.barrier()
                start = time.perf_counter()
                loss = fn(ids.chunk(world)[rank], t.chunk(world)[rank])
                times.append(time.perf_counter() - start)
                losses.append(float(loss))
        out[name] = {"ms": 1e3 * statistics.median(times), "bytes": counted.sent / args["steps"], "loss": losses[-1]}
        fns[name] = fn
    # the analytic minimum: the rows this rank sends to or receives from another rank's
    # experts over the peer's timed steps (the same routing as ours: both train the same
    # weights on the same batches); each is sent once forward and once backward (a row
    # sent to an expert comes back as the combine of another rank's send), float32 rows
    remote = sum(layer.moe.experts.remote_rows for layer in peer.layers)
    out["minimum"] = 2 * remote * cfg.dim * 4 / args["steps"]
    for name, fn in fns.items():  # after the counts above: one more step each, profiled
        out[name]["peak"] = _step_peak(fn, data[0], rank, world)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rows", type=int, default=2, help="sequences per rank")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--capacities", nargs="+", default=["none", "1.5"],
                   help="Plan(expert_capacity=...) of ours, one table each ('none': unset, every rank's rows)")
    a = p.parse_args()
    load = os.getloadavg()
    lines = [
        "# Expert parallelism: ours (derived from the plan) vs a hand-written EP step",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {a.world} gloo processes, one thread "
        f"each. Model: {a.layers} MoE layers, dim {a.dim}, {a.experts} experts (hidden {a.hidden}), top-{a.top_k}, "
        f"{a.rows} x {a.seq} tokens per rank, float32, AdamW; {a.steps} timed steps after {a.warmup}. "
        f"`python benchmarks/moe.py --steps {a.steps} --capacities {' '.join(a.capacities)}`. Ratios are ours / peer "
        f"(lower is better); both sides start from the same weights and batches, so they route the same rows.",
        "",
    ]
    for cap in a.capacities:
        args = {k.replace("-", "_"): v for k, v in vars(a).items() if k != "capacities"}
        args["capacity"] = None if cap == "none" else float(cap)
        before = os.getloadavg()
        results = run_processes(_worker, a.world, args, timeout=1800)
        ours = statistics.median(r["ours"]["ms"] for r in results)
        peer = statistics.median(r["peer"]["ms"] for r in results)
        ours_peak = statistics.median(r["ours"]["peak"] for r in results)
        peer_peak = statistics.median(r["peer"]["peak"] for r in results)
        what = ("unset: each rank's receive buffer holds every rank's routed rows (never exceeded)" if args["capacity"] is None
                else f"{args['capacity']}: each rank receives at most {args['capacity']} x its own routed rows")
        lines += [
            f"## expert_capacity {what}",
            "",
            f"Load average (1, 5, 15 min) before: {', '.join(f'{v:.2f}' for v in before)}; after: "
            f"{', '.join(f'{v:.2f}' for v in os.getloadavg())}.",
            "",
            "| rank | ours ms | peer ms | ours / peer | ours bytes/step | peer bytes/step | minimum | ours / minimum | peer / minimum "
            "| ours peak MiB | peer peak MiB | ours / peer peak |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for rank, r in enumerate(results):
            m = r["minimum"] or 1
            lines.append(f"| {rank} | {r['ours']['ms']:.1f} | {r['peer']['ms']:.1f} | {r['ours']['ms'] / r['peer']['ms']:.2f} | "
                         f"{r['ours']['bytes']:,.0f} | {r['peer']['bytes']:,.0f} | {r['minimum']:,.0f} | "
                         f"{r['ours']['bytes'] / m:.2f} | {r['peer']['bytes'] / m:.2f} | {r['ours']['peak'] / 2**20:.2f} | "
                         f"{r['peer']['peak'] / 2**20:.2f} | {r['ours']['peak'] / max(r['peer']['peak'], 1):.2f} |")
        lines += ["", f"Median over ranks: step time ours {ours:.1f} ms, peer {peer:.1f} ms: **{ours / peer:.2f}x**; "
                      f"peak memory of a step ours {ours_peak / 2**20:.1f} MiB, peer {peer_peak / 2**20:.1f} MiB: "
                      f"**{ours_peak / max(peer_peak, 1):.2f}x**.", ""]
    print(f"load average at start: {load}")
    write_results(RESULTS, lines)


if __name__ == "__main__":
    main()
