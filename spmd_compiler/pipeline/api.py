"""Pipeline configuration and the glue between a compiled step and its stage programs."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Replicate

from ..plan import Plan
from ..trace.markers import SplitPoint
from .schedule import SCHEDULES

__all__ = ["Pipeline", "pipeline_plan", "check_split_points"]

CHECKPOINT_MODES = ("never", "always", "except_last")


@dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism over one mesh axis.

    Attributes:
        axis: the mesh axis stages are laid out along ("pp"). The plan's placements are
            for the other axes, in order; the pipeline axis is Replicate for everything.
        chunks: micro-batches per step; each batch tensor is split along dim 0.
        schedule: "GPipe", "1F1B" or "Interleaved1F1B".
        split: where to cut: ``{module FQN: SplitPoint.BEGINNING | END}``. Without it,
            ``pipe_split()`` calls in ``forward`` cut, or, with ``auto``, the layers are
            balanced.
        auto: balance the model's layer list (its first nn.ModuleList) into stages of
            equal parameter bytes (for FLOPs or time, call
            :func:`~spmd_compiler.pipeline.balance.balanced_split` and pass ``split``).
        stages_per_rank: stages each pipeline rank runs (Interleaved1F1B: 2 or more).
        no_chunk: batch tensors (by path, e.g. "batch[1]") passed whole to every
            micro-batch instead of split.
        checkpoint: "never", "always" or "except_last": recompute a stage's forward
            during its backward instead of keeping its activations.
        scale_grads: divide gradients summed over micro-batches by ``chunks`` (the loss
            is a mean, as on one device); with False they are summed.
        reshard_between_microbatches: False (the default): what a stage computes from its
            parameters alone, FSDP gathers above all, runs once per step before its first
            micro-batch and is kept until its last backward (the stage's gathered
            parameters stay resident for the step, as ``fully_shard`` with
            ``reshard_after_forward=False`` under torchtitan's pipelines); True: gathered
            again for every micro-batch's forward and backward, as the plan's
            ``reshard_after_forward`` says (less memory, ``2 x chunks`` times the bytes).
    """

    axis: str = "pp"
    chunks: int = 1
    schedule: str = "1F1B"
    split: Mapping[str, SplitPoint] | None = None
    auto: bool = False
    stages_per_rank: int = 1
    no_chunk: Sequence[str] = ()
    checkpoint: str = "never"
    scale_grads: bool = True
    reshard_between_microbatches: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Pipeline(schedule={self.schedule!r}): expected one of {list(SCHEDULES)}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"Pipeline(checkpoint={self.checkpoint!r}): expected one of {list(CHECKPOINT_MODES)}")
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"Pipeline(chunks={self.chunks!r}): expected a positive int")
        if self.stages_per_rank < 1:
            raise ValueError(f"Pipeline(stages_per_rank={self.stages_per_rank}): expected >= 1")

    def axis_index(self, mesh: Any) -> int:
        names = list(mesh.mesh_dim_names or [])
        if self.axis not in names:
            raise ValueError(
                f"the mesh has no pipeline axis {self.axis!r}; its axes are {names}. fix: name a mesh axis "
                f"{self.axis!r} (e.g. mesh={{'{self.axis}': 2, 'dp': 2}}) or pass Pipeline(axis=<one of {names}>)"
            )
        return names.index(self.axis)


def pipeline_plan(plan: Plan, pp_index: int | None, ndim: int) -> Plan:
    """The plan for the full mesh: Replicate inserted on the pipeline axis. With
    ``pp_index=None``, the plan for the stage mesh (the other axes): unchanged but for
    the pipeline's default batch placement."""

    def widen(value: Any) -> Any:
        from torch.distributed.tensor import Placement

        if value is None:
            return None
        if pp_index is None:
            return value
        if isinstance(value, Placement):
            value = [value]
        if isinstance(value, (list, tuple)) and len(value) == ndim - 1 and all(_is_placement(p) for p in value):
            out = list(value)
            out.insert(pp_index, Replicate())
            return out
        return value

    params = {k: (v if not isinstance(v, (list, tuple)) and not _is_placement(v) else widen(v)) for k, v in plan.params.items()}
    inputs = plan.inputs
    if isinstance(inputs, Mapping):
        inputs = {k: widen(v) for k, v in inputs.items()}
    elif inputs is not None:
        inputs = [widen(v) for v in inputs]
    def shifted(axes: Any) -> tuple:
        return tuple(a + (1 if pp_index is not None and a >= pp_index else 0) if isinstance(a, int) else a for a in axes)

    cp = plan.context_parallel
    if cp is not None and isinstance(cp.axis, int):  # an index among the non-pipeline axes
        cp = dataclasses.replace(cp, axis=shifted((cp.axis,))[0])
    # every other field (strict, style_axis, activation_sharding, reshard_after_forward,
    # and any added later) is the user's
    return dataclasses.replace(
        plan,
        params=params,
        inputs=inputs,
        default_param=widen(plan.default_param),
        default_input=widen(plan.default_input if plan.default_input is not None else _default_input(ndim - 1)),
        fsdp_axes=shifted(plan.fsdp_axes),
        expert_axes=shifted(plan.expert_axes),
        context_parallel=cp,
    )


def _default_input(other_axes: int) -> list[Any]:
    """Batch default over the non-pipeline axes: Shard(0) on the first, else whole."""
    from torch.distributed.tensor import Shard

    return [Shard(0)] + [Replicate()] * (other_axes - 1) if other_axes else []


def _is_placement(v: Any) -> bool:
    from torch.distributed.tensor import Placement

    return isinstance(v, Placement)


def check_split_points(model: torch.nn.Module, split: Mapping[str, Any] | None) -> None:
    """A split spec names existing modules, with SplitPoint values."""
    if not split:
        return
    names = [n for n, _ in model.named_modules() if n]
    for fqn, where in split.items():
        if not isinstance(where, SplitPoint):
            raise TypeError(f"split point for {fqn!r} is {where!r}; expected SplitPoint.BEGINNING or SplitPoint.END")
        if fqn not in names:
            near = difflib.get_close_matches(fqn, names, n=3, cutoff=0.4)
            hint = f" Modules with similar names: {', '.join(repr(n) for n in near)}." if near else ""
            raise ValueError(f"split point {fqn!r} names no module of the model.{hint} fix: use an FQN from model.named_modules()")
