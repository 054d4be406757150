"""The mesh a compiled step runs on, and the process groups' end.

:func:`as_mesh` makes the DeviceMesh from what ``compile(mesh=...)`` was given; every
:class:`~.step.StepDriver` is registered in ``_LIVE`` so that what holds process groups
is freed before the interpreter shuts down (:func:`_release_at_exit`, which says why).
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
    """Tear down what the compiled steps hold of the process groups before the
    interpreter finalizes, so a script can end as any script does (its last line, or
    ``sys.exit``) after ``destroy_process_group()``.

    The cause this answers (seen on gloo, torch 2.13, in about one exit in four without it):
    a gloo process group still alive when Python finalizes is freed there, and its worker
    thread (``pt_gloo_runloop``) then releases the last reference to its last work, whose
    tensors have Python objects: it asks for the GIL, Python ends any thread that asks
    during finalization (``pthread_exit``), the unwind crosses a C++ destructor and the
    process aborts ("terminate called without an active exception", SIGABRT) after the
    training succeeded. What keeps a group alive past ``destroy_process_group()``: the
    DeviceMesh (it keeps its groups in a registry), which DTensor's process-wide caches,
    the compiled programs (placements on their nodes) and the user's DTensors reach. Here,
    at exit, before finalization: every step's programs and DTensor's caches are dropped
    and, once the default group is destroyed, the meshes' references to their groups, so
    the groups are freed while threads can still take the GIL. The heartbeat threads
    (:mod:`.failure`) stop first: one inside ``store.add`` at finalization would abort the
    same way.
    """
    from .failure import stop_heartbeats

    stop_heartbeats()
    meshes = [step._mesh for step in list(_LIVE) if getattr(step, "_mesh", None) is not None]
    for step in list(_LIVE):
        step._release()
    pt.clear_dtensor_caches()
    if not dist.is_initialized():  # destroyed: nothing else should hold its groups
        for mesh in meshes:
            pt.drop_mesh_groups(mesh)
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
