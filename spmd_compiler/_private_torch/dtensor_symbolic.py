"""DTensor on symbolic sizes (``dynamic=True``): the patches that let DTensor's sharding
propagation, shardability checks and redistribution costs run on SymInt shapes without
recording a guard, and the symbolic block-count placement (:func:`symbolic_split`).

Touches ``torch.distributed.tensor._collective_utils`` (``spec_to_bytes``,
``redistribute_cost``), ``_ops.utils`` (``is_tensor_shardable``, ``is_tensor_evenly_shardable*``)
and ``placement_types._StridedShard``, patched in every DTensor module that holds them for
the length of one propagation. Checked against torch 2.13.0 and 2.14.1.

Module state, defined here only: ``_MODES_BY_ENV`` (fake mode of each ShapeEnv, see
:func:`register_symbolic_mode`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Shard, _StridedShard
from torch._subclasses.fake_tensor import FakeTensorMode

from .shapes import is_symbolic

__all__ = ["SYMBOLIC_SPLIT_BASE", "symbolic_split", "split_period", "register_symbolic_mode"]

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


def _spec_leaves(args: Any, kwargs: Any) -> Iterator[DTensorSpec]:
    from torch.utils import _pytree as pytree

    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, DTensorSpec):
            yield leaf


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
        # a strategy's target spec may have no tensor_meta: it has the current one's shape
        shape = current.shape if current.tensor_meta is not None else None
        a, b = _example_split(current, shape), _example_split(target, shape)
        try:
            return _COSTS[(a, b)]
        except KeyError:
            pass
        except TypeError:  # an unhashable spec: no cache
            return cost(a, b)
        if len(_COSTS) >= _COSTS_MAX:
            _COSTS.clear()
        got = _COSTS[(a, b)] = cost(a, b)
        return got

    with _patched({"spec_to_bytes": (cu.spec_to_bytes, spec_to_bytes), "is_tensor_shardable": (shardable, is_tensor_shardable),
                   "redistribute_cost": (cost, redistribute_cost),
                   "is_tensor_evenly_shardable_on_dim": (even_on_dim, is_tensor_evenly_shardable_on_dim),
                   "is_tensor_evenly_shardable": (even, is_tensor_evenly_shardable)}), mode:
        yield



# redistribute_cost of concrete (example-sized) spec pairs: under symbolic tracing DTensor
# skips its own cache (_are_we_tracing) and plans a 2-D mesh's steps anew every time, about
# 18,000 times for a 2-D GPT-2 compile (3/4 of its time); a pure function of the two specs
_COSTS: dict[tuple[Any, Any], float] = {}
_COSTS_MAX = 65536


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


def _example_split(spec: DTensorSpec, shape: Any = None) -> DTensorSpec:
    """``spec`` with every :func:`symbolic_split` given its example block count (costs
    only: DTensor's cost model walks the blocks); ``shape``: the global shape when
    ``spec`` has no tensor_meta (a strategy's target spec)."""
    if not any(split_period(p) is not None for p in spec.placements):
        return spec
    if spec.tensor_meta is not None:
        shape = spec.shape
    placements = []
    for p in spec.placements:
        period = split_period(p)
        if period is not None:
            blocks = int(shape[p.dim]) // period if shape is not None else 2
            p = _StridedShard(p.dim, split_factor=max(2, blocks))
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
