"""Every step, every rank runs the same program: the step guard.

Each rank picks a program by its *local* call signature, and only that rank knows it
changed: with a last batch of 7 rows split 4/3, rank 1's shapes change and rank 0's do
not. If rank 1 recompiled (entering the compile's collectives) while rank 0 ran the old
program (entering the step's), both would wait forever, and two ranks in different cached
programs would train silently wrong.

So the choice is made together. Every rank holds the program all ranks agreed on last.
A step starts a one-element ``all_reduce(MAX)`` of "my signature differs from the agreed
one" (0 or 1) on a CPU group, without waiting; the program runs until just before its
first collective, first write to state or first random op, and waits there (the flag's
round trip hides behind that compute). If any rank raised the flag, every rank stops
there, nothing having changed, and they agree on a program anew
(:meth:`StepDriver._agree_program`: exchange signatures, compile together or reuse a
cached program). A rank whose signature changed raises the flag and goes straight there.

On gloo, a program whose first collective is a suitable ``all_reduce`` carries the flag
in that collective instead, with no extra round trip (:mod:`.fold`); on a mesh of several
axes the first collective of each axis group does; :meth:`StepGuard.start` is then given
its :class:`~.fold.FoldPoint` or :class:`~.fold.FoldChain`. Either check also compares
a digest of the batch tensors that ranks of a mesh axis must share (Replicate on it:
:mod:`.batch_digest`).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..expand.rules.random import is_random
from .batch_digest import slots_agree
from .rng import RngSync

__all__ = ["Resync", "GuardError", "StepGuard", "first_effect"]

log = logging.getLogger(__name__)


class Resync(Exception):
    """Some rank's call signature differs from the agreed program's: agree anew."""


class GuardError(RuntimeError):
    """The flag exchange itself failed (a peer died or timed out); ``where`` says which
    collective carried it."""

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.where = where


def _is_effect(node: fx.Node) -> bool:
    if is_random(node):
        return True  # advances the RNG
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    return t.namespace == "_c10d_functional" or t._schema.is_mutable  # a collective, or a write


def first_effect(gm: fx.GraphModule) -> fx.Node | None:
    """The first node of ``gm`` after which running it cannot be undone: a collective,
    a write, or a random op (None if it has none)."""
    return next((n for n in gm.graph.nodes if _is_effect(n)), None)


class _Pending:
    """The check of one step: wait for the exchange, then resync or go on (drawing from
    rank 0's generator if the ranks' generators differ); :meth:`finish` after the step."""

    def __init__(self, flag: torch.Tensor, work: Any, rng: RngSync | None = None, sizes: int = 0, ids: list[int] | None = None,
                 values: int = 0) -> None:
        self.flag, self.work, self.rng = flag, work, rng
        self.ids = ids  # the program id elements this rank sent: every rank must have sent the same
        self.own: Any = None
        self.n_sizes = sizes
        self.n_values = values  # the batch digest slots (.batch_digest), after the generators' fingerprint
        self.sizes: list[int] | None = None  # every rank's size slots, after the wait (:mod:`.sizes`)

    def __call__(self) -> None:
        """Wait for the flag; raise :class:`Resync` if any rank raised it."""
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as e:
                raise GuardError(str(e)) from e
        values = self.flag.tolist()
        if values[0] or values[1:3] != self.ids:  # a rank changed, or runs another program
            raise Resync()
        if self.n_values:
            at = 5 if self.rng is not None else 3
            if not slots_agree(values[at:at + self.n_values]):
                raise Resync("ranks of a mesh axis passed different values for a Replicate batch tensor")
        if self.n_sizes:
            self.sizes = values[len(values) - self.n_sizes :]
        if self.rng is not None and not self.rng.agree(values[3:5]):
            self.own = self.rng.adopt_rank0()

    def finish(self) -> None:
        if self.rng is not None:
            self.rng.restore(self.own)


class _NoCheck:
    def __call__(self) -> None:
        return None

    def finish(self) -> None:
        return None


_no_check = _NoCheck()


class _CheckNow:
    """The compile path's check: a synchronous generator agreement (no guard exchange
    ran), for programs that draw."""

    def __init__(self, rng: RngSync) -> None:
        self.rng, self.own = rng, None

    def __call__(self) -> None:
        self.own = self.rng.check_now()

    def finish(self) -> None:
        self.rng.restore(self.own)


class StepGuard:
    """The per-step flag exchange over every rank of a mesh (a CPU group: for NCCL a
    gloo group beside it, so the check never synchronizes with the GPU)."""

    def __init__(self, mesh: Any, timeout: float | None = None) -> None:
        self.group: Any = None
        self.rng: RngSync | None = None
        self._gloo = False
        if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
            return
        ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
        if ranks != list(range(dist.get_world_size())):
            log.warning("the mesh covers ranks %s of a world of %d: no per-step agreement check", ranks, dist.get_world_size())
            return
        if dist.get_backend() == "gloo":
            self.group, self._gloo = dist.group.WORLD, True
        else:  # made by every rank together: the guard is built on the first call, which every rank makes
            kw = {"timeout": timedelta(seconds=timeout)} if timeout else {}
            self.group = dist.new_group(backend="gloo", **kw)
        self.rng = RngSync(self.group, cuda=mesh.device_type == "cuda")

    @property
    def can_fold(self) -> bool:
        """Whether the check may ride on a collective of the program (:mod:`.fold`): on
        gloo only (reading a flag that came through NCCL would synchronize the GPU)."""
        return self.group is not None and self._gloo

    def start(self, changed: bool, fold: Any = None, draws: bool = False, sizes: list[int] | None = None, program: int = 0,
              ids: int = 1, values: list[int] | None = None, leaves: list | None = None) -> Any:
        """Start the flag exchange; returns the check to call before the first effect
        (and whose ``finish()`` to call after the step).

        With ``fold`` (the agreed program's :class:`~.fold.FoldPoint`, or
        :class:`~.fold.FoldChain` on a mesh of several axes) the program checks
        itself: a changed rank joins that one collective (each of the chain's) naming the
        cached ``program`` it means to run (0: none) and raises Resync unless every rank
        named it (then it returns, the ranks agreed on it); the others get a check that
        does nothing. For a program that ``draws`` random numbers the
        exchange carries the generators' fingerprint too (:mod:`.rng`); such programs
        are never given a ``fold``. ``sizes``: this rank's size slots (:mod:`.sizes`,
        zeros but its own; the MAX hands every rank every rank's local sizes), read back
        as the check's ``sizes`` after its wait. The standalone exchange also carries
        ``program``, the id (1 to ``ids``) of the cached program this rank runs, as
        ``(id, ids - id)`` under the MAX: the check passes only if every rank sent the
        same id (a rank may run another cached program than the agreed one, its own
        check then tells whether every rank did). ``values``: this rank's batch digest
        slots (:func:`.batch_digest.standalone_slots`): the check raises Resync unless the
        ranks of each axis group sent the same digest; ``leaves``: this rank's batch
        leaves, whose digest a changed rank sends in the folded collectives it joins."""
        if fold is not None and self.group is not None:
            if changed:
                fold.join(program=program, leaves=leaves)
            return _no_check
        if self.group is None:
            if changed:
                raise Resync()
            return _no_check
        rng = self.rng if draws else None
        mine = [0, ids] if changed else [program, ids - program]
        flag = torch.tensor([1 if changed else 0, *mine] + (rng.fingerprint() if rng else []) + list(values or []) + list(sizes or []),
                            dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return _Pending(flag, work, rng, len(sizes or []), mine, len(values or []))

    def agreed(self, draws: bool) -> Any:
        """The check of a step whose program every rank has just agreed on (no flag to
        exchange); for a program that draws, the generators are agreed synchronously."""
        return _CheckNow(self.rng) if draws and self.rng is not None else _no_check
