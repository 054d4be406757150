"""Reading a pipelined step's schedule as it ran: text timeline, Chrome trace, bubbles.

Every rank records one :class:`~.runtime.Span` per action (``F``, ``B``, ``O``, ``R``
for a checkpointed forward recomputed before its backward, ``send``/``recv`` for the
point-to-point transfers). Gathered over ranks, they render as

* a text Gantt chart, one row per rank, one character per time slot::

      rank 0 |000011112222    3333O|  busy 81%  bubble 19%

  digits are the micro-batch of a forward, letters ``a b c ...`` the micro-batch of a
  backward (``a`` = 0), ``r`` a recompute, ``O`` the optimizer, ``~`` waiting in a
  receive, blank idle. The bubble is the share of the step a rank spends neither
  computing nor sending: with GPipe on ``p`` stages and ``m`` micro-batches of equal cost
  it tends to ``(p - 1) / (m + p - 1)``.
* Chrome-trace JSON (open in https://ui.perfetto.dev or chrome://tracing).
"""

from __future__ import annotations

import string
from typing import Any, Sequence

__all__ = ["format_timeline", "chrome_trace_events", "bubble_fractions", "COMPUTE_KINDS"]

COMPUTE_KINDS = ("G", "F", "B", "O", "R")


def _as_dict(span: Any) -> dict:
    return span if isinstance(span, dict) else dict(span.__dict__)


def _bounds(spans_by_rank: Sequence[Sequence[Any]]) -> tuple[float, float]:
    all_spans = [_as_dict(s) for row in spans_by_rank for s in row]
    if not all_spans:
        return 0.0, 0.0
    return min(s["start"] for s in all_spans), max(s["end"] for s in all_spans)


def bubble_fractions(spans_by_rank: Sequence[Sequence[Any]]) -> list[float]:
    """Per rank: 1 - (time in G/F/B/O/R) / (step wall time, first start to last end over
    all ranks)."""
    t0, t1 = _bounds(spans_by_rank)
    total = max(t1 - t0, 1e-12)
    out = []
    for row in spans_by_rank:
        busy = sum(s["end"] - s["start"] for s in map(_as_dict, row) if s["kind"] in COMPUTE_KINDS)
        out.append(max(0.0, 1.0 - busy / total))
    return out


def _char(span: dict) -> str:
    kind, mb = span["kind"], span["microbatch"]
    if kind == "F":
        return str(mb % 10) if mb is not None else "F"
    if kind == "B":
        return string.ascii_lowercase[mb % 26] if mb is not None else "B"
    if kind == "R":
        return "r"
    if kind in ("O", "G"):
        return kind
    if kind == "recv":
        return "~"
    return ""  # sends are asynchronous: they take no visible time


def format_timeline(spans_by_rank: Sequence[Sequence[Any]], *, width: int = 72) -> str:
    """Text Gantt chart of one step (see the module docstring for the legend)."""
    t0, t1 = _bounds(spans_by_rank)
    total = max(t1 - t0, 1e-12)
    bubbles = bubble_fractions(spans_by_rank)
    lines = [f"step {total * 1e3:.2f} ms, {width} slots of {total * 1e3 / width:.3f} ms; "
             "digits: forward of micro-batch n, letters: backward (a = 0), r: recompute, G: parameter gathers, O: optimizer, ~: receive wait"]
    for rank, row in enumerate(spans_by_rank):
        cells = [" "] * width
        # compute spans drawn last so they win over receive waits in a shared slot
        for s in sorted(map(_as_dict, row), key=lambda s: s["kind"] in COMPUTE_KINDS):
            c = _char(s)
            if not c:
                continue
            a = int((s["start"] - t0) / total * width)
            b = max(a + 1, int(round((s["end"] - t0) / total * width)))
            for i in range(a, min(b, width)):
                cells[i] = c
        lines.append(f"rank {rank:<3}|{''.join(cells)}|  busy {100 * (1 - bubbles[rank]):3.0f}%  bubble {100 * bubbles[rank]:3.0f}%")
    return "\n".join(lines)


def chrome_trace_events(spans_by_rank: Sequence[Sequence[Any]]) -> dict:
    """The Chrome-trace JSON object: one process row per rank, one event per span."""
    t0, _ = _bounds(spans_by_rank)
    events: list[dict] = []
    for rank, row in enumerate(spans_by_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for s in map(_as_dict, row):
            label = f"{s['kind']}{s['stage']}" + (f" mb{s['microbatch']}" if s["microbatch"] is not None else "")
            events.append({
                "name": label, "cat": s["kind"], "ph": "X", "pid": rank, "tid": 0 if s["kind"] in COMPUTE_KINDS else 1,
                "ts": (s["start"] - t0) * 1e6, "dur": max(1.0, (s["end"] - s["start"]) * 1e6),
                "args": {"detail": s["detail"], "stage": s["stage"], "microbatch": s["microbatch"]},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}
