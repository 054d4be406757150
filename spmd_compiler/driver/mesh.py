"""The mesh a compiled step runs on, and the process groups' end.

:func:`as_mesh` makes the DeviceMesh from what ``compile(mesh=...)`` was given; every
:class:`~.step.StepDriver` is registered in ``_LIVE`` so that what holds process groups
is freed before the interpreter shuts down (:func:`_release_at_exit`).
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import _private_torch as pt
from .agreement import comm_device

if TYPE_CHECKING:
    from .step import StepDriver

__all__ = ["as_mesh"]


_LIVE: "weakref.WeakSet[StepDriver]" = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    """Free what holds process groups before the interpreter shuts down (best effort).

    A compiled graph reaches the DeviceMesh through the placements recorded on its
    nodes, DTensor's process-wide caches hold meshes too, and a mesh holds its process
    groups. Whatever is still alive at interpreter shutdown is destroyed there, where
    gloo's worker threads can no longer take the GIL to release the tensors of their
    last collective, and the process can abort ("terminate called without an active
    exception") after the training itself succeeded. Scripts launched by torchrun should
    end with ``os._exit`` after ``destroy_process_group()``, as ``examples/train_gpt.py`` does.
    """
    for step in list(_LIVE):
        step._release()
    pt.clear_dtensor_caches()
    gc.collect()


def as_mesh(mesh: Any) -> DeviceMesh:
    """A DeviceMesh from a DeviceMesh, a shape tuple or a ``{name: size}`` dict."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, dict):
        names, shape = tuple(mesh), tuple(int(v) for v in mesh.values())
    elif isinstance(mesh, (tuple, list)) and all(isinstance(s, int) for s in mesh):
        names, shape = None, tuple(mesh)
    else:
        raise TypeError(f"mesh must be a DeviceMesh, a shape tuple or a {{name: size}} dict, got {type(mesh).__name__}")
    if not dist.is_initialized():
        raise ValueError(
            f"mesh {shape} needs an initialized process group; call torch.distributed.init_process_group() "
            f"first (torchrun sets up the environment for it)"
        )
    world = dist.get_world_size()
    size = 1
    for s in shape:
        size *= s
    if size > world:
        raise ValueError(f"mesh {dict(zip(names, shape)) if names else shape} needs {size} ranks but the world has {world}; fix: launch {size} processes or shrink the mesh")
    return init_device_mesh(comm_device().type, shape, mesh_dim_names=names)  # NCCL: cuda, else cpu
