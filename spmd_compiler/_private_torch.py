"""The one door to private torch APIs.

Everything spmd-compiler needs from torch internals is imported here and wrapped in a
small function with a stable signature, so a torch upgrade is one file's work. Written
against torch 2.13. Nothing else in the package imports a ``torch.*._private`` name,
``torch.distributed.tensor._*`` module or ``torch._subclasses`` internals directly.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import sympy
import torch.distributed as dist
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
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = [
    "DTensorSpec",
    "TensorMeta",
    "OpSchema",
    "OutputSharding",
    "MaskPartial",
    "NormPartial",
    "StridedShard",
    "FakeTensor",
    "FakeTensorMode",
    "TransformStep",
    "StrategyCandidate",
    "make_spec",
    "propagate_sharding",
    "transform_steps",
    "local_shape_and_offset",
    "reparametrize_module",
    "symbolic_fake_mode",
    "to_symbolic_fake",
    "static_fake_mode",
    "size_hint",
    "example_tensor",
    "local_tensor",
    "custom_handled_ops",
    "random_ops",
    "tracing_graph",
    "group_name",
    "is_view_op",
    "written_args",
    "writes_first_arg",
]

StridedShard = _StridedShard
Placements = tuple[Placement, ...]


# ----------------------------------------------------------------------------- specs


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
            return prop.propagate_op_sharding_non_cached(schema)
    finally:
        _selection.keep = previous


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


def _symbolic_mode_of(args: Any, kwargs: Any) -> Any:
    """The fake mode of symbolic sizes in the specs (dynamic=True): DTensor's strategies
    hash shapes unless a fake mode with a ShapeEnv is active; else a null context."""
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is None:
        for spec in _spec_leaves(args, kwargs):
            if spec.tensor_meta is not None and any(is_symbolic(s) for s in spec.shape):
                mode = _MODES_BY_ENV.get(id(next(s for s in spec.shape if is_symbolic(s)).node.shape_env))
                if mode is not None:
                    return _symbolic_propagation(mode)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _symbolic_propagation(mode: FakeTensorMode) -> Iterator[None]:
    """DTensor propagation on symbolic sizes (dynamic=True), inside ``mode``, with three
    of DTensor's size questions answered without a guard on the sizes:

    * redistribution costs are computed from the sizes' example values: a cost only ranks
      strategies that are all correct, so it must not become a guard (a float equality
      would pin the size);
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
        return shardable([optimization_hint(s) for s in shape], spec, *args, **kwargs)

    def is_tensor_evenly_shardable_on_dim(shape: Any, spec: Any, dim: int) -> bool:
        return False if is_symbolic(shape[dim]) else even_on_dim(shape, spec, dim)

    def is_tensor_evenly_shardable(shape: Any, spec: Any) -> bool:
        sharded = [p.dim for p in spec.placements if isinstance(p, Shard)]
        return False if any(is_symbolic(shape[d]) for d in sharded) else even(shape, spec)

    with _patched({"spec_to_bytes": (cu.spec_to_bytes, spec_to_bytes), "is_tensor_shardable": (shardable, is_tensor_shardable),
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


_MODES_BY_ENV: dict[int, Any] = {}


def register_symbolic_mode(mode: FakeTensorMode) -> None:
    """Let :func:`propagate_sharding` find ``mode`` from the SymInts of its ShapeEnv."""
    _MODES_BY_ENV[id(mode.shape_env)] = mode


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


def group_name(mesh: DeviceMesh, axis: int) -> str:
    """The c10d group name used by functional collectives over ``axis`` of ``mesh``."""
    return mesh.get_group(axis).group_name


def custom_handled_ops() -> frozenset:
    """Ops DTensor dispatches through a Python handler instead of sharding propagation."""
    return frozenset(DTensor._op_dispatcher._custom_op_handlers)


def tracing_graph() -> Any:
    """The fx graph make_fx is building right now (None outside a trace)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


def random_ops() -> frozenset:
    """Ops DTensor treats as random (they need an RNG policy across ranks)."""
    return frozenset(DTensor._op_dispatcher._random_ops)


def is_view_op(op: Any) -> bool:
    schema = getattr(op, "_schema", None)
    return bool(schema is not None and schema._is_view_op())


@functools.lru_cache(maxsize=None)
def written_args(op: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of every argument ``op``'s schema marks as written in place
    (``Tensor(a!) self``, ``Tensor(a!)[] exp_avgs``, ``Tensor(a!) out``); empty for
    anything that is not an OpOverload."""
    if not isinstance(op, torch._ops.OpOverload):
        return ()
    return tuple(
        (i, a.name) for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )


def writes_first_arg(op: Any) -> bool:
    """Whether ``op`` writes its first, positional argument in place and returns it
    (``add_``, ``copy_``, ``lerp_``): the in-place ops whose result aliases ``args[0]``."""
    written = written_args(op)
    return bool(written and written[0][0] == 0 and not op._schema.arguments[0].kwarg_only)


# ----------------------------------------------------------------------------- tracing


def reparametrize_module(module: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """Context manager: swap ``module``'s parameters and buffers by FQN, ties kept."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=True, strict=False)


def symbolic_fake_mode(*, specialize_zero_one: bool = True) -> FakeTensorMode:
    """A fake mode whose sizes are symbols, one per input dim (no duck sizing).

    Without ``duck_shape=False`` two unrelated dims of equal size share a symbol and a
    size read from one tensor would be attributed to the other. ``specialize_zero_one``
    makes a size 0 or 1 a constant and assumes the others are at least 2; without it a
    size of 1 stays a symbol too (dynamic=True: one program for every batch size).
    """
    shape_env = ShapeEnv(duck_shape=False, specialize_zero_one=specialize_zero_one)
    return FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)


def to_symbolic_fake(mode: FakeTensorMode, t: torch.Tensor, name: str, dynamic: bool | Sequence[int] = True) -> FakeTensor:
    """Fakeify ``t`` with a symbolic size per dim (static sizes when ``dynamic`` is False;
    a sequence of dims makes just those symbolic)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    if isinstance(dynamic, bool):
        dims = set(range(t.dim())) if dynamic else set()
    else:
        dims = {d % max(1, t.dim()) for d in dynamic}
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())])
    return mode.from_tensor(t, source=ConstantSource(name), symbolic_context=ctx)


