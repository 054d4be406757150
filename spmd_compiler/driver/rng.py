"""Every rank draws from one generator state, so a step's random numbers agree.

The RNG contract (docs/randomness.md) needs every rank's generator in the same state
when a step draws: a Replicate value's numbers are drawn on every rank, and the exact
mode's shards are slices of one global draw. Ranks seeded alike stay alike, since every
rank draws exactly the same amounts in the step. Ranks seeded differently
(``torch.manual_seed(seed + rank)``, common for data augmentation) are found at every
step that draws: a fingerprint of each rank's generators rides in the step guard's
exchange (:mod:`.guard`). When they differ, the step draws from rank 0's state
(broadcast), and every other rank's generators are put back afterwards where they were,
so their own streams (augmentation) are untouched; rank 0's advance as one device's do.
"""

from __future__ import annotations

import ctypes
import logging
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..expand.rules.random import is_random

__all__ = ["draws", "RngSync", "AxesRngSync"]

log = logging.getLogger(__name__)


def draws(gm: fx.GraphModule) -> bool:
    """The program draws random numbers."""
    return any(is_random(n) for n in gm.graph.nodes)


def _states(cuda: bool) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if cuda:
        states.append(torch.cuda.get_rng_state())  # a CPU byte tensor (seed and offset)
    return states


def _set_states(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


class RngSync:
    """The generator agreement of one mesh, over the guard's CPU ``group``."""

    def __init__(self, group: Any, cuda: bool) -> None:
        self.group = group
        self.cuda = cuda
        self.warned = False
        self.adopted = 0  # steps that drew from rank 0's state

    def fingerprint(self) -> list[int]:
        """``[h, -h]`` for a 31-bit hash ``h`` of this rank's generator states: after an
        all_reduce(MAX), ``max(h) + max(-h)`` is 0 exactly when every rank's ``h`` is equal."""
        h = 0
        for s in _states(self.cuda):
            s = s.contiguous()  # CPU byte tensors; read without numpy (not a dependency)
            h = zlib.crc32(ctypes.string_at(s.data_ptr(), s.numel() * s.element_size()), h)
        h &= 0x7FFFFFFF
        return [h, -h]

    @staticmethod
    def agree(reduced: list[int]) -> bool:
        return reduced[0] + reduced[1] == 0

    def adopt_rank0(self) -> list[torch.Tensor]:
        """Every rank together: set this rank's generators to rank 0's; returns this
        rank's own states, for :meth:`restore` after the step."""
        own = _states(self.cuda)
        shared = [s.clone() for s in own]
        for s in shared:
            dist.broadcast(s, src=0, group=self.group)  # the guard's group spans the world: rank 0 is rank 0
        _set_states(shared)
        self.adopted += 1
        if not self.warned:
            self.warned = True
            log.warning(
                "the ranks' random generators are in different states (seeded per rank?): this step and the next "
                "ones like it draw from rank 0's generator, so values the plan calls Replicate get one set of random "
                "numbers; the other ranks' generators are put back after each step. Seed every rank alike "
                "(torch.manual_seed(seed)) to skip the broadcast"
            )
        return own

    def restore(self, own: list[torch.Tensor] | None) -> None:
        """After the step: ranks other than 0 get their own generators back."""
        if own is not None and dist.get_rank() != 0:
            _set_states(own)

    def check_now(self) -> list[torch.Tensor] | None:
        """A synchronous agreement (the compile path, which has no guard exchange);
        returns what :meth:`restore` needs (None when the ranks agree)."""
        t = torch.tensor(self.fingerprint(), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return None if self.agree(t.tolist()) else self.adopt_rank0()


class AxesRngSync(RngSync):
    """The generator agreement among the ranks of a sub-mesh, given as the process groups
    of its axes (a pipeline stage's ranks: every mesh axis but the pipeline one).

    The fingerprint is all_reduced axis by axis (the MAX of MAXes over every line of a
    grid is the grid's MAX); when it differs, the generators are broadcast axis by axis
    from each axis's first rank, so every rank ends with the state of the sub-mesh's
    first rank (coordinate 0 on every axis), which is the one that advances; the others
    get theirs back (:meth:`restore`)."""

    def __init__(self, groups: list[Any], cuda: bool) -> None:
        super().__init__(None, cuda)
        self.groups = list(groups)
        self.root = all(dist.get_group_rank(g, dist.get_rank()) == 0 for g in self.groups)

    def check_now(self) -> list[torch.Tensor] | None:
        t = torch.tensor(self.fingerprint(), dtype=torch.int64)
        for g in self.groups:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        return None if self.agree(t.tolist()) else self.adopt_rank0()

    def adopt_rank0(self) -> list[torch.Tensor]:
        """Every rank of the sub-mesh together: set this rank's generators to its first
        rank's; returns this rank's own states, for :meth:`restore`."""
        own = _states(self.cuda)
        shared = [s.clone() for s in own]
        for g in self.groups:
            for s in shared:
                dist.broadcast(s, src=dist.get_global_rank(g, 0), group=g)
        _set_states(shared)
        self.adopted += 1
        if not self.warned:
            self.warned = True
            log.warning(
                "the random generators of one pipeline stage's ranks are in different states (seeded per rank?): "
                "this step and the next ones like it draw from the stage's first rank's generator, so the stage's "
                "ranks draw one set of random numbers; the other ranks' generators are put back after each step. "
                "Seed every rank alike (torch.manual_seed(seed)) to skip the broadcast"
            )
        return own

    def restore(self, own: list[torch.Tensor] | None) -> None:
        if own is not None and not self.root:
            _set_states(own)
