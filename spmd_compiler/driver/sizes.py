"""``compile(..., dynamic=True)`` across processes: the ranks agree on the global batch sizes.

A symbolic program (docs/dynamic_shapes.md) takes the *global* size of every symbolic
batch dim (dim 0, the batch size: :func:`sharded_dims`) as a ``size_*`` input, but each rank holds only its own rows. The sizes ride in
the step guard's exchange (:mod:`.guard`): the flag tensor gets one slot per (rank,
sharded batch dim); each rank writes its local size in its own slots and zeros elsewhere,
so the guard's ``all_reduce(MAX)`` hands every rank every rank's local size (sizes are
never negative, and every slot has one writer) in the same collective, with no extra
round trip. Every rank then

* sums them per mesh axis (:func:`global_sizes`) and checks that the rows are laid out
  as torch.chunk cuts them (the layout the program computes its local sizes with): a
  batch split otherwise raises ValueError on every rank, naming each rank's rows;
* evaluates the program's size guards (:class:`~spmd_compiler.expand.symbolic.SizeGuards`)
  of *every* rank, gathered once at compile, on those global sizes: every rank gets the
  same answer, so all reuse the program or all compile again together.

A symbolic program waits for the exchange before it starts (it needs the sizes), so it
never carries the check in its first all_reduce (:mod:`.fold`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import _private_torch as pt
from ..expand.chunks import chunk_sizes
from ..trace.tracer import flatten_batch
from .agreement import exchange
from .batch import batch_placements, sharded_batch_dims, signature
from .guard import Resync

__all__ = ["ShardedDim", "sharded_dims", "global_sizes", "SizeProgram", "BatchSizes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardedDim:
    """Dim ``dim`` of batch leaf ``leaf`` (path ``path``), split over mesh axis ``axis``
    (None: the batch size of a leaf sharded along another dim, the same on every rank)."""

    leaf: int
    dim: int
    axis: int | None
    path: str


def sharded_dims(plan: Any, batch: tuple, kwargs: dict, ndim: int) -> list[ShardedDim] | None:
    """The batch dims a symbolic program reads sizes of (those
    ``sharded_batch_dims(dynamic=True)`` traces as symbols: dim 0), in leaf order; None
    when one is split over more than one mesh axis (nested splits have no symbolic form
    across processes yet). Another sharded dim (a sequence split by ``Shard(1)``) is
    static in the program: its local size stays in the call's signature, so a new one
    compiles again on every rank, as with ``dynamic=False``."""
    leaves, _, paths = flatten_batch(batch, kwargs)
    placements = batch_placements(plan, paths, leaves, ndim)
    out = []
    for i, dims in sharded_batch_dims(plan, batch, kwargs, ndim, dynamic=True).items():
        pl = placements[i]
        for d in dims:
            axes = [a for a, p in enumerate(pl) if isinstance(p, pt.Shard) and p.dim == d]
            if len(axes) > 1 or (axes and isinstance(pl[axes[0]], pt.StridedShard)):
                return None
            out.append(ShardedDim(i, d, axes[0] if axes else None, paths[i]))
    return out


def global_sizes(dims: list[ShardedDim], everyone: list[tuple[tuple[int, ...], list[int]]], mesh_shape: tuple[int, ...]) -> list[int]:
    """The global size of every dim in ``dims`` from every rank's ``(mesh coordinate,
    local sizes)`` (indexed by rank): the sum over the ranks of the dim's mesh axis.

    Raises ValueError unless each rank holds torch.chunk's piece (rank ``i`` of ``n``:
    ``max(0, min(c, s - i*c))`` rows, ``c = ceil(s/n)``) and every group of the axis
    holds the same global size. The same on every rank (it reads only ``everyone``)."""
    out = []
    for j, sd in enumerate(dims):
        if sd.axis is None:  # not split: every rank holds the whole dim
            held = {int(local[j]) for _, local in everyone}
            if len(held) > 1:
                raise ValueError(
                    f"dynamic=True: {sd.path} has sizes {sorted(held)} in dim {sd.dim} on different ranks; the plan does not "
                    f"split that dim, so every rank must hold all of it. fix: give every rank the same batch size"
                )
            out.append(held.pop())
            continue
        n = mesh_shape[sd.axis]
        groups: dict[tuple, dict[int, tuple[int, int]]] = {}
        for rank, (coord, local) in enumerate(everyone):
            rest = tuple(c for a, c in enumerate(coord) if a != sd.axis)
            groups.setdefault(rest, {})[coord[sd.axis]] = (rank, int(local[j]))
        totals = set()
        for members in groups.values():
            held = [members[i] for i in sorted(members)]
            total = sum(size for _, size in held)
            if [size for _, size in held] != chunk_sizes(total, n):
                have = ", ".join(f"rank {r}: {size}" for r, size in held)
                raise ValueError(
                    f"dynamic=True: {sd.path} holds {have} rows of dim {sd.dim} (global {total}), but the program reads "
                    f"a global size of {total} split as {chunk_sizes(total, n)} over mesh axis {sd.axis} (torch.chunk's "
                    f"layout); the ranks would compute on rows that are not there. fix: give the rank at coordinate i "
                    f"rows [i*c, min((i+1)*c, s)) with c = ceil(s/{n}), as x.chunk({n})[i] does (empty when past the end)"
                )
            totals.add(total)
        if len(totals) > 1:
            raise ValueError(
                f"dynamic=True: {sd.path} dim {sd.dim} adds up to different global sizes {sorted(totals)} on the "
                f"groups of mesh axis {sd.axis}; ranks that differ only in other axes must hold the same rows. fix: give "
                f"them the same batch"
            )
        out.append(totals.pop())
    return out


@dataclass
class SizeProgram:
    """What a symbolic program needs at each call: the sharded dims (the slots of the
    exchange), which of them feeds each ``size_*`` input, and every rank's size guards."""

    dims: list[ShardedDim]
    inputs: list[int]  # per size symbol of the program: its position in ``dims``
    symbols: list[Any]  # the size symbols, in ``size_*`` input order
    aliases: list[tuple[str, int, int]]  # per batch dim that reads a symbol: (label, dim position, symbol position)
    guards: list[Any] = field(default_factory=list)  # every rank's SizeGuards
    _checks: list[Any] | None = field(default=None, init=False, repr=False)

    def checks(self) -> list[Any]:
        """Every rank's size guards as compiled checks (:mod:`~spmd_compiler.expand.size_checks`),
        each distinct condition once (most are the same on every rank), in rank order."""
        if self._checks is None:
            seen: dict[Any, Any] = {}
            for g in self.guards:
                for c in g.checks():
                    seen.setdefault(c.bound, c)
            self._checks = list(seen.values())
        return self._checks

    def values(self, sizes: list[int]) -> tuple[list[int], str | None]:
        """The ``size_*`` inputs for the global ``sizes`` of ``dims``, and the first broken
        guard (text) or None when the program serves them."""
        feed = [sizes[j] for j in self.inputs]
        for label, j, s in self.aliases:
            if sizes[j] != feed[s]:
                return feed, f"{label} dim {self.dims[j].dim} has {sizes[j]} rows but another batch dim has {feed[s]} (compiled as one size)"
        values = dict(zip(self.symbols, feed))
        for check in self.checks():
            broken = check.broken(values)
            if broken is not None:
                return feed, f"batch sizes {dict((str(k), v) for k, v in values.items())} break a size guard: {broken}"
        return feed, None


