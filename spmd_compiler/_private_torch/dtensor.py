"""DTensor internals: specs, placements, sharding propagation, strategy selection and
redistribution planning.

Touches ``torch.distributed.tensor._dtensor_spec`` (DTensorSpec, TensorMeta),
``_op_schema`` (OpSchema, OpStrategy, OutputSharding), ``_sharding_prop``
(``_select_min_cost_strategy``, wrapped by :func:`_install_selector`), the propagator's
``propagate_op_sharding_non_cached`` and caches, ``_redistribute``
(``_gen_transform_infos_non_cached``, planner caches), ``_utils``
(``_compute_local_shape_and_global_offset``), ``_collective_utils`` and ``_ops.utils``
(size questions patched for symbolic sizes), ``placement_types`` private placements
(``_StridedShard``, ``_MaskPartial``, ``_ops._math_ops._NormPartial``),
``DTensor._op_dispatcher`` (custom handlers, random ops) and ``DeviceMesh._coordinate_on_dim``.
Checked against torch 2.13.0 and 2.14.1.

Module state, defined here only: ``_selection`` (thread-local strategy filter of the
current :func:`propagate_sharding` call). DTensor on symbolic sizes (its patches, the
symbolic block-count placement) is :mod:`.dtensor_symbolic`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor import _sharding_prop
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, OutputSharding
from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)
from torch.distributed.tensor.placement_types import _MaskPartial as MaskPartial
from torch.distributed.tensor._ops._math_ops import _NormPartial as NormPartial

from .shapes import is_symbolic
from .dtensor_symbolic import (
    SYMBOLIC_SPLIT_BASE, _flat, _float_hint, _has_symint, _spec_leaves, _symbolic_floats,
    _symbolic_mode_of, _with_example_sizes, _with_floats, register_symbolic_mode, split_period, symbolic_split,
)

__all__ = [
    "DTensorSpec", "TensorMeta", "OpSchema", "OutputSharding", "MaskPartial", "NormPartial", "StridedShard", "symbolic_split", "split_period", "SYMBOLIC_SPLIT_BASE",
    "Partial", "Placement", "Replicate", "Shard", "Placements", "TransformStep", "StrategyCandidate", "make_spec",
    "propagate_sharding", "transform_steps", "local_shape_and_offset", "custom_handled_ops", "random_ops",
    "register_symbolic_mode", "clear_dtensor_caches", "localized_shape_arg",
]


StridedShard = _StridedShard

Placements = tuple[Placement, ...]



def make_spec(
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
) -> DTensorSpec:
    """A DTensorSpec with tensor metadata for a global tensor."""
    meta = TensorMeta(torch.Size(shape), tuple(stride), dtype)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)



@dataclass(frozen=True)
class StrategyCandidate:
    """One of DTensor's sharding strategies for an op, as plain placements.

    ``inputs_now``: the placements the tensor arguments have; ``inputs_needed``: the
    placements the strategy wants them in; ``outputs``: the result placements (None for
    non-tensor results); ``cost``: DTensor's redistribution cost estimate.
    """

    outputs: tuple[Placements | None, ...]
    inputs_now: tuple[Placements, ...]
    inputs_needed: tuple[Placements, ...]
    cost: float



StrategyFilter = Callable[[StrategyCandidate], bool]

_selection = threading.local()



def _candidate(spec: Any, op_schema: OpSchema) -> StrategyCandidate:
    outs = spec.output_specs if isinstance(spec.output_specs, (tuple, list)) else (spec.output_specs,)
    now = [s for s in op_schema.args_spec]
    needed = list(spec.input_specs) if spec.input_specs is not None else [spec.output_spec] * len(now)
    cost = sum(sum(float(c) for c in row) for row in (spec.redistribute_cost or []))
    return StrategyCandidate(
        tuple(tuple(o.placements) if isinstance(o, DTensorSpec) else None for o in outs),
        tuple(tuple(s.placements) for s in now),
        tuple(tuple(s.placements) for s in needed[: len(now)]),
        cost,
    )



def _install_selector() -> None:
    """Wrap DTensor's strategy selection so a caller-supplied filter (thread-local, set
    only inside :func:`propagate_sharding`) can veto candidates before the min-cost pick.
    Outside our calls, and when the filter would leave nothing, DTensor decides alone."""
    original = _sharding_prop._select_min_cost_strategy
    if getattr(original, "_spmd_original", None) is not None:
        return

    def select(strategy: Any, op_schema: Any = None) -> Any:
        keep_fn = getattr(_selection, "keep", None)
        if keep_fn is not None and op_schema is not None and len(strategy.strategies) > 1:
            kept = [s for s in strategy.strategies if keep_fn(_candidate(s, op_schema))]
            if kept and len(kept) < len(strategy.strategies):
                return original(OpStrategy(kept), op_schema)
        return original(strategy, op_schema)

    select._spmd_original = original  # type: ignore[attr-defined]
    _sharding_prop._select_min_cost_strategy = select



def propagate_sharding(
    op: torch._ops.OpOverload,
    args_schema: tuple,
    kwargs_schema: dict,
    coordinate: Sequence[int] | None = None,
    keep: StrategyFilter | None = None,
) -> OutputSharding:
    """Run DTensor's sharding propagation for ``op`` without touching its caches.

    ``args_schema`` mirrors the op's arguments with a DTensorSpec in place of every
    tensor. ``coordinate`` is the rank DTensor should compute local sizes for (view ops
    localize their size arguments); by default the mesh's own. ``keep`` filters DTensor's
    candidate strategies before its min-cost choice (ignored when it keeps none).
    Raises an exception (NotImplementedError, RuntimeError, ValueError...) when DTensor
    cannot shard the op. Must be called outside proxy tracing: some strategies run
    decompositions.
    """
    prop = DTensor._op_dispatcher.sharding_propagator
    args_schema, kwargs_schema = _strided_as_layout((args_schema, kwargs_schema))
    floats = _symbolic_floats(args_schema, kwargs_schema)
    if floats:  # DTensor's strategy cache hashes the schema: hashing a SymFloat pins it (a guard)
        args_schema, kwargs_schema = _with_floats(args_schema, kwargs_schema, {i: _float_hint(f) for i, f in floats.items()})
    info = prop.op_to_schema_info.get(op)
    if info is None:
        info = prop.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = OpSchema(op, args_schema, kwargs_schema, schema_info=info)
    mesh = next((a.mesh for a in _spec_leaves(args_schema, kwargs_schema)), None)
    if keep is not None:
        _install_selector()
    previous = getattr(_selection, "keep", None)
    _selection.keep = keep
    try:
        with _as_coordinate(mesh, coordinate), _symbolic_mode_of(args_schema, kwargs_schema):
            out = prop.propagate_op_sharding_non_cached(schema)
    finally:
        _selection.keep = previous
    rs = out.redistribute_schema
    if floats and rs is not None:  # the op runs on the symbolic scalars, never their example values
        if len(_flat(rs.args_schema, rs.kwargs_schema)) != len(_flat(args_schema, kwargs_schema)):
            raise NotImplementedError(f"{op}: DTensor rewrote arguments around a symbolic scalar")
        r_args, r_kwargs = _with_floats(tuple(rs.args_schema), dict(rs.kwargs_schema), floats)
        out.redistribute_schema = OpSchema(rs.op, r_args, r_kwargs, schema_info=rs.schema_info)
    return out


def localized_shape_arg(op: Any) -> int | None:
    """The position of the size argument DTensor rewrites to this rank's local shape
    (``view``'s ``size``, ``new_zeros``'s ``size``...), or None for other ops; ops that
    also take a stride (``new_empty_strided``) give None (not handled symbolically)."""
    idx = DTensor._op_dispatcher.sharding_propagator.op_to_shape_and_stride_idx.get(op)
    return idx if isinstance(idx, int) else None


def _strided_as_layout(tree: Any) -> Any:
    """Every spec in ``tree`` with a ``_StridedShard`` marked as a strided *layout*.

    DTensor gives ``_StridedShard`` two meanings, chosen per spec by
    ``use_strided_shard_as_shard_order``: an encoding of the order in which mesh axes
    split a dim (the default for a spec built with one), or the interleaved layout its
    view strategies produce (``False``). We only ever mean the layout; a spec of each
    kind among one op's inputs makes DTensor pick the ordering meaning for all of them
    (and gather).
    """
    from torch.utils import _pytree as pytree

    def fix(spec: Any) -> Any:
        if not isinstance(spec, DTensorSpec) or not getattr(spec, "use_strided_shard_as_shard_order", False):
            return spec
        if not any(isinstance(p, _StridedShard) for p in spec.placements):
            return spec
        return DTensorSpec(spec.mesh, spec.placements, tensor_meta=spec.tensor_meta, use_strided_shard_as_shard_order=False)

    return pytree.tree_map(fix, tree, is_leaf=lambda x: isinstance(x, DTensorSpec))



@contextlib.contextmanager
def _as_coordinate(mesh: DeviceMesh | None, coordinate: Sequence[int] | None) -> Iterator[None]:
    """Make ``mesh.get_coordinate()`` answer ``coordinate`` (DTensor reads it for sizes)."""
    if mesh is None or coordinate is None:
        yield
        return
    old = mesh._coordinate_on_dim
    mesh._coordinate_on_dim = list(coordinate)
    try:
        yield
    finally:
        mesh._coordinate_on_dim = old



@dataclass(frozen=True)
class TransformStep:
    """One per-mesh-axis step of a redistribution, as DTensor's planner orders them."""

    axis: int
    src: Placement
    dst: Placement



