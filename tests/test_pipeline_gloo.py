"""Pipelined training on real gloo processes (4 ranks, forked), against one device.

Five configurations in one launch (each compiles in a few seconds):
- pp2 x dp2, GPT with tied embedding / LM head, interleaved 1F1B with two stages per
  rank, cut by a split spec (embeddings, block 0, block 1, final norm and head), AdamW;
- pp2 x tp2, Megatron-TP GPT, GPipe, SGD with momentum;
- pp4 SkipNet: ``pipe_split()`` markers, a skip connection over a stage, dict/None/scalar
  stage outputs, BatchNorm with deferred statistics, activation checkpointing
  ``except_last``, 1F1B, with a dump (stage files and the executed timeline);
- pp2 x dp2 FSDP GPT, 1F1B: each stage's parameters gathered once per step (its G piece),
  the gradients reduce-scattered once, the passes run on the pieces;
- pp4 GPT cut by automatic balancing, checkpointing ``always``, GPipe, SGD with momentum.
Tolerance: float64, 1e-10 on the loss and parameters. These compile with
``symbolic="none"`` (symbolic batch dims cost a third of the trace time); the
schedule-order launch compiles with the default symbolic batch dims.

And the order each rank executed its forward/backward micro-batch actions, against
orders written out by hand from the schedules' definitions (never from
``build_schedule``: a changed schedule computes the same numbers, only the order shows it).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.testing import distribution_of
from spmd_compiler.testing.models import GPT, SkipNet, gpt_fsdp_plan, gpt_tp_plan, mse_train_step, train_step

pytestmark = pytest.mark.gloo

S = sc.SplitPoint.BEGINNING
CONFIGS = {
    "tied_interleaved": dict(model="gpt", tie=True, layers=2, mesh={"pp": 2, "dp": 2}, pipe=sc.Pipeline(
        chunks=2, schedule="Interleaved1F1B", stages_per_rank=2, split={"blocks.0": S, "blocks.1": S, "ln": S})),
    "tp_gpipe": dict(model="gpt", layers=2, mesh={"pp": 2, "tp": 2}, plan=gpt_tp_plan(), opt="sgd", pipe=sc.Pipeline(
        chunks=2, schedule="GPipe", split={"blocks.1": S})),
    "skipnet_bn": dict(model="skip", mesh={"pp": 4}, pipe=sc.Pipeline(chunks=4, schedule="1F1B", checkpoint="except_last")),
    "fsdp_gathered_once": dict(model="gpt", layers=2, mesh={"pp": 2, "dp": 2}, plan=gpt_fsdp_plan(), pipe=sc.Pipeline(
        chunks=2, schedule="1F1B", split={"blocks.1": S})),
    "auto_always": dict(model="gpt", layers=4, mesh={"pp": 4}, opt="sgd", pipe=sc.Pipeline(chunks=2, schedule="GPipe", auto=True, checkpoint="always")),
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
        if cfg.get("opt") == "sgd":  # momentum: state created by the first step, as AdamW's
            opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
        else:
            opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref))
        all_keys = set(model.state_dict())
        dump = f"{trace_dir}/dump" if name == "skipnet_bn" else None
        # no symbolic batch dims here (the trace's costliest part): the schedule-order
        # launch below compiles with the default symbolic="batch"
        step = sc.compile(fn, mesh=cfg["mesh"], plan=cfg.get("plan"), pipeline=cfg["pipe"], dump_dir=dump, symbolic="none")
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
        assert r["compiles"] == 1  # AdamW state is created before the first trace: one program
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
    assert len(dumps) == 1 and all({"timeline.txt", "timeline_trace.json", "pipeline.txt", "stage_3_F.py"} <= set(d) for d in dumps)
    assert per_rank[1]["skipnet_bn"]["dumps"] == []  # rank 0 writes dumps by default
    rows = per_rank[0]["skipnet_bn"]["timeline"].splitlines()
    assert len(rows) == 5 and rows[0].startswith("step ")
    for r, row in enumerate(rows[1:]):
        assert row.startswith(f"rank {r}") and "O" in row and "bubble" in row


def test_1f1b_order_on_four_stages(results):
    """1F1B on 4 stages, 4 micro-batches: rank r warms up with 3 - r forwards, then
    alternates one forward and one backward, then drains the backwards."""
    _, trace_dir = results
    spans = [e for e in json.loads(open(f"{trace_dir}/trace.json").read())["traceEvents"] if e["ph"] == "X"]
    ran = {r: " ".join(e["cat"] + str(e["args"]["microbatch"]) for e in spans if e["pid"] == r and e["cat"] in "FB") for r in range(4)}
    assert ran == {
        0: "F0 F1 F2 F3 B0 B1 B2 B3",
        1: "F0 F1 F2 B0 F3 B1 B2 B3",
        2: "F0 F1 B0 F2 B1 F3 B2 B3",
        3: "F0 B0 F1 B1 F2 B2 F3 B3",
    }


# Two pipeline ranks, four micro-batches; "sFm" is the forward of stage s on micro-batch m.
# Interleaved1F1B (stage s on rank s % 2; Narayanan et al. 2021): per rank, forwards go
# over 2 micro-batches of its first stage, 2 of its second, and so on; backwards the same
# with the stages reversed; rank r warms up with (2 - 1) * 2 + 2 * (1 - r) forwards.
ORDERS = {
    "GPipe": {0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3", 1: "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3"},
    "1F1B": {0: "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3", 1: "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"},
    "Interleaved1F1B": {0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
                        1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"},
}


def _order_worker(rank: int, world: int) -> dict:
    """One step of each schedule on 4 Linear layers cut into 2 (or 4) stages."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, dtype=torch.float64, generator=g), torch.randn(8, 4, dtype=torch.float64, generator=g)
    out = {}
    for name in ORDERS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) if i % 2 == 0 else torch.nn.Tanh() for i in range(7))).double()
        ref = copy.deepcopy(model)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        spr = 2 if name == "Interleaved1F1B" else 1
        split = {"2": S, "4": S, "6": S} if spr == 2 else {"4": S}
        step = sc.compile(mse_train_step, mesh={"pp": 2}, pipeline=sc.Pipeline(chunks=4, schedule=name, stages_per_rank=spr, split=split))
        loss = step(model, opt, x, y).item()
        ran = " ".join(f"{s.stage}{s.kind}{s.microbatch}" for s in step.last_timeline if s.kind in ("F", "B"))
        loss_err = abs(loss - mse_train_step(ref, ref_opt, x, y).item())
        # the update too: the loss is computed before it, the gradients (summed over
        # micro-batches, divided by their number) only show in the parameters
        ref_sd = ref.state_dict()
        state_err = max((v.full_tensor() - ref_sd[k]).abs().max().item() for k, v in model.state_dict().items())
        out[name] = {"order": ran, "loss_err": loss_err, "state_err": state_err}
    return out


@pytest.fixture(scope="module")
def orders():
    return run_processes(_order_worker, 2, timeout=300)


@pytest.mark.parametrize("name", list(ORDERS))
def test_schedule_order_as_executed(orders, name):
    assert {rank: res[name]["order"] for rank, res in enumerate(orders)} == ORDERS[name]
    assert all(res[name]["loss_err"] < 1e-10 and res[name]["state_err"] < 1e-10 for res in orders), orders
