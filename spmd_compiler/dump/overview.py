"""A short text overview of dump folders, for ``python -m spmd_compiler explain``.

For each folder (one compiled program): why it was compiled, the mesh, the collectives
per rank per step grouped by phase, kind, mesh axis and reason (count and bytes), the
totals, the static memory peak per rank and where the report is. Read from the folder's
``meta.json`` and ``collectives.json`` only, so any dump folder can be summarized.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

from .format import format_bytes
from .summary import PHASE_ORDER

__all__ = ["folder_overview", "explain_overview"]

_REASON_WIDTH = 110


def _reason(c: dict[str, Any]) -> str:
    text = str(c.get("why") or c.get("reason") or "")
    return text if len(text) <= _REASON_WIDTH else text[: _REASON_WIDTH - 3] + "..."


def folder_overview(folder: str | pathlib.Path) -> list[str]:
    """The overview lines of one dump folder."""
    folder = pathlib.Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    comms = json.loads((folder / "collectives.json").read_text())
    why = meta.get("compiled because")
    lines = [f"{folder.name}" + (f" (compiled: {why})" if why else "")]
    total = sum(c.get("bytes", 0) for c in comms)
    wire = sum(c.get("wire_bytes", 0) for c in comms)
    mem = meta.get("memory") or {}
    peak = f"static peak {format_bytes(mem['peak_bytes'])} per rank at {mem.get('peak_node', '?')}" if "peak_bytes" in mem else ""
    lines.append(f"  mesh {meta.get('mesh')}: {len(comms)} collective{'s' if len(comms) != 1 else ''} per rank per step, "
                 f"{format_bytes(total)} per rank ({format_bytes(wire)} sent per rank, ring)" + (f"; {peak}" if peak else ""))
    groups: dict[tuple[str, str, str, str], list[int]] = {}
    for c in comms:
        g = groups.setdefault((str(c.get("phase", "?")), str(c.get("kind", "?")), str(c.get("axis_name", "?")), _reason(c)), [0, 0])
        g[0] += 1
        g[1] += int(c.get("bytes", 0))
    order = {p: i for i, p in enumerate(PHASE_ORDER)}
    for (phase, kind, axis, reason), (count, nbytes) in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1:])):
        lines.append(f"    {phase:<9} {kind:<14} {axis:<5} x{count:<3} {format_bytes(nbytes):>11}  {reason}")
    lines.append(f"  report: {folder / 'report.html'}")
    return lines


def explain_overview(folders: Sequence[pathlib.Path], *, script: str, world_size: int) -> str:
    """What ``explain`` prints after the script: every program it compiled."""
    n = len(folders)
    head = (f"explain: {script} compiled {n} program{'s' if n != 1 else ''} on a fake process group of {world_size} ranks "
            f"(nothing was communicated and no step ran; the dumps are rank 0's)")
    body = []
    for folder in folders:
        body.append("")
        body.extend(folder_overview(folder))
    return "\n".join([head, *body])