def example_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor with ``t``'s global metadata, for tracing.

    A DTensor becomes an uninitialized tensor of its global shape on its local device
    (its pages are never touched, so no memory is committed); other tensors are detached.
    Parameters keep ``requires_grad``.
    """
    if isinstance(t, DTensor):
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return out.requires_grad_(t.requires_grad) if t.requires_grad else out
    if isinstance(t, torch.nn.Parameter):
        return t
    return t.detach()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (no autograd), or ``t`` itself."""
    if isinstance(t, DTensor):
        return t._local_tensor
    return t


def static_fake_mode() -> FakeTensorMode:
    """A fake mode with static shapes, for per-rank local tensors during expansion."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def size_hint(x: Any) -> Any:
    """The concrete value behind a SymInt/SymFloat/SymBool (identity for plain values)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = x.node
        hint = node.hint if node.hint is not None else node.shape_env.size_hint(node.expr)
        if isinstance(x, torch.SymInt):
            return int(hint)
        if isinstance(x, torch.SymFloat):
            return float(hint)
        return bool(hint)
    return x


def world_info() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# Re-exported placement types, so callers import placements from one place too.
__all__ += ["Partial", "Placement", "Replicate", "Shard", "Placements", "world_info"]


def rename_node(node: "torch.fx.Node", name: str) -> None:
    """Give ``node`` a readable unique name (placeholders keep target == name)."""
    node._rename(name)
    if node.op == "placeholder":
        node.target = node.name


__all__ += ["rename_node"]


def preserve_node_meta():
    """Context manager: make_fx records ``seq_nr`` (the autograd sequence number of the
    forward op) on every node, and backward nodes get their forward op's number."""
    import torch.fx.traceback as fx_traceback

    return fx_traceback.preserve_node_meta()


def link_backward_to_forward(loss: torch.Tensor) -> None:
    """Before ``loss.backward()`` while tracing: hook every autograd node reachable from
    ``loss`` so the nodes traced while it runs carry its forward op's ``seq_nr`` (and
    stack trace), as AOTAutograd does."""
    if loss.grad_fn is None:
        return
    from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks

    setup_stacktrace_preservation_hooks([loss.grad_fn])


__all__ += ["preserve_node_meta", "link_backward_to_forward"]


