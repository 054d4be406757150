"""Writing one dump folder per compile.

Layout of ``<dump_dir>/<step>-<NNN>-rank<R>/``:

=====================  =====================================================
``traced.py``          the traced single-device graph, annotated
``expanded.py``        the per-rank graph right after expansion, annotated
``pass_NN_<name>.py``  the per-rank graph after each optimization pass
``stage_<k>.py``       each pipeline stage, when there are stages
``collectives.json``   every collective with its provenance and bytes
``comm_summary.json``  count and bytes per phase, kind and mesh axis (and ``.txt``)
``memory.txt``         static memory trace: peak bytes per rank, what is alive there
``sizes.txt``          dynamic=True: each batch size symbol, each rank's local size
                       expression, the values of the last call (when known); the
                       memory trace is then counted at that call's sizes
``meta.json``          mesh, coordinate, plan source of every input, timings
``report.html``        self-contained, searchable report (open in a browser): memory
                       plot, communication by layer and module, fallbacks and
                       scheduling notes, the graphs
=====================  =====================================================

Dumps are written when ``compile(..., dump_dir=...)`` is given or the environment
variable ``SPMD_COMPILER_DUMP`` names a directory; by default only rank 0 writes
(``SPMD_COMPILER_DUMP_RANKS=all`` makes every rank write its own folder).
"""

from __future__ import annotations

import json
import logging
import os
import re
import pathlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.fx as fx

from .html import render_report
from .printer import annotated_code
from .sizes import SizeContext
from .memory import memory_trace
from .notes import Note
from .summary import comm_summary

__all__ = ["write_dump", "dump_root", "collectives_table", "should_dump"]

log = logging.getLogger(__name__)

ENV_DIR = "SPMD_COMPILER_DUMP"
ENV_RANKS = "SPMD_COMPILER_DUMP_RANKS"


def dump_root(explicit: str | os.PathLike | None) -> pathlib.Path | None:
    """The dump directory: the explicit argument, else ``$SPMD_COMPILER_DUMP``, else None."""
    value = explicit if explicit is not None else os.environ.get(ENV_DIR)
    return pathlib.Path(value) if value else None


def should_dump(rank: int) -> bool:
    return rank == 0 or os.environ.get(ENV_RANKS, "") == "all"


def collectives_table(gm: fx.GraphModule) -> list[dict[str, Any]]:
    """One JSON-able record per collective node of ``gm``."""
    out = []
    for node in gm.graph.nodes:
        c = node.meta.get("spmd_comm")
        if c is None:
            continue
        rec = {k: v for k, v in c.items() if isinstance(v, (str, int, float, bool, list, type(None)))}
        rec["node"] = node.name
        rec["phase"] = node.meta.get("spmd_phase", "?")
        out.append(rec)
    return out


def _next_folder(root: pathlib.Path, name: str, rank: int) -> pathlib.Path:
    name = re.sub(r"[^0-9A-Za-z_.-]", "_", name) or "step"  # a step's __name__ may hold '/', '<lambda>'...
    root.mkdir(parents=True, exist_ok=True)
    existing = [p.name for p in root.glob(f"{name}-*-rank{rank}")]
    n = 0
    while f"{name}-{n:03d}-rank{rank}" in existing:
        n += 1
    folder = root / f"{name}-{n:03d}-rank{rank}"
    folder.mkdir()
    return folder


