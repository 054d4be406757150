"""Pipelined compiles on a fake process group (explain mode: compiled and dumped, not run)."""

from __future__ import annotations

import torch

import spmd_compiler as sc
from spmd_compiler.testing.mesh import fake_mesh
from spmd_compiler.testing.models import GPT, gpt_tp_plan, train_step

S = sc.SplitPoint.BEGINNING


def test_stage_dump_files(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    torch.manual_seed(0)
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2, tie_embeddings=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = sc.compile(train_step, mesh=fake_mesh((2, 2), ["pp", "tp"]), plan=gpt_tp_plan(), dump_dir=str(tmp_path),
                      pipeline=sc.Pipeline(chunks=2, schedule="1F1B", split={"blocks.1": S}))
    ids = torch.randint(0, 32, (4, 8))
    loss = step(model, opt, ids, ids)
    assert loss.shape == ()
    folder = step.dumps[-1]
    names = {p.name for p in folder.iterdir()}
    assert {f"stage_{s}_{k}.py" for s in (0, 1) for k in "FBO"} <= names
    assert {"traced.py", "expanded.py", "comm_summary.txt", "report.html", "pipeline.txt"} <= names
    # stage 0's forward: embedding and block 0, annotated with tp placements and local shapes
    f0 = (folder / "stage_0_F.py").read_text()
    assert "pipeline stage 0_F" in f0 and "embedding" in f0 and "S(0)" in f0
    b1 = (folder / "stage_1_B.py").read_text()
    assert "all_reduce" in b1  # Megatron TP backward inside a stage
    text = (folder / "pipeline.txt").read_text()
    assert "2 stages over mesh axis 'pp' (2 ranks), 2 micro-batches, schedule 1F1B" in text
    assert "0,1: tok.weight   (tied)" in text  # the embedding is also the LM head of stage 1
    assert "0: blocks.0.fc.weight" in text and "1: blocks.1.fc.weight" in text
    assert "rank 0: 0F0 0F1 0B0 0B1" in text and "rank 1: 1F0 1B0 1F1 1B1" in text
    crossing = text.split("values crossing stages")[1].split("schedule")[0]
    assert "0F -> 1F" in crossing and "1B -> 0B" in crossing
