"""Communication summary of a per-rank graph: count and bytes per collective kind,
mesh axis and phase (forward, backward, optimizer, output), per rank per step; and per
process group (mesh axis), its launches: how many are buckets (one collective fused from
several, gradient buckets and FSDP unit gathers) and how many values those carry."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from .format import format_bytes

__all__ = ["CommRow", "GroupRow", "CommSummary", "comm_summary", "format_bytes"]

PHASE_ORDER = ("forward", "backward", "optimizer", "output")


@dataclass(frozen=True)
class CommRow:
    phase: str
    kind: str
    axis: str
    count: int
    bytes: int
    wire_bytes: int


@dataclass(frozen=True)
class GroupRow:
    """Collectives of one process group (``axis``: its mesh axis or axes) per step:
    ``launches`` in all, of which ``buckets`` fuse several values (``bucketed`` values in
    all); ``launches - buckets`` carry one value each."""

    axis: str
    launches: int
    buckets: int
    bucketed: int


@dataclass
class CommSummary:
    """Rows sorted by phase, kind, axis; ``total_*`` over all rows; ``groups``: one
    :class:`GroupRow` per process group, sorted by axis.

    ``bytes`` is the size of the collective's buffer (the gathered output for all_gather,
    the input otherwise); ``wire_bytes`` what one rank sends in a ring implementation.
    """

    rows: list[CommRow] = field(default_factory=list)
    groups: list[GroupRow] = field(default_factory=list)

    @property
    def total_count(self) -> int:
        return sum(r.count for r in self.rows)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def total_wire_bytes(self) -> int:
        return sum(r.wire_bytes for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [r.__dict__ for r in self.rows],
            "total": {"count": self.total_count, "bytes": self.total_bytes, "wire_bytes": self.total_wire_bytes},
            "groups": [g.__dict__ for g in self.groups],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        head = f"{'phase':<10} {'collective':<15} {'axis':<6} {'count':>6} {'bytes/rank':>12} {'sent/rank':>12}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r.phase:<10} {r.kind:<15} {r.axis:<6} {r.count:>6} {format_bytes(r.bytes):>12} {format_bytes(r.wire_bytes):>12}")
        lines.append("-" * len(head))
        lines.append(f"{'total':<10} {'':<15} {'':<6} {self.total_count:>6} {format_bytes(self.total_bytes):>12} {format_bytes(self.total_wire_bytes):>12}")
        if self.groups:
            lines += ["", f"{'group':<10} {'launches':>8} {'buckets':>8} {'values in buckets':>18} {'single':>7}"]
            for g in self.groups:
                lines.append(f"{g.axis:<10} {g.launches:>8} {g.buckets:>8} {g.bucketed:>18} {g.launches - g.buckets:>7}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def comm_summary(gm: fx.GraphModule) -> CommSummary:
    """Summarize the collectives of a per-rank graph (nodes with ``spmd_comm`` meta)."""
    acc: dict[tuple[str, str, str], list[int]] = {}
    groups: dict[str, list[int]] = {}
    for node in gm.graph.nodes:
        comm = node.meta.get("spmd_comm")
        if comm is None:
            continue
        members = len(comm.get("bucket") or ())
        group = groups.setdefault(comm["axis_name"], [0, 0, 0])
        group[0] += 1
        group[1] += members > 1
        group[2] += members if members > 1 else 0
        key = (node.meta.get("spmd_phase", "?"), comm["kind"], comm["axis_name"])
        row = acc.setdefault(key, [0, 0, 0])
        row[0] += 1
        row[1] += comm["bytes"]
        row[2] += comm["wire_bytes"]
    order = {p: i for i, p in enumerate(PHASE_ORDER)}
    rows = [CommRow(k[0], k[1], k[2], *v) for k, v in sorted(acc.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1], kv[0][2]))]
    return CommSummary(rows, [GroupRow(axis, *v) for axis, v in sorted(groups.items())])
