"""Pipelined training on real gloo processes (4 ranks, forked), against one device.

Four configurations in one launch (each compiles in a few seconds):
- pp2 x dp2, GPT with tied embedding / LM head, interleaved 1F1B with two stages per
  rank, cut by a split spec;
- pp2 x tp2, Megatron-TP GPT, GPipe;
- pp4 SkipNet: ``pipe_split()`` markers, a skip connection over a stage, dict/None/scalar
  stage outputs, BatchNorm with deferred statistics, activation checkpointing
  ``except_last``, 1F1B, with a dump (stage files and the executed timeline);
- pp4 GPT cut by automatic balancing, checkpointing ``always``, GPipe.
Tolerance: float64, 1e-10 on the loss and parameters.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.runtime.launch import run_processes
from spmd_compiler.testing import distribution_of
from spmd_compiler.testing.models import GPT, SkipNet, gpt_tp_plan, mse_train_step, train_step

pytestmark = pytest.mark.gloo

S = sc.SplitPoint.BEGINNING
CONFIGS = {
    "tied_interleaved": dict(model="gpt", tie=True, layers=4, mesh={"pp": 2, "dp": 2}, pipe=sc.Pipeline(
        chunks=2, schedule="Interleaved1F1B", stages_per_rank=2, split={"blocks.1": S, "blocks.2": S, "blocks.3": S})),
    "tp_gpipe": dict(model="gpt", layers=2, mesh={"pp": 2, "tp": 2}, plan=gpt_tp_plan(), pipe=sc.Pipeline(
        chunks=2, schedule="GPipe", split={"blocks.1": S})),
    "skipnet_bn": dict(model="skip", mesh={"pp": 4}, pipe=sc.Pipeline(chunks=4, schedule="1F1B", checkpoint="except_last")),
    "auto_always": dict(model="gpt", layers=4, mesh={"pp": 4}, pipe=sc.Pipeline(chunks=2, schedule="GPipe", auto=True, checkpoint="always")),
}


def _data(cfg: dict, i: int):
    g = torch.Generator().manual_seed(100 + i)
    if cfg["model"] == "gpt":
        ids = torch.randint(0, 32, (8, 8), generator=g)
        return ids, torch.roll(ids, -1, 1)
    return torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64)


def _bn_reference_step(model, optimizer, x, y, chunks: int) -> torch.Tensor:
    """What a pipeline with deferred BatchNorm computes, on one device: each micro-batch is
    normalized with its own statistics and gradients accumulate; the running statistics
    are those of one full-batch forward (before the update)."""
    saved = {k: v.clone() for k, v in model.named_buffers()}
    with torch.no_grad():
        model(x)  # full-batch running statistics
    full = {k: v.clone() for k, v in model.named_buffers()}
    for k, v in model.named_buffers():
        v.copy_(saved[k])
    total = torch.zeros((), dtype=torch.float64)
    for xi, yi in zip(x.chunk(chunks), y.chunk(chunks)):
        loss = F.mse_loss(model(xi), yi) / chunks
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    for k, v in model.named_buffers():
        v.copy_(full[k])
    return total


def _worker(rank: int, world: int, names: list[str], trace_dir: str) -> dict:
    out = {}
    for name in names:
        cfg = CONFIGS[name]
        torch.manual_seed(0)
        if cfg["model"] == "gpt":
            model, fn = GPT(vocab=32, seq=8, dim=16, heads=2, layers=cfg["layers"], tie_embeddings=cfg.get("tie", False)).double(), train_step
        else:
            model, fn = SkipNet(8, batchnorm=True).double(), mse_train_step
        ref = copy.deepcopy(model)
        opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
        all_keys = set(model.state_dict())
        dump = f"{trace_dir}/dump" if name == "skipnet_bn" else None
        step = sc.compile(fn, mesh=cfg["mesh"], plan=cfg.get("plan"), pipeline=cfg["pipe"], dump_dir=dump)
        errs = []
        for i in range(3):
            x, y = _data(cfg, i)
            lx, ly = x, y
            if "dp" in cfg["mesh"]:
                c = step.mesh.get_coordinate()[list(cfg["mesh"]).index("dp")]
                lx, ly = x.chunk(2)[c], y.chunk(2)[c]
            got = step(model, opt, lx, ly)
            want = fn(ref, ref_opt, x, y) if cfg["model"] == "gpt" else _bn_reference_step(ref, ref_opt, x, y, cfg["pipe"].chunks)
            errs.append(abs(got.item() - want.item()))
        ref_sd, sd = ref.state_dict(), model.state_dict()
        state_err = max((v.full_tensor().double() - ref_sd[k].double()).abs().max().item() for k, v in sd.items())
        out[name] = {"loss_err": max(errs), "state_err": state_err, "keys": sorted(sd), "all_keys": sorted(all_keys),
                     "compiles": step.compiles, "loss": got.item(), "comm": distribution_of(step.last).collectives}
        if name == "skipnet_bn":
            step.chrome_trace(f"{trace_dir}/trace.json")
            out[name]["timeline"] = step.timeline_text()
            out[name]["dumps"] = [sorted(p.name for p in folder.iterdir()) for folder in step.dumps]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    trace_dir = str(tmp_path_factory.mktemp("pp"))
    return run_processes(_worker, 4, list(CONFIGS), trace_dir, timeout=600), trace_dir


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pipelined_training_matches_one_device(results, name):
    per_rank, _ = results
    for rank, res in enumerate(per_rank):
        r = res[name]
        assert r["loss_err"] < 1e-10, (rank, r)
        assert r["state_err"] < 1e-10, (rank, r)
        assert r["compiles"] == 2  # first step (creates AdamW state), then the steady step
        # distributed: each rank holds only its stages' state, and the stage program
        # communicates over every other mesh axis (local shapes checked by distribution_of)
        assert set(r["keys"]) < set(r["all_keys"]), (rank, r["keys"])
        for axis in set(CONFIGS[name]["mesh"]) - {"pp"}:
            assert any(k.endswith("/all_reduce/" + axis) for k in r["comm"]), (rank, axis, r["comm"])
    losses = {res[name]["loss"] for res in per_rank}
    assert len(losses) == 1, "every rank returns the same full-batch loss"


def test_stages_keep_original_names(results):
    per_rank, _ = results
    # every stage's state_dict keys are a subset of the model's, and together they cover it
    for name in CONFIGS:
        union = set()
        for res in per_rank:
            keys = set(res[name]["keys"])
            assert keys and keys <= set(res[name]["all_keys"])
            union |= keys
        assert union == set(per_rank[0][name]["all_keys"]), name
    # tied embedding/LM head: both the first and the last stage hold the tied weight
    holders = [r for r, res in enumerate(per_rank) if "tok.weight" in res["tied_interleaved"]["keys"]]
    assert len(holders) == 4  # stages 0 and 3 live on pp ranks 0 and 1, times dp2
    # SkipNet with pp4: one Linear per stage, BatchNorm buffers on stage 0 only
    assert per_rank[0]["skipnet_bn"]["keys"] == sorted(
        ["l0.weight", "l0.bias", "norm.weight", "norm.bias", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"])
    assert per_rank[3]["skipnet_bn"]["keys"] == ["l3.bias", "l3.weight"]
    # automatic balancing of 4 blocks over 4 stages: one block per stage, embeddings first, head last
    assert all(k.startswith("blocks.1.") for k in per_rank[1]["auto_always"]["keys"])
    assert {"tok.weight", "pos.weight"} <= set(per_rank[0]["auto_always"]["keys"])
    assert {"head.weight", "ln.weight"} <= set(per_rank[3]["auto_always"]["keys"])


def test_timeline_trace_and_text(results):
    per_rank, trace_dir = results
    trace = json.loads(open(f"{trace_dir}/trace.json").read())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_rank = {r: [e["name"] for e in spans if e["pid"] == r and e["cat"] in "FBO"] for r in range(4)}
    for r in range(4):
        # four micro-batches forward and backward, one optimizer piece, on every stage
        assert sorted(n.split()[0] for n in by_rank[r]) == sorted([f"F{r}"] * 4 + [f"B{r}"] * 4 + [f"O{r}"])
    assert by_rank[3][:2] == ["F3 mb0", "B3 mb0"]  # 1F1B: last stage alternates at once
    assert any(e["cat"] == "send" for e in spans) and any(e["cat"] == "recv" for e in spans)
    # checkpointing except_last: stages 0-2 recompute each micro-batch's forward, stage 3 keeps it
    recomputes = [sum(1 for e in spans if e["pid"] == r and e["cat"] == "R") for r in range(4)]
    assert recomputes == [4, 4, 4, 0]
    # the dump of each compile holds the stage programs and its first run's timeline
    dumps = per_rank[0]["skipnet_bn"]["dumps"]
    assert len(dumps) == 2 and all({"timeline.txt", "timeline_trace.json", "pipeline.txt", "stage_3_F.py"} <= set(d) for d in dumps)
    assert per_rank[1]["skipnet_bn"]["dumps"] == []  # rank 0 writes dumps by default
    rows = per_rank[0]["skipnet_bn"]["timeline"].splitlines()
    assert len(rows) == 5 and rows[0].startswith("step ")
    for r, row in enumerate(rows[1:]):
        assert row.startswith(f"rank {r}") and "O" in row and "bubble" in row
