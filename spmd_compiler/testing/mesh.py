"""Meshes over a fake process group, for compile-only work and simulation in one process."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["fake_mesh"]


def fake_mesh(shape: Sequence[int], names: Sequence[str] | None = None, *, world_size: int = 64) -> DeviceMesh:
    """A DeviceMesh of ``shape`` over a fake process group (no communication happens).

    Initializes the fake group (world size ``max(world_size, prod(shape))``, this process
    is rank 0) if no group exists, or replaces a smaller fake group. Raises RuntimeError
    when a real process group is initialized: a fake mesh must not mix with real ranks.
    """
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake":
            raise RuntimeError(
                f"fake_mesh needs the fake process group, but a {backend!r} group is initialized; "
                f"use DeviceMesh/init_device_mesh with the real group instead"
            )
        if dist.get_world_size() < n:
            dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=max(world_size, n))
    return DeviceMesh("cpu", torch.arange(n).view(shape), mesh_dim_names=tuple(names) if names else None)
