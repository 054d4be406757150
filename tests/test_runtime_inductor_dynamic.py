"""backend="inductor" with dynamic=True (spmd_compiler/runtime/inductor_dynamic.py): one
expansion and one inductor compile per segment serve every batch size, plus at most a
variant each for the sizes that break the first compile's guards (a rank holding 1 or 0
rows: inductor's own 0/1 decisions); float64 equal to one device.

The gloo test compiles a small MLP and a one-layer GPT with inductor's C++ backend on 2
processes (a minute or two on a loaded 2-core machine; the FX graph cache makes reruns
faster). The single-process tests compile hand-made graphs without collectives.
"""

from __future__ import annotations

import copy
import logging
import operator

import pytest
import sympy
import torch
import torch.fx as fx

import spmd_compiler as sc
from spmd_compiler import _private_torch as pt
from spmd_compiler.runtime.executor import compile_runner
from spmd_compiler.runtime.inductor import InductorRunner
from spmd_compiler.runtime.inductor_dynamic import SymbolicSegment, SymbolicSizes
from gloo_launch import run_processes
from spmd_compiler.testing.models import GPT, MLP, mse_train_step, train_step

aten = torch.ops.aten
S = sympy.Symbol("s3", integer=True, positive=True)


def _runner(local: sympy.Expr) -> InductorRunner:
    """The runner of ``x * (2 / (16 * s3))`` and its sum over ``16 * s3`` (an MSE backward of a
    symbolic program: the float of a size, expand/emit_sizes.py), where ``x`` has ``local``
    rows (a size expression of s3, as a rank's local size symbol of the graph's metadata)."""
    g = fx.Graph()
    size, x = g.placeholder("size_s3"), g.placeholder("x")
    x.meta["val"] = pt.to_symbolic_fake(pt.symbolic_fake_mode(), torch.empty(8, 16, dtype=torch.float64), "x", dynamic=[0])
    nodes = [g.call_function(operator.mul, (16, size))]
    nodes.append(g.call_function(float, (nodes[0],)))
    nodes.append(g.call_function(operator.truediv, (2.0, nodes[1])))
    for n in nodes:
        n.meta["spmd_size_expr"] = True
    y = g.call_function(aten.mul.Tensor, (x, nodes[2]))
    g.output([y, g.call_function(aten.div.Tensor, (g.call_function(aten.sum.default, (y,)), nodes[1]))])
    gm = fx.GraphModule(torch.nn.Module(), g)
    return InductorRunner(gm, compile_runner(gm), sizes=SymbolicSizes([S], {pt.sym_expr(x.meta["val"].shape[0]): local}, {}))


def _want(b: int, x: torch.Tensor) -> list[torch.Tensor]:
    y = x * (2.0 / float(16 * b))
    return [y, y.sum() / float(16 * b)]


def test_one_compile_serves_every_size_in_double_precision():
    runner = _runner(S)
    for b in (8, 5, 3, 2, 9):
        x = torch.randn(b, 16, dtype=torch.float64)
        got, want = runner(b, x), _want(b, x)
        assert torch.equal(got[0], want[0]), b  # 2 / (16 * b) read in double, not as a 32-bit float
        assert abs(got[1] - want[1]).item() < 1e-15, b  # the sum may add in another order
    assert runner.compiles == 1 and runner.failed is None
    seg = runner.compiled[next(iter(runner.compiled))][0]
    assert isinstance(seg, SymbolicSegment) and len(seg.variants) == 1, seg.variants