def pipeline_order(schedule: str, pp_size: int, n_microbatches: int, stages_per_rank: int = 1) -> dict[int, list[Any]]:
    """torch.distributed.pipelining's action order for a schedule, without building it.

    Returns ``{pp rank: [(stage, "F" | "B", microbatch) or None (idle), ...]}`` from
    the schedule classes' own order computations (GPipe, 1F1B, Interleaved1F1B).
    """
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as S

    if schedule in ("GPipe", "1F1B"):
        cls = S.ScheduleGPipe if schedule == "GPipe" else S.Schedule1F1B
        order = cls._get_pipeline_order(SimpleNamespace(_num_stages=pp_size, _n_microbatches=n_microbatches))
    elif schedule == "Interleaved1F1B":
        rounds = max(1, n_microbatches // pp_size)
        fake = SimpleNamespace(
            n_local_stages=stages_per_rank,
            pp_group_size=pp_size,
            _n_microbatches=n_microbatches,
            number_of_rounds=rounds,
            microbatches_per_round=n_microbatches // rounds,
        )
        order = {r: S.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, r) for r in range(pp_size)}
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    kinds = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B"}
    out: dict[int, list[Any]] = {}
    for rank, actions in order.items():
        row = []
        for a in actions:
            if a is None:
                row.append(None)
            elif a.computation_type in kinds:
                row.append((a.stage_index, kinds[a.computation_type], a.microbatch_index))
        out[rank] = row
    return out


__all__ += ["pipeline_order"]


def mark_optimizer_stepped(optimizer: Any) -> None:
    """Tell LR schedulers that ``optimizer.step()`` ran (the compiled graph ran it): they
    check this private flag and warn about a scheduler step before the optimizer's."""
    if optimizer is not None:
        optimizer._opt_called = True


__all__ += ["mark_optimizer_stepped"]


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


__all__ += ["clear_dtensor_caches"]


def raw_operator(target: Any) -> Any:
    """What calling ``target`` runs: an OpOverload's dispatcher handle (its ``__call__``
    forwards to it), any other callable itself."""
    if isinstance(target, torch._ops.OpOverload):
        return target._op
    return target


__all__ += ["raw_operator"]


def set_group_timeout(group: Any, seconds: float) -> None:
    """Timeout of the collectives on ``group`` (gloo: 30 min by default, NCCL: 10 min)."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds), group)


def default_store() -> Any:
    """The rendezvous key-value store of the default process group (None if there is none)."""
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store()
    except (RuntimeError, ValueError):
        return None


__all__ += ["set_group_timeout", "default_store"]


def branch_atom(expr: Any) -> Any:
    """One form for a branch condition and its negation (``x > 5`` and ``x <= 5`` give the
    same), in torch's canonical form for symbolic conditions."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import canonicalize_bool_expr

    forms = [canonicalize_bool_expr(e) for e in (expr, sympy.Not(expr))]
    return min(forms, key=str)


_REAL_MARK = "propagate_real_tensors"  # how torch labels what it decided on real values


def set_real_value(fake: Any, real: torch.Tensor) -> None:
    """Give a fake tensor its real value, for :func:`propagating_real_values`."""
    fake.real_tensor = real


def propagating_real_values(mode: FakeTensorMode, on: bool) -> None:
    """Switch torch's real-tensor propagation in ``mode``: an op whose tensor inputs all
    have a real value computes it too, and ``.item()`` of it is a symbol with a known
    value (a branch on it is taken and recorded, see :func:`real_value_branches`)."""
    if not hasattr(mode, "_spmd_saved"):
        mode._spmd_saved = (mode.propagate_real_tensors, mode.cache_enabled)
    mode.propagate_real_tensors, mode.cache_enabled = (True, False) if on else mode._spmd_saved


def real_value_branches(mode: FakeTensorMode) -> list[tuple[Any, Any]]:
    """``(condition, stack)`` of every branch the trace took on real values: torch's
    deferred runtime asserts so labelled, and ``x == c`` decisions it kept only as a
    replacement of x by c (stack None)."""
    env = mode.shape_env
    known = env.real_tensor_prop_unbacked_vals
    if not known:
        return []
    out = [(ra.expr, ra.stack) for asserts in env.deferred_runtime_asserts.values() for ra in asserts if ra.msg.startswith(_REAL_MARK)]
    import sympy

    out += [(sympy.Eq(s, r), None) for s, r in env.replacements.items() if s in known and r.is_number]
    return out


