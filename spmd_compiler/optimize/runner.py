"""Running optimization passes over the per-rank graph.

Every pass has the shape ``fn(gm, *, <options>) -> gm``. :func:`run_passes` applies a
list of them in order, skips the disabled ones by name, logs each with its time and the
number of nodes and collectives before and after, can hand each intermediate graph to a
callback (dumps write one file per pass), and re-raises a failure naming the pass.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from ..errors import SpmdError, describe_node
from ..expand.values import placements_text

__all__ = ["PassSpec", "PassRecord", "run_passes", "DEFAULT_PASSES", "default_passes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassSpec:
    """A pass and its keyword options."""

    name: str
    fn: Callable[..., fx.GraphModule]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    collectives_before: int
    collectives_after: int


def _count(gm: fx.GraphModule) -> tuple[int, int]:
    nodes = list(gm.graph.nodes)
    return len(nodes), sum(1 for n in nodes if "spmd_comm" in n.meta)


def _named_node(gm: fx.GraphModule, e: BaseException, text: str) -> fx.Node | None:
    """The node a pass failure is about: the one the exception carries, else the first
    node of ``gm`` the message names (``Node 'add_3'``, ``Argument 't_1'``)."""
    node = getattr(e, "spmd_node", None) or getattr(e, "node", None)
    if isinstance(node, fx.Node):
        return node
    names = {n.name: n for n in gm.graph.nodes}
    return next((names[m] for m in re.findall(r"'([A-Za-z_][\w.]*)'", text) if m in names), None)


def _node_context(node: fx.Node | None) -> str:
    """The node, its placements and where it came from, for a pass failure."""
    if node is None:
        return ""
    out = describe_node(node)
    spec = node.meta.get("spmd_spec")
    if spec is not None:
        out += f"\n  placements: {placements_text(spec.placements)} {list(spec.shape)}"
    origin = node.meta.get("spmd_origin")
    if isinstance(origin, dict) and origin.get("node"):
        out += f"\n  expanded from: {origin['node']} ({origin.get('op')})"
    return out


def run_passes(
    gm: fx.GraphModule,
    passes: Sequence[PassSpec],
    *,
    disabled: Sequence[str] = (),
    after_pass: Callable[[str, fx.GraphModule], None] | None = None,
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Apply ``passes`` to ``gm`` in order; returns the final graph and one record per pass run."""
    known = {p.name for p in passes}
    unknown = [d for d in disabled if d not in known]
    if unknown:
        raise ValueError(f"cannot disable unknown passes {unknown}; the passes are {sorted(known)}")
    records = []
    for spec in passes:
        if spec.name in disabled:
            log.info("pass %s: disabled", spec.name)
            continue
        n0, c0 = _count(gm)
        start = time.perf_counter()
        try:
            gm = spec.fn(gm, **spec.options)
            gm.graph.lint()  # the pass's output is checked under its name too
            gm.recompile()
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            first = first if len(first) <= 300 else first[:297] + "..."  # lint errors embed the whole graph
            node = _named_node(gm, e, first)
            # passes take any graph expansion makes: whatever the plan, a failure is ours
            raise SpmdError(
                f"optimization pass {spec.name!r} failed: {type(e).__name__}: {first}; this is a bug in spmd-compiler, "
                f"please report it; fix for now: passes_disabled=[{spec.name!r}] compiles without this pass"
                + _node_context(node)
            ) from e
        elapsed = time.perf_counter() - start
        n1, c1 = _count(gm)
        records.append(PassRecord(spec.name, elapsed, n0, n1, c0, c1))
        log.info("pass %s: %.3fs, %d -> %d nodes, %d -> %d collectives", spec.name, elapsed, n0, n1, c0, c1)
        if after_pass is not None:
            after_pass(spec.name, gm)
    return gm, records


def default_passes(
    *, bucket_mb: float = 25.0, first_bucket_mb: float | None = 1.0, overlap: bool = True, prefetch: int = 2
) -> list[PassSpec]:
    """The default pipeline: remove redundant collectives, bucket gradient reductions,
    gather FSDP parameters per module unit, overlap communication with compute (issue
    early, wait late), then move compute into the gaps (:mod:`.schedule`)."""
    from .bucketing import bucket_gradients_pass
    from .gathers import bucket_parameter_gathers_pass
    from .overlap import overlap_pass
    from .redundant import remove_redundant_collectives_pass
    from .schedule import schedule_for_overlap_pass

    out = [
        PassSpec("remove_redundant_collectives", remove_redundant_collectives_pass),
        PassSpec("bucket_gradients", bucket_gradients_pass, {"bucket_mb": bucket_mb, "first_bucket_mb": first_bucket_mb}),
        PassSpec("bucket_parameter_gathers", bucket_parameter_gathers_pass),
    ]
    if overlap:
        out.append(PassSpec("overlap", overlap_pass, {"prefetch": prefetch}))
        out.append(PassSpec("schedule", schedule_for_overlap_pass))
    return out


DEFAULT_PASSES = ("remove_redundant_collectives", "bucket_gradients", "bucket_parameter_gathers", "overlap", "schedule")
