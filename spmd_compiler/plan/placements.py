"""Placements as a plan gives them: validated per mesh axis, checked against a tensor's rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from .. import _private_torch as pt

__all__ = ["PlacementsLike", "ResolvedPlan", "normalize_placements", "fused_shard"]


def fused_shard(dim: int, pieces: int) -> Placement:
    """``Shard(dim)`` of a fused weight: ``pieces`` equal pieces stored one after the
    other along ``dim`` (gate|up of a SwiGLU: 2; q|k|v of equal sizes: 3), each rank
    holding its block of every piece, as Megatron and torchtitan store fused projections.

    A fused dim planned as a plain ``Shard(dim)`` gives rank 0 the first pieces whole and
    the last rank the last ones, so the ``chunk``/``split`` into the pieces costs an
    all_to_all every step (and its gradient another); stored this way, each piece is
    already split over the mesh axis and nothing moves. Example (Hugging Face MoE experts,
    ``gate_up_proj`` [experts, 2 x hidden, dim], under tensor parallelism of the experts)::

        Plan(params={"*.experts.gate_up_proj": [fused_shard(1, 2)], "*.experts.down_proj": [Shard(2)]})

    (torch's ``_StridedShard(dim, split_factor=pieces)``. ``step.save_checkpoint`` stores
    such a tensor in ``Shard(dim)`` layout, so the checkpoint holds the whole tensor in its
    usual order and loads under any plan; torch.distributed.checkpoint refuses the strided
    layout itself.)
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or isinstance(pieces, bool) or not isinstance(pieces, int):
        raise TypeError(f"fused_shard({dim!r}, {pieces!r}): expected two ints (the fused dim, its number of equal pieces)")
    if pieces < 1:
        raise ValueError(f"fused_shard({dim}, {pieces}): expected pieces >= 1 (2 for gate|up, 3 for q|k|v); got {pieces}")
    return Shard(dim) if pieces == 1 else pt.StridedShard(dim, split_factor=pieces)

PlacementsLike = Any  # Placement | Sequence[Placement]


def normalize_placements(value: PlacementsLike, ndim: int, what: str) -> tuple[Placement, ...]:
    """Validate ``value`` as placements for a mesh of ``ndim`` axes.

    A single Placement is accepted for a 1-D mesh only.
    """
    if isinstance(value, Placement):
        if ndim != 1:
            raise ValueError(
                f"{what}: got a single placement {value!r} for a {ndim}-D mesh; expected a list of {ndim} "
                f"placements, one per mesh axis. fix: write a list, e.g. {[value] + [Replicate()] * (ndim - 1)!r}"
            )
        return (value,)
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(
            f"{what}: expected a Placement or a list of {ndim} placements, got {type(value).__name__} {value!r}. "
            f"fix: use torch.distributed.tensor placements, e.g. {[Shard(0)] + [Replicate()] * (ndim - 1)!r}"
        )
    out = tuple(value)
    if len(out) != ndim:
        raise ValueError(
            f"{what}: got {len(out)} placements {list(out)} for a mesh with {ndim} axes; expected exactly "
            f"one placement per mesh axis. fix: give {ndim} placements (Replicate() on the axes that do not split it)"
        )
    for p in out:
        if not isinstance(p, Placement):
            raise TypeError(
                f"{what}: {p!r} in {list(out)} is not a Placement; expected Shard(d), Replicate() or Partial(). "
                f"fix: use the objects from torch.distributed.tensor (Shard(0), not the string 'Shard(0)')"
            )
    return out


@dataclass(frozen=True)
class ResolvedPlan:
    """One placements tuple per graph input, plus where each came from; ``grads``: the
    placements of every parameter's gradient kept for the next call (that of its
    parameter, or ``Partial`` on the data axes under ``Plan(defer_grad_sync=True)``)."""

    placements: tuple[tuple[Placement, ...], ...]
    sources: tuple[str, ...]
    grads: dict = field(default_factory=dict, compare=False)

    def __iter__(self):
        return iter(self.placements)


def _check_dims(inp: Any, placements: tuple[Placement, ...], source: str = "the plan") -> tuple[Placement, ...]:
    """Validate shard dims against the tensor's rank and make them non-negative.

    ``source`` says where the placements came from (``plan['l1.*']``), for the message.
    """
    ndim = len(inp.shape)
    what = f"{inp.label} (shape {list(inp.shape)}) gets placements {list(placements)!r} from {source}"
    out = []
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                dims = f"a dim in [0, {ndim - 1}] (or [{-ndim}, -1])" if ndim else "none (a 0-d tensor has no dim to split)"
                where = (
                    f"Plan(inputs={{{inp.name!r}: ...}}) sets it" if inp.kind == "batch"
                    else f"in {source}" if source.startswith(f"plan[{inp.name!r}]")
                    else f"{source}: no tensor it matches has that dim"
                )
                raise ValueError(
                    f"{what}: Shard({p.dim}) on mesh axis {axis} is out of range for a {ndim}-d tensor; expected "
                    f"{dims}. fix: shard a dim the tensor has, or use Replicate() on mesh axis {axis} ({where})"
                )
            p = Shard(p.dim % ndim)
        elif isinstance(p, pt.StridedShard):
            sf = int(p.split_factor)
            if not -ndim <= p.dim < ndim or inp.shape[p.dim % ndim] % sf:
                size = f"of size {inp.shape[p.dim % ndim]}" if -ndim <= p.dim < ndim else f"out of range for a {ndim}-d tensor"
                raise ValueError(
                    f"{what}: fused_shard({p.dim}, {sf}) on mesh axis {axis}: dim {p.dim} {size}; expected a dim of "
                    f"the tensor made of {sf} equal pieces (its size a multiple of {sf}). fix: the fused dim and its "
                    f"number of pieces (gate|up: 2), or Shard(d) for a dim that is not fused")
            p = pt.StridedShard(p.dim % ndim, split_factor=sf)
        elif isinstance(p, Partial) and inp.kind != "batch":
            raise ValueError(
                f"{what}: {p!r} on mesh axis {axis} is only meaningful for batch inputs, not for a {inp.kind} "
                f"(its one value would be split into per-rank terms of a sum). fix: use Shard(d) or Replicate() "
                f"for {inp.kind}s; gradients become Partial by themselves where the program needs it"
            )
        out.append(p)
    return tuple(out)
