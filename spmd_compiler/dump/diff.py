"""Diffing two dumps: which collectives appeared, vanished or changed size.

Collectives are matched by what they do, not by node name (names shift between
compiles): the traced op that needed them, the value moved, kind, mesh axis, placement
transition and phase. Two dumps of the same step under two plans, or before and after a
pass, compare directly.
"""

from __future__ import annotations

import json
import pathlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .format import format_bytes

__all__ = ["DumpDiff", "diff_dumps", "load_collectives"]


def load_collectives(folder: str | pathlib.Path, graph: str | None = None) -> list[dict[str, Any]]:
    """Collectives of a dump folder (its final graph)."""
    path = pathlib.Path(folder)
    if not (path / "collectives.json").exists():
        raise FileNotFoundError(f"{path} is not a dump folder (no collectives.json); expected a folder written by spmd-compiler")
    return json.loads((path / "collectives.json").read_text())


def _key(c: dict[str, Any]) -> tuple:
    return (c.get("phase"), c.get("kind"), c.get("axis_name"), c.get("origin"), c.get("value"), c.get("transition"))


@dataclass
class DumpDiff:
    appeared: list[dict[str, Any]] = field(default_factory=list)
    vanished: list[dict[str, Any]] = field(default_factory=list)
    changed: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    totals: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)  # kind/axis -> (count a, count b, bytes a, bytes b)

    @property
    def empty(self) -> bool:
        return not (self.appeared or self.vanished or self.changed)

    def text(self) -> str:
        lines = []
        lines.append(f"{'collective':<22} {'count A':>8} {'count B':>8} {'bytes A':>11} {'bytes B':>11}")
        for k, (ca, cb, ba, bb) in sorted(self.totals.items()):
            lines.append(f"{k:<22} {ca:>8} {cb:>8} {format_bytes(ba):>11} {format_bytes(bb):>11}")

        def line(c: dict[str, Any]) -> str:
            return f"{c['kind']} on {c['axis_name']} ({c['phase']}): {c.get('value')} {c.get('transition')} for {c.get('origin')}, {format_bytes(c['bytes'])}"

        if self.vanished:
            lines.append(f"\nvanished ({len(self.vanished)}):")
            lines += [f"  - {line(c)}" for c in self.vanished]
        if self.appeared:
            lines.append(f"\nappeared ({len(self.appeared)}):")
            lines += [f"  + {line(c)}" for c in self.appeared]
        if self.changed:
            lines.append(f"\nchanged size ({len(self.changed)}):")
            lines += [f"  ~ {line(a)} -> {format_bytes(b['bytes'])}" for a, b in self.changed]
        if self.empty:
            lines.append("\nno collective differs")
        return "\n".join(lines)


def diff_dumps(a: str | pathlib.Path, b: str | pathlib.Path) -> DumpDiff:
    """Compare the collectives of dump folders ``a`` and ``b``."""
    ca, cb = load_collectives(a), load_collectives(b)
    by_a: dict[tuple, list] = defaultdict(list)
    by_b: dict[tuple, list] = defaultdict(list)
    for c in ca:
        by_a[_key(c)].append(c)
    for c in cb:
        by_b[_key(c)].append(c)
    out = DumpDiff()
    for key in sorted(set(by_a) | set(by_b), key=str):
        la, lb = by_a.get(key, []), by_b.get(key, [])
        for x, y in zip(la, lb):
            if x["bytes"] != y["bytes"]:
                out.changed.append((x, y))
        out.vanished += la[len(lb):]
        out.appeared += lb[len(la):]
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for c in ca:
        t = totals[f"{c['kind']}/{c['axis_name']}"]
        t[0] += 1
        t[2] += c["bytes"]
    for c in cb:
        t = totals[f"{c['kind']}/{c['axis_name']}"]
        t[1] += 1
        t[3] += c["bytes"]
    out.totals = {k: tuple(v) for k, v in totals.items()}
    return out
