"""What the per-call token-id check costs (driver/token_ids.py: IdCheck).

Every call of a compiled step checks the ids each embedding reads against its table
(one ``aminmax`` per ids tensor, on this rank's batch, before the program runs). For the
benchmark GPT (vocab-sharded token embedding, Megatron TP blocks, one process on a fake
mesh of 2: the per-rank program without communication, the compute a rank does), times
per config, in one run:

    step       the compiled step, median over steps (the check included)
    check      the check alone on the same batch, median over the same number of calls
    unchecked  the compiled step with the check replaced by a no-op, median (calls
               alternate with the checked ones)

and prints check / step and step / unchecked; writes benchmarks/results/id_check.md. Usage:

    python benchmarks/id_check.py [--steps 30] [--dims 64 128 256]
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _table.py

from _table import results_path, write_results  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402

import spmd_compiler as sc  # noqa: E402
from spmd_compiler.driver import token_ids  # noqa: E402
from spmd_compiler.testing import fake_mesh  # noqa: E402
from spmd_compiler.testing.models import GPT, GPTConfig, gpt_tp_plan, train_step  # noqa: E402


def _median(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _one(dim: int, args: argparse.Namespace) -> tuple[float, float, float]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, dim=dim, heads=4, layers=args.layers)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = gpt_tp_plan()
    plan = sc.Plan(params={**plan.params, "tok.weight": [Shard(0)]}, default_input=[Replicate()])
    step = sc.compile(train_step, mesh=fake_mesh((2,), ("tp",)), plan=plan)
    ids = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    batch = (ids, torch.roll(ids, -1, 1))
    for _ in range(args.warmup):
        step(model, opt, *batch)
    check = token_ids.IdCheck.of(step.last.traced)
    assert check(batch, {}) is None and len(check.embeddings) == 2  # tok and pos
    t_check = _median(lambda: check(batch, {}), args.steps)
    real = token_ids.IdCheck.__call__
    checked, unchecked = [], []
    try:
        for _ in range(args.steps):  # alternated, so drift of a shared machine hits both alike
            for on, out in ((True, checked), (False, unchecked)):
                token_ids.IdCheck.__call__ = real if on else (lambda self, b, k: None)
                out.append(_median(lambda: step(model, opt, *batch), 1))
    finally:
        token_ids.IdCheck.__call__ = real
    t_step, t_unchecked = statistics.median(checked), statistics.median(unchecked)
    return t_step, t_check, t_unchecked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(results_path("id_check")))
    args = ap.parse_args()
    torch.set_num_threads(1)
    lines = [
        "# Per-call token-id check (benchmarks/id_check.py)",
        "",
        f"GPT vocab {args.vocab}, seq {args.seq}, batch {args.batch}, {args.layers} layers, AdamW; tok.weight vocab-sharded, "
        f"Megatron TP blocks, fake mesh of 2 (one rank's program, no communication); medians over {args.steps} calls; "
        f"torch {torch.__version__}, {platform.machine()}, 1 thread.",
        "",
        "| dim | step ms | check ms | check / step | unchecked step ms | step / unchecked |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for dim in args.dims:
        t_step, t_check, t_unchecked = _one(dim, args)
        lines.append(f"| {dim} | {t_step:.2f} | {t_check:.3f} | {t_check / t_step:.2%} | {t_unchecked:.2f} | {t_step / t_unchecked:.3f} |")
    write_results(args.out, lines)


if __name__ == "__main__":
    main()