def _positions(step: Any, dims: list[ShardedDim]) -> Any:
    """``position(size symbol of step)``: the index in ``dims`` of the batch dim it reads."""
    where = {(sd.leaf, sd.dim): j for j, sd in enumerate(dims)}
    inputs = step.traced.inputs
    return lambda s: where[(inputs[s.index].index, s.dim)]


class _Waited:
    """A step check that already waited (a symbolic program needs the sizes first)."""

    def __init__(self, check: Any) -> None:
        self.check = check

    def __call__(self) -> None:
        return None

    def finish(self) -> None:
        self.check.finish()


class BatchSizes:
    """The dynamic-size side of a :class:`~.step.StepDriver` over ``mesh``."""

    def __init__(self, mesh: Any, plan: Any, exchanged: bool) -> None:
        self.mesh_shape = tuple(mesh.shape)
        self.plan = plan
        self.exchanged = exchanged  # the guard's group spans the world: sizes can ride in it
        self.coordinate = tuple(mesh.get_coordinate())
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.coords: list[tuple[int, ...]] = [()] * self.world  # mesh coordinate of every rank
        for idx in torch.cartesian_prod(*[torch.arange(s) for s in self.mesh_shape]).reshape(-1, len(self.mesh_shape)).tolist():
            self.coords[int(mesh.mesh[tuple(idx)])] = tuple(idx)
        self._dims: dict[Any, list[ShardedDim] | None] = {}
        self._serial = 0  # numbers the symbolic programs (the same sequence on every rank)

    @classmethod
    def over(cls, mesh: Any, plan: Any, exchanged: bool) -> "BatchSizes | None":
        """The sizes of a step whose check runs over the whole world (``exchanged``; one
        process and the fake group exchange nothing); None, after one INFO line, when
        the check does not span the world (the sizes cannot ride in it)."""
        if not exchanged and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
            log.info("dynamic batch sizes: the mesh does not span the world, so the ranks cannot agree on batch sizes in "
                     "the step check; compiling one program per batch shape")
            return None
        return cls(mesh, plan, exchanged)

    def dims(self, batch: tuple, kwargs: dict) -> list[ShardedDim] | None:
        leaves, spec, paths = flatten_batch(batch, kwargs)
        k = (str(spec), tuple((p, getattr(x, "ndim", None)) for p, x in zip(paths, leaves)))
        if k not in self._dims:
            self._dims[k] = sharded_dims(self.plan, batch, kwargs, len(self.mesh_shape))
        return self._dims[k]

    def options(self, options: Any, batch: tuple, kwargs: dict) -> Any:
        """The compile options for this call: ``dynamic=False`` (one INFO line) when a
        batch dim is split over several mesh axes, whose sizes cannot ride in the check yet."""
        if not options.dynamic or self.dims(batch, kwargs) is not None:
            return options
        log.info("dynamic=True: a batch dim is split over more than one mesh axis; compiling one program per batch shape")
        return dataclasses.replace(options, dynamic=False)

    def free_key(self, state: Any, batch: tuple, kwargs: dict) -> Any:
        """The call signature without the sharded sizes (what selects a symbolic program)."""
        dims = self.dims(batch, kwargs) or []
        free: dict[int, tuple[int, ...]] = {}
        for sd in dims:
            free[sd.leaf] = (*free.get(sd.leaf, ()), sd.dim)
        return signature(state, batch, kwargs, free_dims=free)

    def local(self, batch: tuple, kwargs: dict, dims: list[ShardedDim] | None = None) -> tuple[tuple[int, ...], list[int]]:
        """This rank's coordinate and local sizes of ``dims`` (default: the call's)."""
        leaves, _, _ = flatten_batch(batch, kwargs)
        dims = self.dims(batch, kwargs) if dims is None else dims
        return self.coordinate, [int(leaves[sd.leaf].shape[sd.dim]) for sd in dims or []]

    def slots(self, program: Any, batch: tuple, kwargs: dict, same: bool) -> list[int]:
        """This rank's part of the guard's exchange: its local sizes at its own slots."""
        n = len(program.dims)
        out = [0] * (n * self.world)
        if same:  # a rank whose signature changed raises the flag; its sizes are not read
            out[self.rank * n : (self.rank + 1) * n] = self.local(batch, kwargs, program.dims)[1]
        return out

    def everyone(self, program: Any, reduced: list[int] | None, mine: list[int]) -> list[tuple[tuple[int, ...], list[int]]]:
        """Every rank's (coordinate, local sizes) from the reduced slots."""
        if reduced is None:  # one process, or the fake group: even shards assumed, as global_batch does
            # (the mesh's ranks only: a fake group's world may be larger than the mesh)
            return [(c, list(mine)) for c in self.coords if len(c) == len(self.mesh_shape)]
        n = len(program.dims)
        return [(self.coords[r], list(reduced[r * n : (r + 1) * n])) for r in range(self.world)]

    def wait(self, program: Any, check: Any, batch: tuple, kwargs: dict) -> tuple[list[int], Any]:
        """Wait for the step's exchange; the ``size_*`` inputs and the check to run the
        program with. Raises Resync (every rank) when the sizes break a guard, ValueError
        (every rank) when the batch is not laid out as torch.chunk cuts it."""
        try:
            check()  # raises Resync when a rank's signature changed
            mine = self.local(batch, kwargs, program.dims)[1]
            everyone = self.everyone(program, getattr(check, "sizes", None), mine)
            feed, broken = program.values(global_sizes(program.dims, everyone, self.mesh_shape))
            if broken is not None:
                raise Resync(broken)
        except BaseException:
            check.finish()
            raise
        return feed, _Waited(check)

    def describe(self, step: Any, dims: list[ShardedDim]) -> SizeProgram | None:
        """The SizeProgram of a compiled ``step`` (None unless it is symbolic). Every rank
        together (it gathers every rank's size guards, once per compile)."""
        if not step.size_symbols:
            return None
        position = _positions(step, dims)
        symbols = [s.symbol for s in step.size_symbols]
        aliases = [(a.label, position(a), symbols.index(a.symbol)) for a in step.size_guards.aliases if a.symbol in symbols]
        guards = exchange(step.size_guards) if self.exchanged else [step.size_guards]
        return SizeProgram(dims, [position(s) for s in step.size_symbols], symbols, aliases, list(guards))

    def call_values(self, batch: tuple, kwargs: dict, everyone: list[Any] | None) -> Any:
        """``f(step)``: the global sizes of this call in the order of ``step.size_symbols``
        (the ``size_*`` inputs a symbolic step is fed; None for another step or unknown
        sizes), from ``everyone``, every rank's local sizes exchanged to agree on the program."""
        dims = self.dims(batch, kwargs)
        return lambda step: self.step_values(step, dims, everyone) if step.size_symbols and everyone and dims is not None else None

    def step_values(self, step: Any, dims: list[ShardedDim], everyone: list[Any]) -> list[int]:
        """The global sizes a symbolic ``step`` is fed for a call (in ``step.size_symbols``
        order) from every rank's ``(coordinate, local sizes)`` of ``dims`` (the exchange
        that agrees on the program; one process and the fake group: this rank's sizes on
        every rank). Raises ValueError as :func:`global_sizes` does."""
        if not self.exchanged:
            everyone = self.everyone(None, None, everyone[0][1])
        sizes = global_sizes(dims, everyone, self.mesh_shape)
        position = _positions(step, dims)
        return [sizes[position(s)] for s in step.size_symbols]

    def pick(self, programs: Any, free: tuple, everyone: list[Any]) -> tuple[Any, list[int], str | None]:
        """The key in ``programs`` (the step's compile cache, least recently used first) of
        the symbolic program for the free signatures ``free`` whose size guards hold for
        every rank's sizes (``everyone``: each rank's ``(coordinate, local sizes)``), most
        recently used first, its ``size_*`` inputs, and None; else None, [] and why the most
        recent one does not serve them (None: there is none). The same on every rank: all
        ranks hold the same cache and evaluate the same guards on the same global sizes."""
        reason = None
        for k in reversed(programs):
            if isinstance(k, tuple) and len(k) == 3 and k[0] == "sizes" and k[1] == free:
                feed, broken = self.agreed_values(programs[k].sizes, everyone)
                if broken is None:
                    return k, feed, None
                reason = reason or broken
        return None, [], reason

    def new_key(self, programs: Any, free: tuple, reason: str | None) -> tuple:
        """The cache key of a new symbolic program for the free signatures ``free``: it is kept
        beside the others for them (a step that branches on a size has one per side; the
        cache's size bounds them all, least recently used evicted)."""
        self._serial += 1
        others = sum(isinstance(k, tuple) and len(k) == 3 and k[0] == "sizes" and k[1] == free for k in programs)
        if others:
            log.info("a symbolic program for these batch shapes is kept beside %d other(s) whose size guards do not hold "
                     "(%s); each call runs the first, most recently used first, whose guards hold", others, reason)
        return ("sizes", free, self._serial)

    def global_of(self, dims: list[ShardedDim], everyone: list[Any]) -> list[int]:
        """The global sizes of ``dims`` from the agreement's exchange (each rank's
        ``(coordinate, local sizes)``; one process and the fake group: this rank's on every
        rank). Raises ValueError as :func:`global_sizes` does."""
        if not self.exchanged:
            everyone = self.everyone(None, None, everyone[0][1])
        return global_sizes(dims, everyone, self.mesh_shape)

    def agreed_values(self, program: Any, everyone: list[Any]) -> tuple[list[int], str | None]:
        """The ``size_*`` inputs from the agreement's exchange (each rank's
        ``(coordinate, local sizes)``), and the first broken guard or None."""
        if not self.exchanged:
            everyone = self.everyone(program, None, everyone[0][1])
        return program.values(global_sizes(program.dims, everyone, self.mesh_shape))
