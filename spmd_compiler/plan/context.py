"""Context parallelism: the sequence of a batch split over one mesh axis.

A plan that splits a batch input along its sequence dim over a mesh axis (``Shard(1)`` of
``(batch, seq)`` token ids) and names that axis in ``Plan(context_parallel=...)`` gets
attention computed per rank on its query rows against the keys they need
(:mod:`spmd_compiler.expand.rules.context_parallel`), and, with ``load_balance``, the
causal layout of torchtitan and Megatron: the sequence cut into ``2 n`` chunks, rank ``r``
holding chunks ``r`` and ``2n - 1 - r`` (a *head* and a *tail*), so every rank has the same
causal work. Every value split over that axis is laid out so: a replicated value split to
meet one (rotary frequencies, learned positions) takes the rank's two chunks, a gathered
one is put back in sequence order; each rank's batch tensors are fed that way
(:meth:`ContextParallel.shard`).

Terms: *chunk* ``c = seq / (2 n)`` positions (``seq / n`` without load balancing); the
*head-tail* layout is the load-balanced one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ContextParallel", "CPLayout", "head_tail_index"]

_ATTENTION = ("allgather", "ring")


@dataclass(frozen=True, kw_only=True)
class ContextParallel:
    """How attention runs over a mesh axis that splits the sequence.

    Attributes:
        axis: the mesh axis (name or index) on which batch inputs are ``Shard(seq dim)``.
        attention: ``"allgather"`` (Llama 3's: each rank gathers every rank's keys and
            values once per attention, forward and backward) or ``"ring"`` (ring
            attention: key/value chunks passed to the next rank, ``n - 1`` times, each
            transfer in flight while the chunk before it is computed; the gradients of keys
            and values travel the ring back). Both merge the per-chunk results with their
            logsumexp and equal one device.
        load_balance: the head-tail layout (every rank the same causal work); ``False``:
            rank ``r`` holds the ``r``-th contiguous piece (causal attention then computes
            the blocks above the diagonal too and drops them).
    """

    axis: str | int = "cp"
    attention: str = "allgather"
    load_balance: bool = True

    def __post_init__(self) -> None:
        if self.attention not in _ATTENTION:
            raise ValueError(
                f"ContextParallel(attention={self.attention!r}): expected one of {', '.join(map(repr, _ATTENTION))}. "
                f"fix: attention='allgather' (gather keys/values) or attention='ring' (ring attention)"
            )
        if not isinstance(self.load_balance, bool):
            raise TypeError(f"ContextParallel(load_balance={self.load_balance!r}): expected a bool")
        if isinstance(self.axis, bool) or not isinstance(self.axis, (str, int)):
            raise TypeError(f"ContextParallel(axis={self.axis!r}): expected a mesh axis name or index")

    def axis_index(self, mesh: Any) -> int:
        """``axis`` as a mesh axis index (ValueError naming the axes for an unknown one)."""
        names = list(mesh.mesh_dim_names or [])
        if isinstance(self.axis, int):
            if not 0 <= self.axis < mesh.ndim:
                raise ValueError(f"ContextParallel(axis={self.axis}) is out of range for a {mesh.ndim}-D mesh. fix: an index "
                                 f"in [0, {mesh.ndim - 1}] or a mesh axis name {names}")
            return self.axis
        if self.axis not in names:
            raise ValueError(f"ContextParallel(axis={self.axis!r}) is not a mesh axis; mesh axes are {names}. fix: name one of them")
        return names.index(self.axis)

    def layout(self, mesh: Any) -> "CPLayout":
        return CPLayout(self.axis_index(mesh), self.attention, self.load_balance)

    def shard(self, tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
        """The local piece rank ``rank`` (its coordinate on the axis, of ``size``) holds of
        the global ``tensor`` split along ``dim``: what each rank feeds the step."""
        if not self.load_balance:
            return tensor.chunk(size, dim)[rank].clone()
        index = torch.tensor(head_tail_index(tensor.shape[dim], size, rank), device=tensor.device)
        return tensor.index_select(dim, index)


@dataclass(frozen=True)
class CPLayout:
    """The resolved option, as expansion sees it (``MeshContext.cp``): mesh axis index,
    attention method and whether the axis uses the head-tail layout."""

    axis: int
    attention: str = "allgather"
    load_balance: bool = True

    def head_tail(self, axis: int) -> bool:
        """Whether values split over mesh ``axis`` use the head-tail layout."""
        return self.load_balance and axis == self.axis


def head_tail_index(length: int, n: int, rank: int) -> list[int]:
    """The global positions rank ``rank`` of ``n`` holds, in local order, of a dim of
    ``length`` in the head-tail layout (ValueError unless ``2 n`` divides ``length``)."""
    if length % (2 * n):
        raise ValueError(
            f"a load-balanced context-parallel dim of size {length} over {n} ranks: expected a multiple of 2 x {n} = {2 * n} "
            f"(each rank holds two equal chunks). fix: pad the sequence to a multiple of {2 * n}, or "
            f"ContextParallel(load_balance=False)"
        )
    c = length // (2 * n)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * n - 1 - rank) * c, (2 * n - rank) * c))
