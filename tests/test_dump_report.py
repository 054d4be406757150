"""The HTML report renders in a real headless browser (Chromium)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.dump.writer import write_dump
from spmd_compiler.expand import registry
from spmd_compiler.expand.args import NoStrategy
from spmd_compiler.testing.models import GPT, MLP, GPTConfig, gpt_2d_plan, train_step

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def _browser():
    if BROWSER is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs a headless Chromium for this test: run scripts/install_browser.sh")
        pytest.skip("no Chromium on PATH (scripts/install_browser.sh installs one)")
    return BROWSER


def mse_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_report_renders_nodes_and_collectives(tmp_path, mesh4):
    browser = _browser()
    model = MLP(16, 32)
    traced = sc.trace(mse_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16), torch.randn(8, 16))
    folder = write_dump(tmp_path, sc.expand(traced, mesh4, sc.Plan(params={"*": [sc.Shard(0)]})), name="fsdp")
    url = (folder / "report.html").as_uri()
    common = [browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert "<table id=\"expanded\">" in dom and "p_l1_weight" in dom and "all_gather_into_tensor" in dom
    comms = len(sc.expand(traced, mesh4, sc.Plan(params={"*": [sc.Shard(0)]})).collectives())
    assert comms > 0 and dom.count('class="row comm"') == comms
    assert 'href="#t-addmm"' in dom  # a collective links to the traced node that caused it
    assert "rows shown" in dom  # the script ran
    # the pictures: the memory plot (inline SVG), communication by layer and module, the notes
    assert '<svg class="plot"' in dom and "peak " in dom and '<table class="compact" id="layers">' in dom
    assert '<div id="notes">' in dom
    # the search box filters: ?q=reduce_scatter hides every row that does not mention it
    filtered = subprocess.run([*common, "--dump-dom", url + "?q=reduce_scatter"], capture_output=True, text=True, timeout=120).stdout
    visible = [line for line in filtered.split("<tr ") if 'class="row' in line and 'style="display: none;"' not in line]
    assert visible and all("reduce_scatter" in row for row in visible)
    shot = tmp_path / "report.png"
    subprocess.run([*common, "--window-size=1400,900", f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000


class FallbackModel(nn.Module):
    """Two ops without a sharding strategy: renorm (DTensor has none) and cummax (the test
    takes its rule away), each run through the replicate fallback for its own reason."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.renorm(self.l1(x), p=2, dim=0, maxnorm=1.0)
        h = h + torch.cummax(h, dim=0).values
        return self.l2(h)


def sum_step(model, optimizer, x):
    loss = model(x).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@contextlib.contextmanager
def without_rule(op):
    def refuse(ctx, b, op, args, kwargs):
        raise NoStrategy(f"{op} has its rule taken away by the test")

    saved = registry._RULES.get(op)
    registry._RULES[op] = refuse
    try:
        yield
    finally:
        if saved is None:
            registry._RULES.pop(op, None)
        else:
            registry._RULES[op] = saved


_NOTE = re.compile(r"(replicate fallback|moved|recomputed): (.*?)(?= \| |$)", re.M)


def test_report_has_every_fallback_and_scheduling_reason_of_the_text_dump(tmp_path, mesh4):
    model = FallbackModel()
    with without_rule(torch.ops.aten.cummax.default):
        step = sc.compile(sum_step, mesh=mesh4, dump_dir=str(tmp_path))
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 4))
    (folder,) = step.dumps
    texts = {(m.group(1), m.group(2)) for f in folder.glob("*.py") for m in _NOTE.finditer(f.read_text())}
    report = (folder / "report.html").read_text()
    notes = re.search(r"<div id='notes'>(.*?)</div>", report, re.S).group(1)
    shown = {(m.group(1), _unescape(m.group(2))) for m in re.finditer(r"<b>([^<]+)</b>: <span class='reason'>([^<]*)</span>", notes)}
    assert shown == texts
    fallbacks = {t for label, t in texts if label == "replicate fallback"}
    assert len(fallbacks) == 2 and any("renorm" in t for t in fallbacks) and any("taken away by the test" in t for t in fallbacks)
    assert any(label == "moved" for label, _ in texts)  # the schedule pass's notes


def _unescape(text: str) -> str:
    import html

    return html.unescape(text)


def test_report_plots_memory_and_tables_communication_by_module(tmp_path, mesh2x2):
    model = GPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2))
    ids = torch.randint(0, 32, (4, 8))
    traced = sc.trace(train_step, model, torch.optim.AdamW(model.parameters()), ids, ids)
    step = sc.expand(traced, mesh2x2, gpt_2d_plan())
    report = (write_dump(tmp_path, step, name="gpt") / "report.html").read_text()
    svg = re.search(r"<svg class=\"plot\".*?</svg>", report, re.S).group(0)
    assert "<path d=\"M" in svg and "peak " in svg and "inputs " in svg  # the curve, its peak, the inputs' line
    assert svg.count("<rect") >= 3  # forward, backward and optimizer bands
    layers = re.search(r"<table class='compact' id='layers'>(.*?)</table>", report, re.S).group(1)
    modules = re.search(r"<table class='compact' id='modules'>(.*?)</table>", report, re.S).group(1)
    assert {"blocks.0", "blocks.1"} <= set(re.findall(r"<td class='mono'>([^<]+)</td>", layers))
    # tensor parallel's activation all_reduces belong to the attention out- and MLP down-projections
    rows = {m.group(1): m.group(2) for m in re.finditer(r"<td class='mono'>[^<]+</td><td class='mono'>([^<]+)</td>(.*?)</tr>", modules)}
    assert "forward all_reduce/tp" in rows["blocks.0.attn.out"] and "forward all_reduce/tp" in rows["blocks.1.proj"]
    assert "optimizer all_reduce/dp" in rows["head"]  # a gradient: the module holding the parameter
