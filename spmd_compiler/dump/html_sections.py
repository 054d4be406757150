"""Sections of the HTML report (:mod:`.html`) beyond its tables of nodes: the memory plot,
communication by layer and by module, and every node note (replicate fallbacks and
scheduling) the text dump gives."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from .format import format_bytes
from .modules import comm_by_module
from .notes import Note, graph_notes
from .plots import PHASE_COLORS, bar_html, memory_svg

__all__ = ["memory_section", "modules_section", "notes_section", "SECTION_CSS"]

SECTION_CSS = """
svg.plot{width:100%;max-width:1000px;height:auto;display:block;border:1px solid #e3e3e3;background:#fff}
.legend span{display:inline-block;padding:1px 8px;margin-right:6px;border:1px solid #ddd}
div.bar{display:inline-block;width:140px;height:10px;background:#eee;margin-right:6px;vertical-align:middle}
div.bar div{height:10px;background:#1f5fbf}
table.compact{width:auto}table.compact td,table.compact th{padding:3px 10px}
ul.notes{padding-left:18px}ul.notes li{margin:4px 0}ul.notes b{color:#8a4b00}
.nodes{font-family:SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;color:#555}
"""

_NODES_SHOWN = 12


def _e(x: Any) -> str:
    return html.escape(str(x))


def memory_section(trace: Any, gm: fx.GraphModule, *, rank_text: str, at: str = "") -> str:
    """The memory-over-time plot and what is alive at the peak."""
    legend = "".join(f'<span style="background:{c}">{_e(p)}</span>' for p, c in PHASE_COLORS.items())
    rows = "".join(f"<tr><td>{_e(what)}</td><td class='num'>{_e(format_bytes(b))}</td><td>{bar_html(b, trace.peak_bytes)}</td></tr>"
                   for what, b in list(trace.breakdown().items())[:10])
    inputs = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(trace.input_bytes.items()))
    return (
        f"<h2>Memory per rank over the step</h2>\n<p>{_e(rank_text)}. Static trace of the program "
        f"(<code>memory.txt</code>): every value from the node that makes it to its last use; inputs ({_e(inputs)}) "
        f"for the whole step.{(' ' + _e(at)) if at else ''}</p>\n<p class='legend'>{legend}</p>\n"
        f"{memory_svg(trace, gm, label='bytes alive per rank at each node')}\n"
        f"<p>Alive at the peak ({_e(format_bytes(trace.peak_bytes))} at <a href='#n-{_e(trace.peak_node)}'>"
        f"{_e(trace.peak_node)}</a>, {_e(trace.peak_phase)}), largest first:</p>\n"
        f"<table class='compact' id='memory'><tr><th>what</th><th>bytes</th><th>share of the peak</th></tr>{rows}</table>\n"
    )


def _comm_rows(rows: Sequence[Any], *, module_col: bool) -> str:
    total = sum(r.bytes for r in rows) or 1
    out = []
    for r in rows:
        name = f"<td class='mono'>{_e(r.layer)}</td><td class='mono'>{_e(r.module)}</td>" if module_col else f"<td class='mono'>{_e(r.module)}</td>"
        out.append(f"<tr class='modrow'>{name}<td class='num'>{r.launches}</td><td class='num'>{r.values}</td>"
                   f"<td class='num'>{_e(format_bytes(r.bytes))}</td><td>{bar_html(r.bytes, total)}</td><td>{_e(r.kinds_text())}</td></tr>")
    return "".join(out)


def modules_section(gm: fx.GraphModule, traced: fx.GraphModule) -> str:
    """Collectives per layer and per module of the model (:mod:`.modules`)."""
    layers = comm_by_module(gm, traced, by_layer=True)
    modules = comm_by_module(gm, traced)
    if not modules:
        return "<h2>Communication by layer and module</h2>\n<p>This program has no collective.</p>\n"
    head = "<th>collectives</th><th>values</th><th>bytes/rank</th><th>share</th><th>what (phase kind/axis x values)</th>"
    return (
        "<h2>Communication by layer and module</h2>\n<p>Each collective counted for the module of the traced node that "
        "needs it; a bucket split into its values (a gradient: the module holding the parameter). "
        "<code>(outside modules)</code>: the step function's own code (the loss).</p>\n"
        f"<table class='compact' id='layers'><tr><th>layer</th>{head}</tr>{_comm_rows(layers, module_col=False)}</table>\n"
        f"<details open><summary>by module ({len(modules)})</summary>\n"
        f"<table class='compact' id='modules'><tr><th>layer</th><th>module</th>{head}</tr>{_comm_rows(modules, module_col=True)}</table>\n"
        "</details>\n"
    )


def notes_section(gm: fx.GraphModule, notes: Sequence[Note] | None) -> str:
    """Every replicate fallback and scheduling note of the text dump (``notes``: those of
    the expanded program and every pass's output; None: the final program's), grouped by
    reason, each with its nodes (linked when the final program still has them)."""
    final = {(n.label, n.text, n.node) for n in graph_notes(gm)}
    seen: dict[tuple[str, str, str], str] = {}
    for n in list(notes or []) + graph_notes(gm, "final"):
        key = (n.label, n.text, n.node)
        seen[key] = "final" if key in final else (n.graph or "?")
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for (label, text, node), where in seen.items():
        groups.setdefault((label, text), []).append((node, where))
    order = {"replicate fallback": 0, "moved": 1, "recomputed": 2}
    items = []
    for (label, text), members in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1])):
        links = []
        for node, where in members[:_NODES_SHOWN]:
            links.append(f"<a href='#n-{_e(node)}'>{_e(node)}</a>" if where == "final" else f"{_e(node)} (after {_e(where)} only)")
        more = f" and {len(members) - _NODES_SHOWN} more" if len(members) > _NODES_SHOWN else ""
        items.append(f"<li class='note'><b>{_e(label)}</b>: <span class='reason'>{_e(text)}</span> "
                     f"<span class='nodes'>[{len(members)} node{'s' if len(members) != 1 else ''}: {', '.join(links)}{more}]</span></li>")
    fallbacks = sum(1 for k in groups if k[0] == "replicate fallback")
    body = f"<ul class='notes'>{''.join(items)}</ul>" if items else "<p>None: no op ran through the replicate fallback, and no pass moved or recomputed a node.</p>"
    return (
        f"<h2>Replicate fallbacks and scheduling notes</h2>\n<p>{fallbacks} replicate fallback reason{'s' if fallbacks != 1 else ''}, "
        f"{len(groups) - fallbacks} scheduling note{'s' if len(groups) - fallbacks != 1 else ''} (as in the comments of "
        f"<code>expanded.py</code> and <code>pass_NN_*.py</code>).</p>\n<div id='notes'>{body}</div>\n"
    )