def write_dump(
    root: str | os.PathLike,
    step: Any,
    *,
    name: str = "step",
    expanded_text: str | None = None,
    pass_texts: Sequence[tuple[str, str]] = (),
    stages: Sequence[tuple[str, fx.GraphModule]] = (),
    info: dict[str, Any] | None = None,
    sizes: Sequence[int] | None = None,
    notes: Sequence[Note] | None = None,
) -> pathlib.Path:
    """Write the dump of one compile (an ExpandedStep) and return its folder.

    ``step.gm`` is the graph that runs (after the passes); the summary, collectives and
    report describe it. ``expanded_text`` is the annotated graph before the passes (taken
    before they changed it; default: ``step.gm``), ``pass_texts`` one (name, annotated
    graph) per pass. A symbolic program (dynamic=True) also gets ``sizes.txt``: each
    size symbol, each rank's local size expression and, given ``sizes`` (the global
    sizes of the last call, in the order of ``step.size_symbols``), their values.
    ``notes``: the node notes (:mod:`.notes`) of the expanded program and of every pass's
    output, as ``expanded_text`` and ``pass_texts`` print them, for the report (default:
    ``step.gm``'s).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    folder = _next_folder(pathlib.Path(root), name, rank)
    final = step.gm
    ctx = SizeContext(step, sizes) if getattr(step, "size_symbols", None) else None
    if ctx is not None:
        (folder / "sizes.txt").write_text("\n".join(ctx.section()) + "\n")
    (folder / "traced.py").write_text(annotated_code(step.traced.gm, title=f"{name}: traced single-device graph", traced=True))
    expanded = expanded_text or annotated_code(step.gm, title=f"{name}: per-rank graph after expansion (coordinate {step.mctx.coordinate})",
                                               sizes=ctx)
    (folder / "expanded.py").write_text(expanded)
    for i, (pass_name, text) in enumerate(pass_texts):
        (folder / f"pass_{i:02d}_{pass_name}.py").write_text(text)
    for stage_name, gm in stages:
        (folder / f"stage_{stage_name}.py").write_text(annotated_code(gm, title=f"{name}: pipeline stage {stage_name}"))
    summary = comm_summary(final)
    (folder / "comm_summary.json").write_text(summary.to_json())
    (folder / "comm_summary.txt").write_text(summary.table() + "\n")
    backend = dist.get_backend() if dist.is_initialized() else None
    memory = memory_trace(final, backend=backend, sizes=ctx if ctx is not None and ctx.values is not None else None)
    at = _memory_sizes(ctx)
    (folder / "memory.txt").write_text((f"{at}\n" if at else "") + memory.table(top=20) + "\n")
    (folder / "collectives.json").write_text(json.dumps(collectives_table(final), indent=1))
    meta = {
        "name": name,
        "rank": rank,
        "mesh": dict(zip(step.mctx.axis_names, step.mctx.shape)),
        "coordinate": list(step.mctx.coordinate),
        "rank_independent": step.rank_independent,
        "timings": step.timings,
        "nodes": {"traced": len(step.traced.gm.graph.nodes), "expanded": len(step.gm.graph.nodes), "final": len(final.graph.nodes)},
        "inputs": [
            {"name": inp.label, "kind": inp.kind, "global_shape": list(inp.shape), "placements": str(list(spec.placements)), "from": src}
            for inp, spec, src in zip(step.traced.inputs, step.input_specs, step.plan_sources or [""] * len(step.input_specs))
        ],
        "passes": [p for p, _ in pass_texts],
        **({"sizes": ctx.as_json()} if ctx is not None else {}),
        "memory": {"peak_bytes": memory.peak_bytes, "peak_node": memory.peak_node, "input_bytes": memory.input_bytes,
                   **({"at": at} if at else {})},
        **(info or {}),
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    (folder / "report.html").write_text(render_report(step, summary, title=f"spmd-compiler: {name}", info=info, sizes=ctx,
                                                         memory=memory, memory_at=at, notes=notes))
    log.info("wrote dump %s", folder)
    return folder


def _memory_sizes(ctx: SizeContext | None) -> str:
    """The first line of a symbolic program's memory.txt: the sizes its bytes are for."""
    if ctx is None:
        return ""
    if ctx.values is None:
        return "batch sizes: the trace's example sizes (rank 0's local sizes); no call's sizes were given"
    return f"batch sizes of the call: {ctx.call_text()}"
