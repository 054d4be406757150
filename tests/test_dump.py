"""Dumps: annotated graphs, provenance, byte counts, summaries, diffs, CLI, logging."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.dump.diff import diff_dumps
from spmd_compiler.dump.writer import write_dump
from spmd_compiler.testing.models import GPT, MLP, gpt_2d_plan, megatron_mlp_plan, train_step



def _forward_line() -> int:
    """The line of MLP.forward's return in spmd_compiler/testing/models.py."""
    import inspect

    from spmd_compiler.testing.models import MLP

    lines, start = inspect.getsourcelines(MLP.forward)
    return start + next(i for i, text in enumerate(lines) if "return self.l2" in text)


def mse_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.fixture
def megatron_dump(tmp_path, mesh4):
    model = MLP(16, 32)
    traced = sc.trace(mse_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16), torch.randn(8, 16))
    plan = sc.Plan(params=megatron_mlp_plan().params, default_input=[sc.Replicate()])
    step = sc.expand(traced, mesh4, plan)
    return step, write_dump(tmp_path, step, name="mlp")


def test_megatron_mlp_dump_files(megatron_dump):
    step, folder = megatron_dump
    assert {p.name for p in folder.iterdir()} >= {"traced.py", "expanded.py", "collectives.json", "comm_summary.json", "comm_summary.txt", "meta.json", "report.html"}
    expanded = (folder / "expanded.py").read_text()
    # placements and global/local shapes of the sharded weights
    assert "# p_l1_weight: S(0) | global [32, 16] | local [8, 16] | param l1.weight" in expanded
    assert "# p_l2_weight: S(1) | global [16, 32] | local [16, 8] | param l2.weight" in expanded
    # the only collective: the forward all_reduce, with its cause and user line
    (comm,) = json.loads((folder / "collectives.json").read_text())
    assert comm["kind"] == "all_reduce" and comm["phase"] == "forward" and comm["axis_name"] == "dp"
    assert comm["origin"] == "addmm_1" and comm["value"] == "relu @ t_1" and comm["transition"] == "P(sum)->R"
    assert comm["bytes"] == 8 * 16 * 4  # [8, 16] float32 per rank
    line = _forward_line()
    assert comm["source"].endswith(f"models.py:{line} in forward: return self.l2(torch.relu(self.l1(x)))")
    assert "all_reduce <- relu @ t_1: P(sum)->R on 'dp' for addmm_1" in expanded
    summary = json.loads((folder / "comm_summary.json").read_text())
    assert summary["rows"] == [{"phase": "forward", "kind": "all_reduce", "axis": "dp", "count": 1, "bytes": 512, "wire_bytes": 768}]
    assert summary["groups"] == [{"axis": "dp", "launches": 1, "buckets": 0, "bucketed": 0}]
    traced = (folder / "traced.py").read_text()
    assert "# ---------------- backward ----------------" in traced and f"models.py:{line}" in traced


def test_comm_summary_counts_launches_and_buckets_per_group(mesh4):
    from spmd_compiler.dump.summary import comm_summary
    from spmd_compiler.optimize import bucket_gradients_pass

    model = MLP(16, 32)
    traced = sc.trace(mse_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16), torch.randn(8, 16))
    step = sc.expand(traced, mesh4)  # data parallel: the loss and the 4 gradients, each reduced on its own
    before = comm_summary(step.gm).groups
    assert [(g.axis, g.launches, g.buckets, g.bucketed) for g in before] == [("dp", 5, 0, 0)]
    summary = comm_summary(bucket_gradients_pass(step.gm))
    assert [(g.axis, g.launches, g.buckets, g.bucketed) for g in summary.groups] == [("dp", 1, 1, 5)]  # one bucket, the loss in it
    assert summary.total_count == 1
    table = summary.table().splitlines()
    assert table[-2].split() == ["group", "launches", "buckets", "values", "in", "buckets", "single"]
    assert table[-1].split() == ["dp", "1", "1", "5", "0"]
    alone = comm_summary(bucket_gradients_pass(sc.expand(traced, mesh4).gm, fuse_other_all_reduces=False))
    assert [(g.axis, g.launches, g.buckets, g.bucketed) for g in alone.groups] == [("dp", 2, 1, 4)]  # the loss + one bucket


@pytest.mark.slow
def test_2d_transformer_dump(tmp_path, mesh2x2):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1)
    ids = torch.randint(0, 32, (4, 8))
    traced = sc.trace(train_step, model, torch.optim.AdamW(model.parameters(), lr=0.1), ids, ids)
    step = sc.expand(traced, mesh2x2, gpt_2d_plan())
    folder = write_dump(tmp_path, step, name="gpt")
    expanded = (folder / "expanded.py").read_text()
    assert "# p_blocks_0_attn_q_weight: RS(0) | global [16, 16] | local [8, 16] | param blocks.0.attn.q.weight" in expanded
    assert "# in_batch_0: S(0)R | global [4, 8] | local [2, 8] | batch batch[0]" in expanded
    comms = json.loads((folder / "collectives.json").read_text())
    assert {c["axis_name"] for c in comms} == {"dp", "tp"}
    for c in comms:  # every collective knows why it exists and what it costs
        assert c["origin"] and c["transition"] and c["bytes"] > 0 and c["phase"] in ("forward", "backward", "optimizer", "output")
    forward_tp = [c for c in comms if c["phase"] == "forward" and c["axis_name"] == "tp"]
    assert [c["kind"] for c in forward_tp] == ["all_reduce", "all_reduce"]  # one per sub-layer (Megatron)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["mesh"] == {"dp": 2, "tp": 2}
    assert any(i["name"] == "blocks.0.attn.q.weight" and i["from"] == "plan['blocks.*.attn.[qkv].weight']" for i in meta["inputs"])


