"""Pictures for the HTML report, as inline SVG (no script, no network).

:func:`memory_svg` draws a :class:`~spmd_compiler.dump.memory.MemoryTrace`: bytes alive
per rank (y) at each node of the program, in program order (x), over bands that shade the
phases (forward, backward, optimizer, output), with the inputs' bytes as a dashed line,
the peak marked and named, and a tick under the axis at every collective.
:func:`bar_html` is the small bar a table row draws its share with.
"""

from __future__ import annotations

import html
from typing import Any

import torch.fx as fx

from .format import format_bytes

__all__ = ["memory_svg", "bar_html", "PHASE_COLORS"]

PHASE_COLORS = {"forward": "#e3eefc", "backward": "#fdebd3", "optimizer": "#e0f2e0", "output": "#eeeeee"}
_W, _H = 960, 280
_L, _R, _T, _B = 78, 16, 30, 46
_MAX_POINTS = 1500


def _nice(x: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k (times 1024^j for bytes) at or above ``x``."""
    if x <= 0:
        return 1.0
    unit = 1.0
    while x / unit >= 1024:
        unit *= 1024
    v = x / unit
    scale = 1.0
    while v > 10:
        v /= 10
        scale *= 10
    for step in (1, 2, 2.5, 5, 10):
        if v <= step:
            return step * scale * unit
    return 10 * scale * unit


def _points(live: list[int]) -> list[tuple[int, int]]:
    """``(index, bytes)`` of the curve, at most :data:`_MAX_POINTS` (each kept point the
    highest of the nodes it stands for, so the peak survives)."""
    n = len(live)
    if n <= _MAX_POINTS:
        return list(enumerate(live))
    per = n / _MAX_POINTS
    out = []
    for k in range(_MAX_POINTS):
        lo, hi = int(k * per), max(int((k + 1) * per), int(k * per) + 1)
        i = max(range(lo, min(hi, n)), key=lambda j: live[j])
        out.append((i, live[i]))
    return out


def memory_svg(trace: Any, gm: fx.GraphModule, *, label: str = "") -> str:
    """The memory-over-time plot of ``trace`` (the memory trace of ``gm``) as an ``<svg>``."""
    live = list(trace.live)
    nodes = list(gm.graph.nodes)
    if not live or len(live) != len(nodes):
        return "<p class='muted'>no memory trace</p>"
    n = len(live)
    top = _nice(max(trace.peak_bytes, 1) * 1.08)
    plot_w, plot_h = _W - _L - _R, _H - _T - _B

    def x(i: float) -> float:
        return _L + (i / max(n - 1, 1)) * plot_w

    def y(b: float) -> float:
        return _T + (1 - b / top) * plot_h

    e = html.escape
    out = [f'<svg class="plot" role="img" viewBox="0 0 {_W} {_H}" xmlns="http://www.w3.org/2000/svg" '
           f'font-family="Helvetica,Arial,sans-serif" font-size="12">',
           f"<title>{e(label or 'memory per rank')}</title>"]
    # phase bands, each phase named over its widest band
    bands: list[tuple[int, int, str]] = []
    start, phase = 0, str(nodes[0].meta.get("spmd_phase", "forward"))
    for i in range(1, n + 1):
        p = str(nodes[i].meta.get("spmd_phase", phase)) if i < n else None
        if p != phase:
            bands.append((start, i, phase))
            start, phase = i, p
    widest = {ph: max((b for b in bands if b[2] == ph), key=lambda b: b[1] - b[0]) for _, _, ph in bands}
    for start, end, phase in bands:
        x0, x1 = x(start - 0.5 if start else 0), x(end - 0.5 if end < n else n - 1)
        out.append(f'<rect x="{x0:.1f}" y="{_T}" width="{max(x1 - x0, 0.5):.1f}" height="{plot_h}" '
                   f'fill="{PHASE_COLORS.get(phase, "#f6f6f6")}"><title>{e(phase)}: nodes {start} to {end - 1}</title></rect>')
        if widest[phase] == (start, end, phase) and x1 - x0 > 50:
            out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{_T - 8}" text-anchor="middle" fill="#555">{e(phase)}</text>')
    # grid and y axis
    for k in range(5):
        b = top * k / 4
        out.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{y(b):.1f}" y2="{y(b):.1f}" stroke="#ccc" stroke-width="0.6"/>')
        out.append(f'<text x="{_L - 6}" y="{y(b) + 4:.1f}" text-anchor="end" fill="#333">{e(format_bytes(int(b)))}</text>')
    out.append(f'<line x1="{_L}" x2="{_L}" y1="{_T}" y2="{_T + plot_h}" stroke="#666"/>')
    out.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{_T + plot_h}" y2="{_T + plot_h}" stroke="#666"/>')
    for k in range(6):
        i = round((n - 1) * k / 5)
        out.append(f'<text x="{x(i):.1f}" y="{_T + plot_h + 28}" text-anchor="middle" fill="#333">{i}</text>')
    out.append(f'<text x="{_L + plot_w / 2:.1f}" y="{_H - 4}" text-anchor="middle" fill="#555">'
               f"node of the per-rank program (program order); ticks: collectives</text>")
    # collectives: ticks under the axis
    for i, node in enumerate(nodes):
        comm = node.meta.get("spmd_comm")
        if comm is not None:
            out.append(f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{_T + plot_h + 2}" y2="{_T + plot_h + 12}" stroke="#c0392b" '
                       f'stroke-width="1.5"><title>{e(node.name)}: {e(comm["kind"])} on {e(comm["axis_name"])}, '
                       f"{e(format_bytes(comm['bytes']))}</title></line>")
    # inputs held for the whole step
    inputs = trace.total_input_bytes
    out.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{y(inputs):.1f}" y2="{y(inputs):.1f}" stroke="#7f8c8d" stroke-dasharray="5,4"/>')
    out.append(f'<text x="{_W - _R - 4}" y="{y(inputs) + 15:.1f}" text-anchor="end" fill="#555">'
               f"inputs {e(format_bytes(inputs))}, held for the whole step</text>")
    # the curve (a step function: a value is alive from its node on)
    pts = _points(live)
    path = [f"M{x(pts[0][0]):.1f},{y(pts[0][1]):.1f}"]
    for (i0, b0), (i1, b1) in zip(pts, pts[1:]):
        path.append(f"H{x(i1):.1f}V{y(b1):.1f}")
    out.append(f'<path d="{"".join(path)}" fill="none" stroke="#1f5fbf" stroke-width="1.6"/>')
    # the peak
    pi = next(i for i, b in enumerate(live) if b == trace.peak_bytes)
    px, py = x(pi), y(trace.peak_bytes)
    anchor = "end" if px > _L + plot_w * 0.6 else "start"
    dx = -8 if anchor == "end" else 8
    out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#c0392b"/>')
    out.append(f'<text x="{px + dx:.1f}" y="{py + 4:.1f}" text-anchor="{anchor}" fill="#c0392b" font-weight="bold">'
               f"peak {e(format_bytes(trace.peak_bytes))} at {e(trace.peak_node)} ({e(trace.peak_phase)})</text>")
    out.append("</svg>")
    return "\n".join(out)


def bar_html(value: int, total: int) -> str:
    """A horizontal bar of ``value``'s share of ``total`` (a table cell's content)."""
    pct = 100.0 * value / total if total else 0.0
    return f'<div class="bar"><div style="width:{pct:.1f}%"></div></div><span class="muted">{pct:.0f}%</span>'
