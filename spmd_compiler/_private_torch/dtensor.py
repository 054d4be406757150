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
current :func:`propagate_sharding` call) and ``_MODES_BY_ENV`` (fake mode of each
ShapeEnv, see :func:`register_symbolic_mode`).
"""

from __future__ import annotations

import contextlib
import math
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
from torch._subclasses.fake_tensor import FakeTensorMode

from .shapes import is_symbolic

__all__ = [
    "DTensorSpec", "TensorMeta", "OpSchema", "OutputSharding", "MaskPartial", "NormPartial", "StridedShard", "symbolic_split", "split_period", "SYMBOLIC_SPLIT_BASE",
    "Partial", "Placement", "Replicate", "Shard", "Placements", "TransformStep", "StrategyCandidate", "make_spec",
    "propagate_sharding", "transform_steps", "local_shape_and_offset", "custom_handled_ops", "random_ops",
    "register_symbolic_mode", "clear_dtensor_caches", "localized_shape_arg",
]


StridedShard = _StridedShard

# dynamic=True: a ``_StridedShard`` whose split factor is a symbolic size (a flattened
# ``(B, H)`` with H split: B blocks of H rows, each split n ways) carries, instead of that
# factor, this marker plus the static period H (rows per block). DTensor's placements are
# C++ objects that keep a plain int (no SymInt: they hash it), so the period rides in the
# int; DTensor's strategies only compare it (both bmm operands alike). Our local shapes and
# collectives read the period (expand/layout.py); DTensor's shardability check sees a Shard.
SYMBOLIC_SPLIT_BASE = 1 << 24


def symbolic_split(dim: int, period: int) -> Any:
    """``_StridedShard(dim)`` of blocks of ``period`` rows whose count is symbolic."""
    return _StridedShard(dim, split_factor=SYMBOLIC_SPLIT_BASE + int(period))


def split_period(p: Any) -> int | None:
    """The period of a :func:`symbolic_split` placement, else None."""
    if isinstance(p, _StridedShard) and int(p.split_factor) > SYMBOLIC_SPLIT_BASE:
        return int(p.split_factor) - SYMBOLIC_SPLIT_BASE
    return None

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


def _flat(args: Any, kwargs: Any) -> list:
    from torch.utils import _pytree as pytree

    return pytree.tree_leaves((tuple(args), dict(kwargs)))


def _symbolic_floats(args: Any, kwargs: Any) -> dict[int, Any]:
    """The symbolic SymFloat scalars among an op's arguments (``2 / (s3 - 1)`` in var's
    backward), by position among the leaves."""
    return {i: x for i, x in enumerate(_flat(args, kwargs)) if isinstance(x, torch.SymFloat) and is_symbolic(x)}


def _with_floats(args: Any, kwargs: Any, values: dict[int, Any]) -> tuple[tuple, dict]:
    from torch.utils import _pytree as pytree

    leaves, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
    return pytree.tree_unflatten([values.get(i, x) for i, x in enumerate(leaves)], tree)


def _float_hint(x: Any) -> float:
    """A SymFloat's example value, read without a guard (a scalar argument never changes
    the strategy DTensor picks: it is only hashed and passed to its fake run)."""
    hint = x.node.hint
    return float(hint) if hint is not None else 1.0


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



def _spec_leaves(args: Any, kwargs: Any) -> Iterator[DTensorSpec]:
    from torch.utils import _pytree as pytree

    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, DTensorSpec):
            yield leaf



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



_MODES_BY_ENV: dict[int, Any] = {}



def register_symbolic_mode(mode: FakeTensorMode) -> None:
    """Let :func:`propagate_sharding` find ``mode`` from the SymInts of its ShapeEnv."""
    _MODES_BY_ENV[id(mode.shape_env)] = mode



def _symbolic_mode_of(args: Any, kwargs: Any) -> Any:
    """The fake mode of symbolic sizes in the specs (dynamic=True): DTensor's strategies
    hash shapes unless a fake mode with a ShapeEnv is active; else a null context."""
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is None:
        for size in _symbolic_sizes(args, kwargs):
            mode = _MODES_BY_ENV.get(id(size.node.shape_env))
            if mode is not None:
                return _symbolic_propagation(mode)
    return contextlib.nullcontext()


def _symbolic_sizes(args: Any, kwargs: Any) -> Iterator[Any]:
    """The symbolic sizes of the specs' shapes, then those among the other arguments: an
    ``expand`` of a static ``[1, d]`` to ``[s3, d]`` (a mean's gradient over the batch)
    has its symbol in the size argument only. Without its mode DTensor's fake run of the
    op asks ``s3 != 1`` (a guard: a second program for one row)."""
    from torch.utils import _pytree as pytree

    for spec in _spec_leaves(args, kwargs):
        if spec.tensor_meta is not None:
            yield from (s for s in spec.shape if is_symbolic(s))
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, (torch.SymInt, torch.SymFloat)) and is_symbolic(leaf):
            yield leaf



@contextlib.contextmanager
def _symbolic_propagation(mode: FakeTensorMode) -> Iterator[None]:
    """DTensor propagation on symbolic sizes (dynamic=True), inside ``mode``, with three
    of DTensor's size questions answered without a guard on the sizes:

    * redistribution costs are computed from the sizes' example values: a cost only ranks
      strategies that are all correct, so it must not become a guard (a float equality
      would pin the size); on several mesh axes the whole cost is (its planner hashes shapes);
    * "is this dim long enough to shard" likewise (it prefers strategies without empty
      shards, which the expansion handles for any size);
    * "does this dim split evenly" is answered "no" for a symbolic dim: the uneven answer
      is DTensor's conservative, always-correct choice (a mean replicates first), so one
      program serves even and uneven sizes.
    """
    from torch.distributed.tensor import _collective_utils as cu
    from torch.distributed.tensor._ops import utils as ou

    from torch.fx.experimental.symbolic_shapes import optimization_hint

    def spec_to_bytes(spec: Any) -> int:
        return spec.tensor_meta.dtype.itemsize * math.prod(optimization_hint(s) for s in spec.shape)

    shardable, even_on_dim, even = ou.is_tensor_shardable, ou.is_tensor_evenly_shardable_on_dim, ou.is_tensor_evenly_shardable

    def is_tensor_shardable(shape: Any, spec: Any, *args: Any, **kwargs: Any) -> bool:
        if any(split_period(p) is not None for p in spec.placements):  # a symbolic block count: rows of whole blocks
            spec = DTensorSpec(spec.mesh, tuple(Shard(p.dim) if split_period(p) is not None else p for p in spec.placements),
                               tensor_meta=spec.tensor_meta)
        return shardable([optimization_hint(s) for s in shape], spec, *args, **kwargs)

    def is_tensor_evenly_shardable_on_dim(shape: Any, spec: Any, dim: int) -> bool:
        return False if is_symbolic(shape[dim]) else even_on_dim(shape, spec, dim)

    def is_tensor_evenly_shardable(shape: Any, spec: Any) -> bool:
        sharded = [p.dim for p in spec.placements if isinstance(p, Shard)]
        return False if any(is_symbolic(shape[d]) for d in sharded) else even(shape, spec)

    cost = cu.redistribute_cost

    def redistribute_cost(current: Any, target: Any) -> float:
        # several mesh axes: DTensor plans the steps through a cache that hashes shapes
        if any(_has_symint(s) for s in (current, target)):
            current, target = _with_example_sizes(current), _with_example_sizes(target)
        return cost(_example_split(current), _example_split(target))

    with _patched({"spec_to_bytes": (cu.spec_to_bytes, spec_to_bytes), "is_tensor_shardable": (shardable, is_tensor_shardable),
                   "redistribute_cost": (cost, redistribute_cost),
                   "is_tensor_evenly_shardable_on_dim": (even_on_dim, is_tensor_evenly_shardable_on_dim),
                   "is_tensor_evenly_shardable": (even, is_tensor_evenly_shardable)}), mode:
        yield



@contextlib.contextmanager
def _patched(replacements: dict[str, tuple[Any, Any]]) -> Iterator[None]:
    """Replace ``name`` (bound to ``old``) by ``new`` in every DTensor module that holds it."""
    import sys

    done = []
    for name, m in list(sys.modules.items()):
        if not name.startswith("torch.distributed.tensor") or m is None:
            continue
        for attr, (old, new) in replacements.items():
            if getattr(m, attr, None) is old:
                setattr(m, attr, new)
                done.append((m, attr, old))
    try:
        yield
    finally:
        for m, attr, old in done:
            setattr(m, attr, old)



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



def _example_split(spec: DTensorSpec) -> DTensorSpec:
    """``spec`` with every :func:`symbolic_split` given its example block count (costs
    only: DTensor's cost model walks the blocks)."""
    if not any(split_period(p) is not None for p in spec.placements):
        return spec
    placements = []
    for p in spec.placements:
        period = split_period(p)
        if period is not None:
            p = _StridedShard(p.dim, split_factor=max(2, int(spec.shape[p.dim]) // period))
        placements.append(p)
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta,
                       use_strided_shard_as_shard_order=False)


def _has_symint(spec: DTensorSpec) -> bool:
    """Sizes DTensor cannot hash (SymInts, also those a guard made constant)."""
    meta = spec.tensor_meta
    return meta is not None and any(isinstance(v, torch.SymInt) for v in (*meta.shape, *meta.stride))


def _with_example_sizes(spec: DTensorSpec) -> DTensorSpec:
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    meta = spec.tensor_meta
    if meta is None:
        return spec
    shape = torch.Size(int(optimization_hint(s)) for s in meta.shape)
    stride = tuple(int(optimization_hint(s)) for s in meta.stride)
    return DTensorSpec(spec.mesh, spec.placements, tensor_meta=TensorMeta(shape, stride, meta.dtype),
                       use_strided_shard_as_shard_order=getattr(spec, "use_strided_shard_as_shard_order", False))


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
