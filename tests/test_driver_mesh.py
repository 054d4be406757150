"""The process groups' end (spmd_compiler/driver/mesh.py): at exit, after
``destroy_process_group()``, nothing the compiled step made keeps a process group or a
heartbeat thread alive into interpreter finalization (where gloo's worker threads abort
the process), so scripts need no ``os._exit``."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.driver import mesh as mesh_module
from spmd_compiler.testing.models import MLP, mse_train_step

pytestmark = pytest.mark.gloo


def _held_at_exit(rank: int, world: int) -> dict:
    model = MLP()  # its parameters become DTensors on the step's mesh, and stay alive here
    step = sc.compile(mse_train_step, mesh=(world,))
    g = torch.Generator().manual_seed(rank)  # each rank its own rows (equal rows on every rank: a global batch, refused)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g))
    mesh = step.mesh
    before = {"groups": len(mesh._pg_registry), "heartbeat": any(t.name == "spmd_compiler heartbeat" for t in threading.enumerate())}
    dist.destroy_process_group()
    mesh_module._release_at_exit()  # what atexit runs
    after = {"groups": len(mesh._pg_registry), "heartbeat": any(t.name == "spmd_compiler heartbeat" for t in threading.enumerate())}
    return {"before": before, "after": after, "params are DTensors": all(type(p).__name__ == "DTensor" for p in model.parameters())}


def test_exit_release_drops_the_meshes_groups_and_stops_the_heartbeat():
    for out in run_processes(_held_at_exit, 2, timeout=180):
        assert out["before"] == {"groups": 1, "heartbeat": True}
        assert out["after"] == {"groups": 0, "heartbeat": False}
        assert out["params are DTensors"]