def is_real_value_log(record: Any) -> bool:
    """torch's warning at each branch it takes on a real value (noise for our users)."""
    return str(record.msg).startswith(_REAL_MARK)


def symbol_of(value: Any) -> Any:
    """The sympy expression a SymInt/SymFloat/SymBool was created as (before torch
    replaced any of its symbols by what it learned later)."""
    node = value.node
    return getattr(node, "_expr", node.expr)


def sympy_as_python(expr: Any, symbols: Sequence[Any]) -> Any:
    """``expr`` (a symbolic condition) as a Python function of ``symbols``' values (a
    thousand times faster than sympy's substitution), or None if torch cannot print it."""
    import math

    from torch.utils._sympy.printers import PythonPrinter

    try:
        code = PythonPrinter().doprint(expr)
        return eval(f"lambda {', '.join(str(s) for s in symbols)}: {code}", {"math": math, "torch": torch})  # noqa: S307
    except Exception:  # an expression the printer does not know
        return None


def batchnorm_base() -> type:
    """The base class of BatchNorm1d/2d/3d (whose ``forward`` handles ``momentum=None``)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


def data_dependent_exceptions() -> tuple[type[BaseException], ...]:
    """What fake tracing raises when the step's Python code or an op's output shape
    depends on tensor values (a branch on a tensor, a boolean-mask index)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (GuardOnDataDependentSymNode, DynamicOutputShapeException, DataDependentOutputException)


