"""The Plan dataclass: the user's description of where everything lives on the mesh."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.tensor import Placement

from .context import ContextParallel, CPLayout
from .placements import ResolvedPlan
from .resolve import _batch_placements, _resolve

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """Placements for a training step.

    Attributes:
        params: FQN glob pattern (``"layers.*.w1.weight"``; ``*`` also matches dots) to
            placements, for parameters and buffers. An exact FQN beats a pattern; among
            patterns the first listed wins. A pattern (and ``default_param``) shards only
            what can be split: on a tensor without the dim it names (a 0-d buffer such as
            BatchNorm's ``num_batches_tracked``) it gives Replicate on that mesh axis
            (logged at DEBUG); an exact FQN entry that does so is a ValueError, as is a
            pattern whose dim none of the tensors it matches has. A value may instead be a ParallelStyle
            (``ColwiseParallel()``, ``RowwiseParallel()``, ``SequenceParallel()``) keyed
            by module FQN pattern, meaning what it means in ``parallelize_module``,
            applied on mesh axis ``style_axis``.
        inputs: placements for the batch leaves, by leaf index (a list) or by path
            (``{"batch[0]": ...}``). Missing leaves get ``default_input``.
        default_param: placements for unmatched parameters and buffers (Replicate).
        default_input: placements for batch leaves (Shard(0) on the first mesh axis,
            Replicate on the others).
        style_axis: mesh axis name or index the ParallelStyles apply to (default: the
            axis named "tp", else the last axis).
        strict: raise when a pattern matches no parameter or buffer.
        fsdp_axes: mesh axes (names or indices) with FSDP semantics: a parameter sharded
            on one of them is stored sharded but all-gathered (Replicate on that axis)
            before its use in forward and again in backward, and its gradient is
            reduce-scattered into the shard, as ``fully_shard`` does. Without it a sharded
            parameter is an operand like any other: it stays sharded for compute and
            DTensor redistributes the other operands to match it, so on an axis where the
            batch is split along dim 0 the batch and activations are gathered instead of
            the parameters. That is exact but rarely what is meant, and the compile logs
            one WARNING naming the axis, the bytes and this option (FSDP:
            ``Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",))``). On these axes a
            pattern or ``default_param`` shards parameters only, as ``fully_shard``:
            the buffers it matches (BatchNorm statistics, masks, rotary frequencies)
            are Replicate there; an exact FQN entry shards a buffer as it says: stored
            sharded and gathered for use like a parameter (once per phase), or, when the
            step writes it in place (BatchNorm's running statistics), kept a sharded
            operand that each rank updates on its own slice.
        reshard_after_forward: under ``fsdp_axes``, what ``fully_shard``'s option of the
            same name does (and its default). ``True``: the full parameter gathered for
            forward is dropped after its last forward use and gathered again for backward
            (the views of it that autograd saved, such as ``t(weight)``, are taken again
            from the backward gather), so between a unit's forward and its backward only
            its shard is resident: one more all_gather per parameter per step, less
            memory. ``False``: backward reuses the forward's gather, which stays resident
            from its forward use to its last backward use.
        activation_sharding: how an op's strategy is chosen among DTensor's candidates.
            ``"follow"`` (default): an op's result is sharded on a mesh axis only where
            one of its inputs already is, so shards start at the plan and propagate (a
            Megatron plan then communicates exactly as Megatron does, in backward too).
            ``"greedy"``: DTensor's cheapest strategy for each op on its own, which may
            start new shards (sequence-parallel-like splits) that later ops pay to undo.
        defer_grad_sync: gradient accumulation over calls without a reduction per call,
            as DDP's ``no_sync()`` and FSDP2's ``set_requires_gradient_sync(False)``. A
            call that leaves gradients set (no ``zero_grad()``) stores them unreduced:
            ``p.grad`` is a DTensor ``Partial`` on the data axes (the mesh axes on which
            the plan splits a batch input, and ``fsdp_axes``), the parameter's
            placements on the others; its value is still the global sum
            (``p.grad.full_tensor()`` reduces), its local tensor the rank's own part
            (full size under FSDP, where the parameter is a shard). The next call adds
            into it locally, and the call that runs ``optimizer.step()`` reduces it
            there, in buckets: one reduction per accumulation window instead of one per
            call. The sum is reassociated (per rank over calls, then over ranks): equal
            to one device within rounding, not bit for bit. Default False: every call
            reduces its gradients and ``p.grad`` holds what one device holds.
        expert_axes: mesh axes of expert parallelism that are also ``fsdp_axes`` (torchtitan
            and DeepSpeed fold expert parallelism into the data axis). A stacked expert
            weight (``(experts, ...)``, read by the experts' grouped matmul) split along
            its expert dim on such an axis is not gathered for compute: each rank keeps
            its experts and the routed token rows travel to them (docs/moe.md). On a mesh
            axis that is no FSDP axis a split expert dim is expert parallelism without this.
        expert_capacity: under expert parallelism, the rows each rank can receive for its
            experts, as a multiple of its own routed rows (tokens x top-k). ``None`` (the
            default): the mesh axis size, every rank's rows at once, so no routing can
            exceed it; the received rows are padded to it, and elementwise expert work
            and activation memory grow with it. A smaller factor (``1.25``-``2.0`` for a
            balanced router) trims both; a step whose routing sends a rank more rows stops
            on every rank of the group with ``ExpertCapacityError`` naming the factor it
            needed, never dropping a token (each MoE layer then makes one small
            all_reduce of the largest receive count).
    """

    params: Mapping[str, Any] = field(default_factory=dict)
    inputs: Sequence[Any] | Mapping[str, Any] | None = None
    default_param: Any = None
    default_input: Any = None
    style_axis: str | int | None = None
    strict: bool = True
    fsdp_axes: Sequence[str | int] = ()
    activation_sharding: str = "follow"
    reshard_after_forward: bool = True
    defer_grad_sync: bool = False
    expert_axes: Sequence[str | int] = ()
    expert_capacity: float | None = None
    context_parallel: ContextParallel | None = None

    def __post_init__(self) -> None:
        if self.context_parallel is not None and not isinstance(self.context_parallel, ContextParallel):
            raise TypeError(
                f"Plan(context_parallel={self.context_parallel!r}): expected a spmd_compiler.ContextParallel or None. "
                f"fix: context_parallel=ContextParallel(axis='cp')"
            )
        for field_name, what, example in (
            ("fsdp_axes", "the axes over which parameters are stored sharded and gathered for compute", "fsdp_axes=('dp',) (or (0,)), or leave it out for no FSDP"),
            ("expert_axes", "the axes over which stacked expert weights stay split by expert, tokens travelling to them",
             "expert_axes=('dp',) (or (0,)), or leave it out"),
        ):
            axes = getattr(self, field_name)
            if isinstance(axes, (str, bytes)) or not isinstance(axes, (tuple, list)) or not all(
                    isinstance(a, str) or (isinstance(a, int) and not isinstance(a, bool)) for a in axes):
                raise TypeError(
                    f"Plan({field_name}={axes!r}): expected a tuple of mesh axis names or indices ({what}), got a {type(axes).__name__}"
                    f"{'' if not isinstance(axes, (tuple, list)) else ' with ' + ', '.join(sorted({type(a).__name__ for a in axes}))}. "
                    f"fix: {example}"
                )
        if self.expert_capacity is not None and (isinstance(self.expert_capacity, bool) or not isinstance(self.expert_capacity, (int, float))
                                                 or not self.expert_capacity > 0):
            raise TypeError(
                f"Plan(expert_capacity={self.expert_capacity!r}): expected a positive number (rows a rank can receive for "
                f"its experts, as a multiple of its own routed rows) or None (every rank's rows: never exceeded)"
            )
        if not isinstance(self.defer_grad_sync, bool):
            raise TypeError(
                f"Plan(defer_grad_sync={self.defer_grad_sync!r}): expected True (gradients kept across calls stay "
                f"unreduced, Partial on the data axes, until the call that steps) or False (reduced at every call), "
                f"got a {type(self.defer_grad_sync).__name__}. fix: pass a bool"
            )
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                f"Plan(reshard_after_forward={self.reshard_after_forward!r}): expected True (gather FSDP parameters "
                f"again for backward, as fully_shard's default) or False (keep the forward's gather for backward), "
                f"got a {type(self.reshard_after_forward).__name__}. fix: pass a bool"
            )
        if self.activation_sharding not in ("follow", "greedy"):
            raise ValueError(
                f"Plan(activation_sharding={self.activation_sharding!r}): expected 'follow' (shards start at the "
                f"plan and propagate) or 'greedy' (DTensor's cheapest strategy per op)"
            )

    def fsdp_axis_indices(self, mesh: Any) -> tuple[int, ...]:
        """``fsdp_axes`` as mesh axis indices (ValueError for unknown names)."""
        return _axis_indices(mesh, self.fsdp_axes, "fsdp")

    def expert_axis_indices(self, mesh: Any) -> tuple[int, ...]:
        """``expert_axes`` as mesh axis indices (ValueError for unknown names)."""
        return _axis_indices(mesh, self.expert_axes, "expert")

    def cp_layout(self, mesh: Any) -> CPLayout | None:
        """``context_parallel`` resolved against ``mesh`` (None without it, or on an axis of size 1)."""
        if self.context_parallel is None:
            return None
        layout = self.context_parallel.layout(mesh)
        return layout if mesh.shape[layout.axis] > 1 else None

    def resolve(self, traced: Any, mesh: Any) -> "ResolvedPlan":
        """Placements for every input of ``traced`` (a TracedStep) on ``mesh``."""
        return _resolve(self, traced, mesh)

    def batch_placements(self, batch_inputs: Sequence[Any], ndim: int) -> list[tuple[tuple[Placement, ...], str]]:
        """``(placements, source)`` for each batch tensor (GraphInputs of kind "batch")."""
        return _batch_placements(self, list(batch_inputs), ndim)


def _axis_indices(mesh: Any, axes: Sequence[str | int], what: str) -> tuple[int, ...]:
    names = list(mesh.mesh_dim_names or [])
    out = []
    for a in axes:
        if isinstance(a, int):
            if not 0 <= a < mesh.ndim:
                raise ValueError(
                    f"{what} axis {a} is out of range for a {mesh.ndim}-D mesh. fix: use an index in "
                    f"[0, {mesh.ndim - 1}] or a mesh axis name {names}"
                )
            out.append(a)
        elif a in names:
            out.append(names.index(a))
        else:
            raise ValueError(f"{what} axis {a!r} is not a mesh axis name; mesh axes are {names}. fix: name one of them")
    return tuple(out)
