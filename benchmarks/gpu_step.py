"""Step time on one GPU: the compiled step against the eager single-device step.

For the same GPT (``spmd_compiler.testing.models.GPT``), data and AdamW, in one process
on one GPU with NCCL (world 1, mesh ``{"dp": 1}``: NCCL cannot put two ranks on one GPU):

    compiled    ``spmd_compiler.compile(train_step, mesh={"dp": 1})``: the traced,
                expanded per-rank program run by the straight-line runner
    eager       the same ``train_step`` on the same model, one device, no wrapper
    torch.compile (``--torch-compile``) the eager step with ``torch.compile(model)``

in float32 and under ``torch.autocast("cuda", dtype=torch.bfloat16)``. The two (or
three) sides alternate step by step, which goes first swapping every step, each step
ending in ``torch.cuda.synchronize()``; the figure quoted is the median of per-step
ratios compiled / eager (below 1: compiled faster), next to each side's median time.
The first losses of both sides are compared too (the same weights and data).

Writes benchmarks/results/gpu_step.md. Usage (on a machine with a CUDA GPU):

    python benchmarks/gpu_step.py [--steps 30] [--configs 4x512 12x1024] [--torch-compile]
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _table.py

import spmd_compiler as sc  # noqa: E402
from _table import results_path, write_results  # noqa: E402
from spmd_compiler.runtime.launch import free_port  # noqa: E402
from spmd_compiler.testing.models import GPT, GPTConfig, train_step  # noqa: E402

RESULTS = results_path("gpu_step")


def step_bf16(model: Any, optimizer: Any, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _timed(fn: Any) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, loss.item()


def run_config(layers: int, dim: int, precision: str, args: Any) -> dict[str, Any]:
    device = torch.device("cuda")
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, dim=dim, heads=dim // 64, layers=layers)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    fn = train_step if precision == "fp32" else step_bf16
    sides: dict[str, Any] = {}
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = sc.compile(fn, mesh={"dp": 1})
    sides["compiled"] = (compiled, model, opt)
    model = copy.deepcopy(base)
    sides["eager"] = (fn, model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    if args.torch_compile:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sides["torch.compile"] = (fn, torch.compile(model), opt)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
        batches.append((ids, torch.roll(ids, -1, 1)))
    times: dict[str, list[float]] = {k: [] for k in sides}
    losses: dict[str, list[float]] = {k: [] for k in sides}
    warm: dict[str, float] = {}
    names = list(sides)
    for i in range(args.warmup + args.steps):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            step, model, opt = sides[name]
            ids, tg = batches[i % len(batches)]
            seconds, loss = _timed(lambda: step(model, opt, ids, tg))
            if i < args.warmup:
                warm[name] = warm.get(name, 0.0) + seconds
                losses[name].append(loss)
            else:
                times[name].append(seconds)
    ratio = statistics.median(c / e for c, e in zip(times["compiled"], times["eager"]))
    row = {
        "config": f"{layers} x {dim}", "precision": precision,
        "params M": sum(p.numel() for p in base.parameters()) / 1e6,
        "compiled ms": statistics.median(times["compiled"]) * 1e3,
        "eager ms": statistics.median(times["eager"]) * 1e3,
        "compiled / eager": ratio,
        "first compile s": warm["compiled"],
        "loss diff": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses["compiled"], losses["eager"])),
    }
    if "torch.compile" in sides:
        row["torch.compile ms"] = statistics.median(times["torch.compile"]) * 1e3
        row["compiled / torch.compile"] = statistics.median(
            c / t for c, t in zip(times["compiled"], times["torch.compile"]))
    print(row, flush=True)
    if args.profile:
        print(f"collectives of the compiled step ({layers} x {dim} {precision}):\n{compiled.comm_summary().table()}")
        print(f"per-rank program: {len(compiled.last.gm.graph.nodes)} nodes")
        for name in sides:
            step, model, opt = sides[name]
            ids, tg = batches[0]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    _timed(lambda: step(model, opt, ids, tg))
            print(f"--- {name}: top ops by self CPU time over 3 steps")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--configs", nargs="+", default=["4x512", "12x1024"], help="LAYERSxDIM")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--torch-compile", action="store_true", help="add torch.compile(model) of the eager step")
    p.add_argument("--profile", action="store_true", help="print where each side's time goes (torch.profiler)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step.py needs a CUDA GPU")
    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for c in args.configs:
        layers, dim = (int(v) for v in c.split("x"))
        for precision in args.precisions:
            rows.append(run_config(layers, dim, precision, args))
    cols = list(rows[0])
    for r in rows:
        cols += [k for k in r if k not in cols]
    lines = [
        "# Step time on one GPU: compiled step vs the eager single-device step",
        "",
        f"`python benchmarks/gpu_step.py {' '.join(sys.argv[1:])}`: {torch.cuda.get_device_name(0)}, torch "
        f"{torch.__version__}, NCCL world 1 (mesh {{'dp': 1}}), GPT batch {args.batch} x seq {args.seq}, vocab "
        f"{args.vocab}, AdamW, {args.steps} timed steps after {args.warmup} warm-up steps (the first compiles), sides "
        f"alternating step by step; compiled / eager is the median of per-step ratios. loss diff: largest relative "
        f"difference of the warm-up losses (same weights and data).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols) + " |")
    write_results(os.environ.get("GPU_STEP_RESULTS", RESULTS), "\n".join(lines) + "\n")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
