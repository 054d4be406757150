"""The HTML report renders in a real headless browser (Chromium)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.dump.writer import write_dump
from spmd_compiler.testing.models import MLP

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
    # the search box filters: ?q=reduce_scatter hides every row that does not mention it
    filtered = subprocess.run([*common, "--dump-dom", url + "?q=reduce_scatter"], capture_output=True, text=True, timeout=120).stdout
    visible = [line for line in filtered.split("<tr ") if 'class="row' in line and 'style="display: none;"' not in line]
    assert visible and all("reduce_scatter" in row for row in visible)
    shot = tmp_path / "report.png"
    subprocess.run([*common, "--window-size=1400,900", f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000
