"""Running optimization passes over the per-rank graph.

Every pass has the shape ``fn(gm, *, <options>) -> gm``. :func:`run_passes` applies a
list of them in order, skips the disabled ones by name, logs each with its time and the
number of nodes and collectives before and after, can hand each intermediate graph to a
callback (dumps write one file per pass), and re-raises a failure naming the pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from ..errors import SpmdError

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
            raise SpmdError(
                f"optimization pass {spec.name!r} failed: {type(e).__name__}: {first}; this is a bug in spmd-compiler, "
                f"please report it; fix for now: passes_disabled=[{spec.name!r}] compiles without this pass"
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
