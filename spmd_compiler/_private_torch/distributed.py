"""Process groups and pipelining: c10d group names, timeouts and store, and the
pipelining schedules' action order.

Touches ``DeviceMesh.get_group(...).group_name`` (the name functional collectives take),
``DeviceMesh._pg_registry`` / ``_get_root_mesh`` (the process groups a mesh holds),
``torch.distributed.distributed_c10d`` (``_set_pg_timeout``, ``_get_default_store``) and
``torch.distributed.pipelining.schedules`` private order computations
(``_get_pipeline_order``, ``_calculate_single_rank_operations``, ``_ComputationType``).
Checked against torch 2.13.0 and 2.14.1.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["world_info", "group_name", "set_group_timeout", "default_store", "pipeline_order", "collectives_launched",
           "drop_mesh_groups"]


def world_info() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1



def group_name(mesh: DeviceMesh, axis: int) -> str:
    """The c10d group name used by functional collectives over ``axis`` of ``mesh``."""
    return mesh.get_group(axis).group_name



def drop_mesh_groups(mesh: DeviceMesh) -> int:
    """Drop the references ``mesh`` (its root mesh's registry) holds to its process groups
    (a DeviceMesh keeps them after ``destroy_process_group()``); returns how many."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    n = 0
    for m in {id(root): root, id(mesh): mesh}.values():
        registry = getattr(m, "_pg_registry", None)
        if isinstance(registry, dict):
            n += len(registry)
            registry.clear()
    return n



def set_group_timeout(group: Any, seconds: float) -> None:
    """Timeout of the collectives on ``group`` (gloo: 30 min by default, NCCL: 10 min)."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds), group)



def collectives_launched(name: str) -> int | None:
    """How many collectives the process group named ``name`` (a functional collective's
    ``group_name``) has launched so far (its sequence number); None if it does not count
    them (a fake group) or is not registered."""
    from torch._C._distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)._get_sequence_number_for_group()
    except (RuntimeError, ValueError, AttributeError):
        return None



def default_store() -> Any:
    """The rendezvous key-value store of the default process group (None if there is none)."""
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store()
    except (RuntimeError, ValueError):
        return None



def pipeline_order(schedule: str, pp_size: int, n_microbatches: int, stages_per_rank: int = 1) -> dict[int, list[Any]]:
    """torch.distributed.pipelining's action order for a schedule, without building it.

    Returns ``{pp rank: [(stage, "F" | "B", microbatch) or None (idle), ...]}`` from
    the schedule classes' own order computations (GPipe, 1F1B, Interleaved1F1B).
    """
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as S

    if schedule in ("GPipe", "1F1B"):
        cls = S.ScheduleGPipe if schedule == "GPipe" else S.Schedule1F1B
        order = cls._get_pipeline_order(SimpleNamespace(_num_stages=pp_size, _n_microbatches=n_microbatches))
    elif schedule == "Interleaved1F1B":
        rounds = max(1, n_microbatches // pp_size)
        fake = SimpleNamespace(
            n_local_stages=stages_per_rank,
            pp_group_size=pp_size,
            _n_microbatches=n_microbatches,
            number_of_rounds=rounds,
            microbatches_per_round=n_microbatches // rounds,
        )
        order = {r: S.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, r) for r in range(pp_size)}
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    kinds = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B"}
    out: dict[int, list[Any]] = {}
    for rank, actions in order.items():
        row = []
        for a in actions:
            if a is None:
                row.append(None)
            elif a.computation_type in kinds:
                row.append((a.stage_index, kinds[a.computation_type], a.microbatch_index))
        out[rank] = row
    return out
