"""``compile(..., pipeline=..., dynamic=True)``: one symbolic program for every batch size.

A pipelined step is traced on one micro-batch, so its ``size_*`` inputs are the sizes of
a *micro-batch*: the call's batch size divided by ``Pipeline(chunks=m)`` (a tensor listed
in ``Pipeline(no_chunk=...)`` is passed whole and keeps its static size). The ranks agree on
the call's batch sizes as a non-pipelined step does (:mod:`spmd_compiler.driver.sizes`);
:class:`MicroBatchSizes` turns them into micro-batch sizes before the program's size
guards are evaluated. A batch that ``m`` does not divide breaks a guard: the step then
compiles anew, and the compile raises the usual ValueError on every rank (micro-batches
are equal, as without the option). With the batch split over another mesh axis (data
parallel inside each stage) every rank cuts its own shard into ``m``: each shard must
split evenly (then the micro-batch's shards are torch.chunk's layout of its global size,
the layout the program computes its local sizes with).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..driver.sizes import BatchSizes, ShardedDim, SizeProgram
from ..expand.chunks import chunk_sizes

__all__ = ["MicroBatchSizes", "MicroSizeProgram", "per_shape_reason", "size_reader"]


def per_shape_reason(backend: str, explain: bool) -> str | None:
    """Why a pipelined step compiles one program per batch shape under dynamic=True;
    None: it does not."""
    if backend == "inductor":
        return "a pipelined step with backend='inductor'"
    if explain:
        return "explain mode"
    return None


@dataclass
class MicroSizeProgram(SizeProgram):
    """A :class:`SizeProgram` fed micro-batch sizes: ``divisors[j]`` is ``chunks`` for a
    batch dim cut into micro-batches, 1 for one passed whole."""

    divisors: list[int] = dataclasses.field(default_factory=list)
    mesh_shape: tuple[int, ...] = ()

    def micro(self, sizes: list[int]) -> tuple[list[int], str | None]:
        """The micro-batch sizes of the call's global ``sizes`` of ``dims``, and why they
        do not split into equal micro-batches (None: they do)."""
        micro = [s // d for s, d in zip(sizes, self.divisors)]
        for sd, size, d in zip(self.dims, sizes, self.divisors):
            if size % d:
                return micro, f"{sd.path} has {size} rows, which do not split into {d} equal micro-batches"
            if sd.axis is not None and d > 1:  # each rank cuts its own shard: every shard must split evenly
                shards = chunk_sizes(size, self.mesh_shape[sd.axis])
                if any(c % d for c in shards):
                    return micro, (f"{sd.path}'s {size} rows are held as shards of {shards} rows over mesh axis "
                                   f"{sd.axis}, which do not all split into {d} equal micro-batches")
        return micro, None

    def values(self, sizes: list[int]) -> tuple[list[int], str | None]:
        micro, broken = self.micro(sizes)
        if broken is not None:
            return [micro[j] for j in self.inputs], broken
        return super().values(micro)


class MicroBatchSizes(BatchSizes):
    """The batch-size agreement of a pipelined step: programs read micro-batch sizes."""

    def __init__(self, mesh: Any, plan: Any, exchanged: bool, *, chunks: int, no_chunk: tuple[str, ...]) -> None:
        super().__init__(mesh, plan, exchanged)
        self.chunks = chunks
        self.no_chunk = no_chunk

    def dims(self, batch: tuple, kwargs: dict) -> list[ShardedDim] | None:
        """The batch dims whose sizes vary: not those of tensors passed whole
        (``no_chunk``: class weights, masks), whose sizes stay in the call signature."""
        dims = super().dims(batch, kwargs)
        return None if dims is None else [sd for sd in dims if sd.path not in self.no_chunk]

    def divisors(self, dims: list[ShardedDim]) -> list[int]:
        return [1 if sd.path in self.no_chunk or sd.dim != 0 else self.chunks for sd in dims]

    def describe(self, step: Any, dims: list[ShardedDim]) -> SizeProgram | None:
        program = super().describe(step, dims)
        if program is None:
            return None
        fields = {f.name: getattr(program, f.name) for f in dataclasses.fields(SizeProgram) if f.init}
        return MicroSizeProgram(**fields, divisors=self.divisors(dims), mesh_shape=self.mesh_shape)

    def step_values(self, step: Any, dims: list[ShardedDim], everyone: list[Any]) -> list[int]:
        # the whole-batch sizes of ``dims`` in the step's symbol order, as micro-batch sizes
        d = self.divisors(dims)
        position = _position(step, dims)
        return [v // d[position(s)] for v, s in zip(super().step_values(step, dims, everyone), step.size_symbols)]


def _position(step: Any, dims: list[ShardedDim]) -> Any:
    where = {(sd.leaf, sd.dim): j for j, sd in enumerate(dims)}
    inputs = step.traced.inputs
    return lambda s: where[(inputs[s.index].index, s.dim)]


def size_reader(step: Any, feed: list[int]) -> Any:
    """``size_of(dim, mb)`` for a symbolic stage program fed the micro-batch sizes ``feed``
    (in ``step.size_symbols`` order): the int a dim (int or SymInt) takes on this rank."""
    from ..dump.sizes import SizeContext

    ctx = SizeContext(step, feed)
    return lambda dim, mb: ctx.value(dim)
