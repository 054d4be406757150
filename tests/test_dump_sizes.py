"""Dumps of symbolic programs (dynamic=True): each size's expression, per rank, next to
the values of the last call (spmd_compiler/dump/sizes.py)."""

from __future__ import annotations

import json
import logging

import pytest
import sympy
import torch

import spmd_compiler as sc

from spmd_compiler.dump.sizes import evaluate, readable
from spmd_compiler.expand.chunks import local_size
from spmd_compiler.expand.symbolic import coordinate_symbol, local_size_expr
from spmd_compiler.testing import fake_mesh
from spmd_compiler.testing.harness import SimulatedTraining
from spmd_compiler.testing.models import MLP, mse_train_step


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_readable_local_sizes_are_torch_chunk_sizes_for_every_rank(n):
    """The simplified text of each rank's local size is exact: evaluated as written it gives
    torch.chunk's sizes for every global size 0..40 (empty and uneven shards included)."""
    s, k = sympy.Symbol("s3", integer=True, positive=True), coordinate_symbol("dp")
    definition = local_size_expr(s, n, k)
    texts = [readable(definition, {k: r}) for r in range(n)]
    if n == 2:
        assert texts == ["ceil(s3/2)", "s3 - ceil(s3/2)"]
    elif n > 2:
        assert texts[0] == f"ceil(s3/{n})" and texts[-1] == f"Max(0, s3 - {n - 1}*ceil(s3/{n}))", texts
    for r, text in enumerate(texts):
        parsed = sympy.sympify(text.replace("ceil(", "ceiling("), locals={"s3": s})
        for b in range(41):
            assert int(parsed.subs(s, b)) == local_size(b, n, r), (text, b)
            assert evaluate(definition, {k: r}, {s: b}) == local_size(b, n, r)


def test_dump_of_a_dynamic_dp_program_shows_each_ranks_size_and_the_last_call(tmp_path):
    torch.manual_seed(0)
    model = MLP(8, 6).double()
    sim = SimulatedTraining(mse_train_step, model, torch.optim.SGD(model.parameters(), lr=0.1), fake_mesh((3,), ("dp",)),
                            dynamic=True)
    for b in (10, 7):
        sim.step(torch.randn(b, 8, dtype=torch.float64), torch.randn(b, 8, dtype=torch.float64))
    assert sim.compiles == 1 and sim.last_sizes == [7], sim.reasons
    folder = sim.write_dump(tmp_path, name="mlp")
    sizes = (folder / "sizes.txt").read_text()
    assert "s3: batch[0] dim 0 (input size_s3; also batch[1] dim 0) | last call: 7" in sizes
    # batch 7 over 3 ranks: 3, 3, 1 rows (torch.chunk), each rank's expression simplified
    assert "rank 0 (dp=0): ceil(s3/3) = 3  <- this program" in sizes
    assert "rank 1 (dp=1): Min(s3 - ceil(s3/3), ceil(s3/3)) = 3" in sizes
    assert "rank 2 (dp=2): Max(0, s3 - 2*ceil(s3/3)) = 1" in sizes
    expanded = (folder / "expanded.py").read_text()
    assert "# sizes (dynamic=True)" in expanded and "#       rank 2 (dp=2): Max(0, s3 - 2*ceil(s3/3)) = 1" in expanded
    assert "# size_s3: global batch size s3 = batch[0] dim 0 | last call 7" in expanded
    assert "| global [s3, 8] = [7, 8] | local [u0, 8] = [3, 8] | batch batch[0]" in expanded
    # the integer nodes: the MSE mean's count 8*B and its gradient's 2/(8*B), with this call's values
    assert "# size: 8*s3 = 56\n    mul_" in expanded and "0.25/s3 = 0.0357143" in expanded
    size_nodes = [n for n in sim.expansions[(0,)].gm.graph.nodes if n.meta.get("spmd_size_expr")]
    assert size_nodes and all("spmd_size_value" in n.meta for n in size_nodes)
    meta = json.loads((folder / "meta.json").read_text())
    (entry,) = meta["sizes"]
    assert entry["last call"] == 7 and [r["value"] for r in entry["local"][0]["ranks"]] == [3, 3, 1]
    report = (folder / "report.html").read_text()
    assert "<h2>Batch sizes</h2>" in report and "Max(0, s3 - 2*ceil(s3/3)) = 1" in report and "size: 8*s3 = 56" in report
    # the memory trace is counted at the last call's sizes (rank 0 holds 3 rows of 7), not
    # at the compile's example sizes (4 rows of 10): two batch inputs of 3 x 8 float64
    memory = (folder / "memory.txt").read_text()
    assert memory.startswith("batch sizes of the call: s3 = 7 (this rank: u0 = 3)\n"), memory
    assert meta["memory"]["input_bytes"]["batch"] == 2 * 3 * 8 * 8, meta["memory"]


def test_compile_dump_of_a_dynamic_program_on_the_fake_group(tmp_path, caplog):
    """compile(dynamic=True, dump_dir=...) writes the dump of the symbolic program (no
    WARNING), with the sizes of the call that compiled it: on the fake group every rank is
    taken to hold this rank's rows (3 of 4 ranks: global 12)."""
    mesh = fake_mesh((4,), ("dp",))
    model = MLP(8, 6).double()
    step = sc.compile(mse_train_step, mesh=mesh, dynamic=True, dump_dir=str(tmp_path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        for b in (3, 2):
            step(model, opt, torch.randn(b, 8, dtype=torch.float64), torch.randn(b, 8, dtype=torch.float64))
    assert step.compiles == 1 and len(step.dumps) == 1, step.dumps
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert any("memory per rank per step (static trace, batch sizes s3 = 12 (this rank: u0 = 3))" in r.getMessage()
               for r in caplog.records)
    folder = step.dumps[0]
    sizes = (folder / "sizes.txt").read_text()
    assert "s3: batch[0] dim 0 (input size_s3; also batch[1] dim 0) | last call: 12" in sizes, sizes
    assert "rank 0 (dp=0): ceil(s3/4) = 3  <- this program" in sizes and "rank 3 (dp=3): Max(0, s3 - 3*ceil(s3/4)) = 3" in sizes
    # the driver's annotated graphs (before and after the passes) carry the call's values too
    expanded = (folder / "expanded.py").read_text()
    assert "| global [s3, 8] = [12, 8] | local [u0, 8] = [3, 8] | batch batch[0]" in expanded
    assert "# size: 8*s3 = 96" in expanded
    last_pass = sorted(folder.glob("pass_*.py"))[-1].read_text()
    assert "# size: 8*s3 = 96" in last_pass
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["sizes"][0]["last call"] == 12
    assert meta["memory"]["input_bytes"]["batch"] == 2 * 3 * 8 * 8 and meta["memory"]["peak_bytes"] > 0, meta["memory"]
    assert (folder / "memory.txt").read_text().startswith("batch sizes of the call: s3 = 12 (this rank: u0 = 3)")
    # the step's own memory_trace(): at the last call's sizes (2 rows here, global 8)
    assert step.memory_trace().input_bytes["batch"] == 2 * 2 * 8 * 8