def transform_steps(src: DTensorSpec, dst: DTensorSpec) -> list[TransformStep]:
    """The ordered per-axis placement changes that take ``src`` to ``dst``."""
    if src.mesh.ndim == 1 and any(is_symbolic(s) for s in src.shape):
        # symbolic sizes (dynamic=True) are unhashable for DTensor's planner cache; on one
        # axis the plan is the one change, whatever the sizes
        return [TransformStep(0, src.placements[0], dst.placements[0])] if src.placements != dst.placements else []
    if _has_symint(src) or _has_symint(dst):
        # several axes: the planner orders the per-axis changes from the placements; it
        # hashes shapes, so it gets the sizes' example values (no guard: the steps it
        # picks are placement changes, each emitted for any size)
        src, dst = _with_example_sizes(src), _with_example_sizes(dst)
    infos = _gen_transform_infos_non_cached(src, dst)
    return [TransformStep(i.mesh_dim, i.src_dst_placements[0], i.src_dst_placements[1]) for i in infos]



def local_shape_and_offset(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shard shape and its global offset for the rank at ``coordinate``."""
    shape, offset = _compute_local_shape_and_global_offset(
        tuple(global_shape), tuple(mesh_shape), list(coordinate), list(placements)
    )
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)



def custom_handled_ops() -> frozenset:
    """Ops DTensor dispatches through a Python handler instead of sharding propagation."""
    return frozenset(DTensor._op_dispatcher._custom_op_handlers)



def random_ops() -> frozenset:
    """Ops DTensor treats as random (they need an RNG policy across ranks)."""
    return frozenset(DTensor._op_dispatcher._random_ops)



def clear_dtensor_caches() -> None:
    """Drop DTensor's process-wide caches (redistribute planners, transform infos,
    sharding propagation, mesh topology). Their keys and values hold DeviceMeshes, and a
    mesh holds its process groups: cleared, the groups can be freed while the
    interpreter still runs instead of during its shutdown."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    type(prop)._propagate_tensor_meta_cached.cache_clear()