def test_sizes_breaking_a_guard_compile_one_more_variant(caplog):
    """Rank 1 of 2 holds ``Max(0, Min(c, s3 - c))`` rows (c = ceil(s3 / 2)): the first compile
    (s3 = 8) relies on that being nonzero; s3 = 1 (no row) breaks the guard and compiles a
    second variant, which s3 = 1 reuses; 7 goes back to the first."""
    from torch.utils._sympy.functions import FloorDiv, Max, Min

    c = FloorDiv(S + 1, 2)
    runner = _runner(Max(0, Min(c, S - c)))
    with caplog.at_level(logging.INFO, logger="spmd_compiler.runtime.inductor_dynamic"):
        for b in (8, 1, 5, 1, 7):
            x = torch.randn(b // 2, 16, dtype=torch.float64)
            got, want = runner(b, x), _want(b, x)
            assert torch.equal(got[0], want[0]) and abs(got[1] - want[1]).item() < 1e-15, b
    seg = runner.compiled[next(iter(runner.compiled))][0]
    assert runner.compiles == 2 and len(seg.variants) == 2, [v[1] for v in seg.variants]
    logs = [r.getMessage() for r in caplog.records if "break the guards" in r.getMessage()]
    assert len(logs) == 1 and "{s3: 1}" in logs[0], logs


def test_an_input_laid_out_unlike_the_graph_runs_compiled_for_its_shape():
    runner = _runner(S)
    x = torch.randn(16, 5, dtype=torch.float64).t()  # strides (1, 5): neither the graph's nor contiguous
    got, want = runner(5, x), _want(5, x)
    assert torch.equal(got[0], want[0])
    seg = runner.compiled[next(iter(runner.compiled))][0]
    assert seg.variants == [] and runner.compiles == 1  # compiled for exactly its shape and strides


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    c = -(-t.shape[0] // world)
    return t[min(rank * c, t.shape[0]) : min((rank + 1) * c, t.shape[0])]


SIZES = [8, 5, 3, 1, 7]


def _train(rank: int, world: int, kind: str) -> dict:
    torch.manual_seed(0)
    if kind == "mlp":
        model, fn = MLP().double(), mse_train_step
    else:
        model, fn = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1).double(), train_step
    ref = copy.deepcopy(model)
    # plain SGD: no optimizer state appears after the first step (that would be a second program)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = sc.compile(fn, mesh=(world,), dynamic=True, backend="inductor")
    errs = []
    for i, b in enumerate(SIZES):
        g = torch.Generator().manual_seed(100 + i)
        if kind == "mlp":
            x, y = (torch.randn(b, 16, dtype=torch.float64, generator=g) for _ in range(2))
        else:
            x = torch.randint(0, 32, (b, 8), generator=g)
            y = torch.roll(x, -1, 1)
        loss = step(model, opt, _rows(x, rank, world), _rows(y, rank, world))
        err = abs(loss.item() - fn(ref, ref_opt, x, y).item())
        errs.append(max(err, max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))))
    runner = step.last.runner
    segments = [f for fns in runner.compiled.values() for f in fns]
    return {"errs": errs, "compiles": step.compiles, "inductor": runner.compiles, "failed": runner.failed,
            "segments": len(segments), "symbolic": sum(isinstance(f, SymbolicSegment) for f in segments),
            "variants": [len(f.variants) for f in segments if isinstance(f, SymbolicSegment)],
            "seconds": step.last.timings.get("backend inductor", 0.0)}


def _both(rank: int, world: int) -> dict:
    return {kind: _train(rank, world, kind) for kind in ("mlp", "gpt")}


@pytest.mark.gloo
def test_mlp_and_gpt_compile_once_for_every_batch_size_on_two_ranks(tmp_path, monkeypatch):
    """Sizes 8, 5, 3, 1, 7 on 2 gloo ranks (4/4, 3/2, 2/1, 1/0, 4/3 rows): one expansion;
    inductor compiles each segment of the program that reads the batch once for the local
    sizes of 2 rows or more, and at most once more each for 1 and 0 rows (guards inductor
    records on the example sizes, checked per call), where per shape would be 5 compiles
    per segment. float64 equal to one device at 1e-10 after every step (measured ~1e-15:
    inductor may add a reduction's rows in another order). (A cold inductor cache: a graph
    the FX graph cache serves brings the guards it was compiled with, so a warm cache may
    split the sizes into other (correct, but more) variants; so may, rarely, a cold one.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for rank, res in enumerate(run_processes(_both, 2, timeout=1500)):
        for kind, r in res.items():
            assert max(r["errs"]) < 1e-10, (rank, kind, r)
            assert r["compiles"] == 1 and r["failed"] is None, (rank, kind, r)
            # cold cache, measured: variants [1]/[2] (MLP) and [1, 2]/[2, 3] (GPT); one CI run saw
            # rank 1's GPT at 7 inductor compiles (a segment's guards split more sizes): correct,
            # so the bound asserted is "fewer than per shape", not the usual counts
            assert r["symbolic"] >= 1 and all(v <= len(SIZES) for v in r["variants"]), (rank, kind, r)
            assert r["inductor"] == r["segments"] - r["symbolic"] + sum(r["variants"]), (rank, kind, r)
            assert r["inductor"] < len(SIZES) * r["segments"], (rank, kind, r)
            assert r["seconds"] > 0, r
