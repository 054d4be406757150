"""A ``fused_shard`` tensor in and out of ``Shard`` layout, for checkpoints.

``fused_shard(d, k)`` (torch's ``_StridedShard(d, k)`` as a layout) gives rank ``j`` of an
axis of ``n`` ranks block ``j`` of each of the ``k`` pieces of dim ``d``: its local tensor
is ``k`` separate ranges of the global one. torch.distributed.checkpoint stores a local
tensor as one range (it refuses these: "overlapping chunks"), so a checkpoint holds such a
tensor in ``Shard(d)`` layout, each rank one contiguous range, and a load converts it
back. Each conversion gathers the tensor over that one mesh axis (checkpoints only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .. import _private_torch as pt

__all__ = ["has_fused_layout", "to_shard_layout", "to_fused_layout", "empty_stored_layout"]


def _strided_axis(t: Any) -> tuple[int, Any] | None:
    if not isinstance(t, DTensor):
        return None
    found = [(a, p) for a, p in enumerate(t.placements) if isinstance(p, pt.StridedShard)]
    if not found:
        return None
    axis, p = found[0]
    n, d, sf = t.device_mesh.shape[axis], p.dim % t.dim(), int(p.split_factor)
    if len(found) > 1 or any(getattr(q, "dim", None) == d for a, q in enumerate(t.placements) if a != axis) or t.shape[d] % (sf * n):
        raise ValueError(
            f"a checkpoint of a tensor placed {list(t.placements)} (shape {list(t.shape)}): expected fused_shard(d, k) on one "
            f"mesh axis, no other axis splitting dim d, and dim d a multiple of k x the axis size. fix: such a plan for the "
            f"fused weight, or Shard(d)")
    return axis, p


def has_fused_layout(t: Any) -> bool:
    return _strided_axis(t) is not None


def _gather_axis(local: torch.Tensor, mesh: Any, axis: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(local) for _ in range(mesh.shape[axis])]
    dist.all_gather(parts, local.contiguous(), group=mesh.get_group(axis))
    return parts


def _whole_dim(t: DTensor, axis: int, d: int, sf: int, local: torch.Tensor, strided: bool) -> torch.Tensor:
    """The tensor whole along ``d`` (still split on the other axes), from every rank of
    ``axis``'s local tensors in the strided (``strided``) or the Shard layout."""
    parts = _gather_axis(local, t.device_mesh, axis)
    if not strided:
        return torch.cat(parts, dim=d)
    c = local.shape[d] // sf
    return torch.cat([part.narrow(d, i * c, c) for i in range(sf) for part in parts], dim=d)


def to_shard_layout(t: Any) -> Any:
    """``t`` (a DTensor placed ``fused_shard(d, k)`` on one axis) as the same global tensor
    placed ``Shard(d)`` there; anything else unchanged."""
    found = _strided_axis(t)
    if found is None:
        return t
    axis, p = found
    d, sf, n = p.dim % t.dim(), int(p.split_factor), t.device_mesh.shape[axis]
    whole = _whole_dim(t, axis, d, sf, t.to_local(), strided=True)
    local = whole.chunk(n, dim=d)[t.device_mesh.get_local_rank(axis)].contiguous()
    placements = list(t.placements)
    placements[axis] = Shard(d)
    return DTensor.from_local(local, t.device_mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def to_fused_layout(shard: DTensor, like: DTensor) -> DTensor:
    """``shard`` (:func:`to_shard_layout`'s layout of ``like``) back in ``like``'s."""
    axis, p = _strided_axis(like)
    d, sf, n = p.dim % like.dim(), int(p.split_factor), like.device_mesh.shape[axis]
    whole = _whole_dim(like, axis, d, sf, shard.to_local(), strided=False)
    c = whole.shape[d] // (sf * n)
    j = like.device_mesh.get_local_rank(axis)
    local = torch.cat([whole.narrow(d, i * (whole.shape[d] // sf) + j * c, c) for i in range(sf)], dim=d)
    return DTensor.from_local(local.contiguous(), like.device_mesh, list(like.placements), run_check=False, shape=like.shape,
                              stride=like.stride())


def empty_stored_layout(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor laid out as a checkpoint stores ``t``: ``t``'s layout, but
    ``Shard(d)`` for a ``fused_shard(d, k)`` axis (no communication)."""
    found = _strided_axis(t)
    if found is None:
        return torch.empty_like(t)
    axis, p = found
    placements = list(t.placements)
    placements[axis] = Shard(p.dim % t.dim())
    mesh = t.device_mesh
    shape, _ = pt.local_shape_and_offset(tuple(t.shape), tuple(mesh.shape), mesh.get_coordinate(), placements)
    local = torch.empty(shape, dtype=t.dtype, device=t.to_local().device)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