def test_diff_two_plans(tmp_path, mesh4):
    model = MLP(16, 32)
    traced = sc.trace(mse_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16), torch.randn(8, 16))
    a = write_dump(tmp_path / "a", sc.expand(traced, mesh4), name="dp")
    b = write_dump(tmp_path / "b", sc.expand(traced, mesh4, sc.Plan(params={"*": [sc.Shard(0)]})), name="fsdp")
    d = diff_dumps(a, b)
    assert not d.empty
    assert any(c["kind"] == "all_reduce" and c["phase"] == "optimizer" for c in d.vanished)  # DP gradient all_reduces
    assert any(c["kind"] == "all_gather" and c["phase"] == "forward" for c in d.appeared)  # FSDP parameter gathers
    assert "vanished" in d.text() and "appeared" in d.text()
    same = diff_dumps(a, a)
    assert same.empty and "no collective differs" in same.text()


def test_env_var_and_compile_dump_dir(tmp_path, mesh4, monkeypatch):
    monkeypatch.setenv("SPMD_COMPILER_DUMP", str(tmp_path / "env"))
    model = MLP()
    step = sc.compile(mse_step, mesh=mesh4)
    step(model, torch.optim.Adam(model.parameters()), torch.randn(2, 16), torch.randn(2, 16))
    step(model, torch.optim.Adam(model.parameters()), torch.randn(2, 16), torch.randn(2, 16))
    assert sorted(p.name for p in (tmp_path / "env").iterdir()) == ["mse_step-000-rank0"] or len(step.dumps) >= 1
    explicit = sc.compile(mse_step, mesh=mesh4, dump_dir=str(tmp_path / "explicit"))
    model = MLP()
    explicit(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 16), torch.randn(2, 16))
    assert (tmp_path / "explicit" / "mse_step-000-rank0" / "report.html").exists()


def test_logging_silent_by_default_and_informative_at_info(mesh4, caplog, capsys):
    model = MLP()
    step = sc.compile(mse_step, mesh=mesh4)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 16), torch.randn(2, 16))
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""  # no output unless asked
    model = MLP()
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        sc.compile(mse_step, mesh=mesh4)(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 16), torch.randn(2, 16))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "(trace" in text and "expand" in text and "rebuild" in text  # phase times
    assert "collectives per rank per step" in text and "all_reduce" in text  # the summary
    assert "memory per rank per step (static trace):\npeak " in text  # and the static memory trace
    with caplog.at_level(logging.DEBUG, logger="spmd_compiler.expand"):
        caplog.clear()
        fresh = MLP()
        sc.expand(sc.trace(mse_step, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), torch.randn(2, 16), torch.randn(2, 16)), mesh4)
    assert any(r.getMessage().startswith("expand addmm") for r in caplog.records)  # per-node expansion


SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import spmd_compiler
    from spmd_compiler.testing.models import MLP

    def step(model, opt, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()
        return loss

    dist.init_process_group("gloo")   # replaced by a fake group under explain
    compiled = spmd_compiler.compile(step, mesh=(dist.get_world_size(),))
    model = MLP()
    print("loss", float(compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 16), torch.randn(2, 16))))
    import os
    os._exit(0)  # as scripts that dodge an interpreter shutdown do: explain still prints its summary
""")


def test_cli_explain_and_diff(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "spmd_compiler", "explain", str(script), "--world-size", "8", "--dump-dir", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "all_reduce" in out.stdout and "report.html" in out.stdout
    # explain's own summary: what was compiled and why, each collective's reason and bytes, the static peak
    assert re.search(r"^explain: .*train\.py compiled 1 program on a fake process group of 8 ranks", out.stdout, re.M), out.stdout
    assert "(compiled: first call)" in out.stdout and "static peak " in out.stdout
    assert re.search(r"^\s+optimizer\s+all_reduce\s+axis0\s+x1\s+[\d.]+ (B|KiB)\s+bucket of 4 gradient all_reduces", out.stdout, re.M), out.stdout
    (folder,) = list((tmp_path / "d").iterdir())
    assert json.loads((folder / "meta.json").read_text())["world size"] == 8
    diff = subprocess.run([sys.executable, "-m", "spmd_compiler", "diff", str(folder), str(folder)], capture_output=True, text=True, timeout=120)
    assert diff.returncode == 0 and "no collective differs" in diff.stdout


def test_cli_explain_of_the_example_prints_its_summary_and_no_fake_figures(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "spmd_compiler", "explain", os.path.join(root, "examples", "train_gpt.py"), "--world-size", "8",
           "--dump-dir", str(tmp_path / "d"), "--", "--strategy", "2d", "--steps", "2", "--layers", "1", "--dim", "16", "--seq", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(8 x fake)" in out.stdout and "x gloo" not in out.stdout and "loss " not in out.stdout, out.stdout
    assert "train_gpt.py compiled 1 program on a fake process group of 8 ranks" in out.stdout, out.stdout
    assert re.search(r"^\s+forward\s+all_reduce\s+tp\s+x2\s+", out.stdout, re.M), out.stdout
