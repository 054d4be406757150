"""Stage 2: expand a traced step over a DeviceMesh (see :func:`expand`)."""

from __future__ import annotations

import time
from typing import Any

from . import rules  # noqa: F401  (registers the per-op rules)
from .cache import ExpansionCache
from .dispatch import ExpandContext, TensorArg, generic_expand, replicate_fallback
from .registry import register_rule
from .values import DSymInt, DValue, MeshContext

__all__ = [
    "expand",
    "DSymInt",
    "DValue",
    "MeshContext",
    "ExpansionCache",
    "register_rule",
    "generic_expand",
    "replicate_fallback",
    "ExpandContext",
    "TensorArg",
]


def expand(
    traced: Any,
    mesh: Any,
    plan: Any = None,
    *,
    coordinate: tuple[int, ...] | None = None,
    fallback: str = "replicate",
    cache: ExpansionCache | None = None,
    reduce_partial_outputs: bool = True,
) -> Any:
    """Expand ``traced`` (from :func:`spmd_compiler.trace`) into the per-rank program.

    Args:
        traced: the TracedStep.
        mesh: a ``DeviceMesh`` (1-D or 2-D).
        plan: a :class:`spmd_compiler.Plan` (default: parameters Replicate, batch
            Shard(0) on the first mesh axis, i.e. data parallel).
        coordinate: expand for the rank at this mesh coordinate (default: this process's).
            Only matters when some dim is sharded unevenly.
        fallback: ``"replicate"`` runs ops without a sharding strategy on gathered
            inputs (with a warning); ``"error"`` raises UnsupportedOpError instead.
        cache: an ExpansionCache to share recipes across expansions.
        reduce_partial_outputs: reduce Partial step outputs to Replicate.

    Returns an :class:`~spmd_compiler.rebuild.ExpandedStep`.
    """
    from ..plan import Plan
    from ..rebuild.finalize import finalize
    from .expander import expand_graph

    if plan is None:
        plan = Plan()
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a spmd_compiler.Plan, got {type(plan).__name__}")
    mctx = MeshContext.of(mesh, coordinate)
    resolved = plan.resolve(traced, mesh)
    t0 = time.perf_counter()
    ex = expand_graph(
        traced, mctx, resolved.placements, fallback=fallback, cache=cache, fsdp_axes=plan.fsdp_axis_indices(mesh),
        activation_sharding=plan.activation_sharding,
    )
    t1 = time.perf_counter()
    step = finalize(ex, reduce_partial_outputs=reduce_partial_outputs)
    t2 = time.perf_counter()
    step.plan_sources = resolved.sources
    step.timings = {"trace": traced.trace_seconds, "expand": t1 - t0, "rebuild": t2 - t1}
    return step