def unbacked_symbols(value: Any) -> set:
    """The data-dependent ("unbacked") symbols in a traced value's sizes (a tensor's
    shape, or a SymInt/SymFloat/SymBool itself); empty for anything else."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return set(free_unbacked_symbols(value))
    except Exception:  # values free_unbacked_symbols does not walk (None, strings...)
        return set()


def sym_free_symbols(value: Any) -> set:
    """The sympy symbols a SymInt / SymFloat / SymBool is made of (empty otherwise)."""
    node = getattr(value, "node", None)
    expr = getattr(node, "expr", None)
    return set(getattr(expr, "free_symbols", ()))


def record_stack_traces_of(fn: Any) -> None:
    """Make make_fx record ``fn``'s frames in ``node.meta["stack_trace"]`` (by default it
    keeps only frames of ``forward`` methods, so the training step's own lines, its loss
    and ``if`` on tensors, would have no user line)."""
    from torch.fx.proxy import _register_stack_trace_anchor

    import inspect

    _register_stack_trace_anchor(inspect.unwrap(fn))


# ----------------------------------------------------------------------------- inductor


def inductor_compile(gm: "torch.fx.GraphModule", example_inputs: Sequence[Any], *, vectorize: bool = True) -> Callable[..., Any]:
    """``gm`` compiled by inductor (through AOTAutograd, which functionalizes its in-place
    ops and writes mutated inputs back), specialized to the shapes of ``example_inputs``
    (real tensors and ints; nothing is run). The result is called with the inputs unboxed.

    The example inputs are fakeified in a fake mode with a ShapeEnv and static shapes, so
    an ``.item()`` left in the graph becomes an unbacked symbol rather than an error.
    Compiled graphs go through inductor's FX graph cache (on disk, shared across processes).
    ``vectorize=False`` makes the C++ backend emit scalar loops (no SIMD ISA), a way
    around its vectorizer's failures.
    """
    from torch._inductor.compile_fx import compile_fx

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    patch = {} if vectorize else {"cpp.simdlen": 1}  # no ISA is 1 bit wide: scalar kernels
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch._inductor.config.patch(patch), torch.no_grad():
        return compile_fx(gm, fakes)


def inductor_cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX graph cache in this process so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


# ----------------------------------------------------------------------------- symbolic sizes (compile(dynamic=True))


def fake_mode_of(value: Any) -> FakeTensorMode | None:
    """The fake mode a traced fake tensor belongs to (None for anything else)."""
    return getattr(value, "fake_mode", None) if isinstance(value, FakeTensor) else None


def sym_expr(value: Any) -> Any:
    """The sympy expression of a SymInt/SymFloat/SymBool, simplified with everything its
    ShapeEnv learned (``s60`` -> ``s3`` after a guard made them equal)."""
    node = value.node
    return node.shape_env.simplify(node.expr)


def shape_env_guards(shape_env: ShapeEnv) -> list[tuple[Any, str]]:
    """Every guard the ShapeEnv recorded so far: (sympy condition, where it was made)."""
    out = []
    for g in shape_env.guards:
        stack = getattr(g, "sloc", None) or getattr(g, "stack", None)
        out.append((g.expr, str(stack) if stack is not None else ""))
    return out


def symbol_range(shape_env: ShapeEnv, symbol: Any) -> tuple[int | None, int | None]:
    """The value range torch assumes for a size symbol (2.. without an upper bound for a
    batch dim traced with 0/1 specialization); None for an infinite end."""
    vr = shape_env.var_to_range.get(symbol)
    if vr is None:
        return None, None

    def end(x: Any) -> int | None:
        return int(x) if isinstance(x, (int, sympy.Integer)) else None  # torch's int_oo is neither

    return end(vr.lower), end(vr.upper)


def is_symbolic(value: Any) -> bool:
    """Whether ``value`` is a SymInt/SymFloat/SymBool that is not a plain constant."""
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and not value.node.is_constant() and bool(
        getattr(value.node.expr, "free_symbols", ())
    )


def new_size_symint(shape_env: ShapeEnv) -> torch.SymInt:
    """A fresh size symbol without example value (torch's "unbacked", marked size-like):
    fake kernels reason about it size-obliviously (never 0 or 1 for contiguity and
    broadcasting decisions), so no guard pins a rank's local size to its example."""
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    u = shape_env.create_unbacked_symint()
    _constrain_range_for_size(u)
    return u


def size_oblivious(on: bool = True) -> Any:
    """Within: torch reasons about backed size symbols size-obliviously (a size is never
    asked whether it is 0 or 1 by contiguity and broadcasting checks, and is not made a
    constant when it is), as it does for unbacked ones; a branch the program itself takes
    on a size is still a guard. ``on=False``: a null context."""
    if not on:
        return contextlib.nullcontext()
    from torch.fx.experimental import _config

    return _config.patch(backed_size_oblivious=True)


def true_unless_proven_false(cond: Any) -> bool:
    """A condition on sizes: a plain bool as it is; a symbolic one is True unless torch can
    prove it False, and never becomes a guard (for checks where True is the safe answer)."""
    if isinstance(cond, torch.SymBool):
        from torch.fx.experimental.symbolic_shapes import guard_or_true

        return guard_or_true(cond)
    return bool(cond)


def false_unless_proven_true(cond: Any) -> bool:
    """A condition on sizes: a plain bool as it is; a symbolic one is False unless torch
    can prove it True, and never becomes a guard (for checks where False is the safe answer)."""
    if isinstance(cond, torch.SymBool):
        from torch.fx.experimental.symbolic_shapes import guard_or_false

        return guard_or_false(cond)
    return bool(cond)


def shape_env_of(value: Any) -> ShapeEnv:
    """The ShapeEnv of a SymInt/SymFloat/SymBool (of a fake mode for a FakeTensorMode)."""
    if isinstance(value, FakeTensorMode):
        return value.shape_env
    return value.node.shape_env


def num_guards(shape_env: ShapeEnv) -> int:
    """How many guards the ShapeEnv recorded so far."""
    return len(shape_env.guards)


def example_values(shape_env: ShapeEnv) -> dict[Any, int]:
    """``{symbol: example value}`` of the ShapeEnv's backed symbols."""
    values = getattr(shape_env, "backed_var_to_val", None)
    if values is None:
        values = shape_env.var_to_val
    return {k: v for k, v in values.items() if isinstance(v, (int, sympy.Integer))}


def replaced_symbols(shape_env: ShapeEnv) -> dict[Any, Any]:
    """``{symbol: expression}`` for symbols torch replaced after a guard (``s60 -> s3``)."""
    return {k: v for k, v in getattr(shape_env, "replacements", {}).items() if isinstance(k, sympy.Symbol)}


def is_pinned(shape_env: ShapeEnv, symbol: Any) -> bool:
    """Whether torch replaced ``symbol`` by a constant (a guard fixed its value)."""
    rep = getattr(shape_env, "replacements", {}).get(symbol)
    return rep is not None and not getattr(rep, "free_symbols", None)


__all__ += ["shape_env_of", "num_guards", "example_values", "replaced_symbols", "false_unless_proven_true", "true_unless_proven_false", "size_oblivious", "new_size_symint", "is_pinned", "register_symbolic_mode", "fake_mode_of", "sym_expr", "shape_env_guards", "symbol_range", "is_symbolic"]
