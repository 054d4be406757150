"""A self-contained HTML report of one compile.

One file, no network: inline CSS, SVG and JavaScript. It shows the memory per rank over
the step (a plot of the static memory trace), the communication summary, the
communication by layer and by module, every replicate fallback and scheduling note of
the text dump (:mod:`.html_sections`), the per-rank graph node by node (placements, shapes, origin) with collectives
highlighted and linked to the traced nodes that caused them, and the traced graph. A
search box filters both tables; ``report.html?q=all_reduce`` opens pre-filtered.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from ..errors import user_source_line
from ..expand.values import placements_text
from .format import format_bytes, shape_text, short_source, target_name
from .html_sections import SECTION_CSS, memory_section, modules_section, notes_section
from .memory import memory_trace
from .notes import Note
from .sizes import readable

__all__ = ["render_report"]

_CSS = """
body{font:13px/1.4 -apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:20px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #e3e3e3;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4;position:sticky;top:0}
tr.comm{background:#fff3cd}tr.comm td.op{font-weight:bold;color:#8a4b00}
tr.target{outline:2px solid #e67e22}
code,td.mono{font-family:SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
#search{width:420px;padding:5px;font-size:14px}.muted{color:#888}.num{text-align:right}
.phase{background:#eef4ff;font-weight:bold}
"""

_JS = """
function filterRows(q){q=q.toLowerCase();document.querySelectorAll('tr.row').forEach(function(r){
 r.style.display=(!q||r.textContent.toLowerCase().indexOf(q)>=0)?'':'none';});
 var n=document.querySelectorAll('tr.row:not([style*="none"])').length;
 document.getElementById('count').textContent=n+' rows shown';}
window.addEventListener('DOMContentLoaded',function(){var s=document.getElementById('search');
 var q=new URLSearchParams(window.location.search).get('q')||'';s.value=q;filterRows(q);
 s.addEventListener('input',function(){filterRows(s.value);});
 window.addEventListener('hashchange',mark);mark();});
function mark(){document.querySelectorAll('tr.target').forEach(function(r){r.classList.remove('target')});
 var h=window.location.hash.slice(1);if(h){var e=document.getElementById(h);if(e)e.classList.add('target');}}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _args(node: fx.Node) -> str:
    def fmt(a: Any) -> str:
        if isinstance(a, fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(fmt(v) for v in a) + "]"
        return repr(a)

    return ", ".join(fmt(a) for a in node.args)


def _expanded_rows(gm: fx.GraphModule, traced_names: set[str], sizes: Any = None) -> list[str]:
    rows = []
    phase = None
    for i, node in enumerate(gm.graph.nodes):
        p = node.meta.get("spmd_phase")
        if p and p != phase and node.op != "placeholder":
            phase = p
            rows.append(f'<tr class="phase"><td colspan="7">{_e(phase)}</td></tr>')
        spec = node.meta.get("spmd_spec")
        val = node.meta.get("val")
        comm = node.meta.get("spmd_comm")
        origin = node.meta.get("spmd_origin") or {}
        cls = "row comm" if comm else "row"
        placements = placements_text(spec.placements) if spec is not None else ""
        gshape = shape_text(spec.shape) if spec is not None else ""
        lshape = shape_text(val.shape) if isinstance(val, torch.Tensor) else ""
        if comm:
            value = comm.get("value", "?")
            consumer = comm.get("origin", "?")
            vlink = f'<a href="#t-{_e(value)}">{_e(value)}</a>' if value in traced_names else _e(value)
            clink = f'<a href="#t-{_e(consumer)}">{_e(consumer)}</a>' if consumer in traced_names else _e(consumer)
            src = short_source(comm.get("source"))
            why = (
                f"{_e(comm['kind'])} over <b>{_e(comm['axis_name'])}</b> ({comm['group_size']} ranks), "
                f"{_e(format_bytes(comm['bytes']))}/rank: {vlink} {_e(comm.get('transition', ''))} "
                f"for {clink} [{_e(str(comm.get('op', '')).replace('aten.', ''))}]"
                + (f" <span class='muted'>(user line {_e(src)})</span>" if src else "")
                + (f"<br><span class='muted'>{_e('; '.join(comm['history']))}</span>" if comm.get("history") else "")
            )
        else:
            o = origin.get("node")
            why = (f'from <a href="#t-{_e(o)}">{_e(o)}</a>' if o in traced_names else _e(o or "")) if o else ""
            inp = node.meta.get("spmd_input")
            if inp is not None:
                why = f"{_e(inp.kind)} {_e(inp.label)}"
            expr = node.meta.get("spmd_size_value")
            if expr is not None:
                why = _e(sizes.annotate(expr) if sizes is not None else f"size: {readable(expr)}")
            elif sizes is not None and node.op == "placeholder" and sizes.placeholder(node.name):
                why = _e(sizes.placeholder(node.name))
        rows.append(
            f'<tr class="{cls}" id="n-{_e(node.name)}"><td class="num muted">{i}</td><td class="mono">{_e(node.name)}</td>'
            f'<td class="op mono">{_e(target_name(node.target)) if node.op == "call_function" else _e(node.op)}</td>'
            f'<td class="mono">{_e(placements)}</td><td class="mono">{_e(gshape)}</td><td class="mono">{_e(lshape)}</td><td>{why}</td></tr>'
        )
    return rows


def _traced_rows(gm: fx.GraphModule) -> list[str]:
    rows = []
    for i, node in enumerate(gm.graph.nodes):
        val = node.meta.get("val")
        shape = shape_text(val.shape) if isinstance(val, torch.Tensor) else ""
        src = short_source(user_source_line(node))
        rows.append(
            f'<tr class="row" id="t-{_e(node.name)}"><td class="num muted">{i}</td><td class="mono">{_e(node.name)}</td>'
            f'<td class="mono">{_e(target_name(node.target)) if node.op == "call_function" else _e(node.op)}</td>'
            f'<td class="mono">{_e(_args(node))}</td><td class="mono">{_e(shape)}</td><td>{_e(node.meta.get("spmd_phase", ""))}</td><td class="muted">{_e(src)}</td></tr>'
        )
    return rows


def render_report(step: Any, summary: Any, *, title: str = "spmd-compiler report", info: dict[str, Any] | None = None,
                  sizes: Any = None, memory: Any = None, memory_at: str = "", notes: Sequence[Note] | None = None) -> str:
    """The HTML report of an ExpandedStep (``summary``: its CommSummary; ``sizes``: a
    :class:`~spmd_compiler.dump.sizes.SizeContext` for a symbolic program; ``memory``: its
    MemoryTrace (default: computed here), ``memory_at``: the sizes it is counted at;
    ``notes``: the node notes of the expanded program and of every pass's output, as the
    text dump has them (default: the final program's))."""
    traced_names = {n.name for n in step.traced.gm.graph.nodes}
    info = dict(info or {})
    info.setdefault("mesh", dict(zip(step.mctx.axis_names, step.mctx.shape)))
    info.setdefault("coordinate", step.mctx.coordinate)
    info.setdefault("per-rank nodes", len(step.gm.graph.nodes))
    info.setdefault("collectives", len(step.collectives()))
    info.setdefault("rank independent", step.rank_independent)
    info_rows = "".join(f"<tr><th>{_e(k)}</th><td class='mono'>{_e(v)}</td></tr>" for k, v in info.items())
    sum_rows = "".join(
        f"<tr><td>{_e(r.phase)}</td><td>{_e(r.kind)}</td><td>{_e(r.axis)}</td><td class='num'>{r.count}</td>"
        f"<td class='num'>{_e(format_bytes(r.bytes))}</td><td class='num'>{_e(format_bytes(r.wire_bytes))}</td></tr>"
        for r in summary.rows
    )
    sum_rows += (
        f"<tr><th>total</th><th></th><th></th><th class='num'>{summary.total_count}</th>"
        f"<th class='num'>{_e(format_bytes(summary.total_bytes))}</th><th class='num'>{_e(format_bytes(summary.total_wire_bytes))}</th></tr>"
    )
    if memory is None:
        memory = memory_trace(step.gm)
    coord = step.mctx.coordinate
    rank_text = (f"This rank (coordinate {tuple(coord)}); every rank runs the same program on the same shapes"
                 if step.rank_independent and not getattr(step, "size_symbols", None)
                 else f"The rank at coordinate {tuple(coord)}; the ranks' programs differ, each rank's dump has its own "
                      f"(SPMD_COMPILER_DUMP_RANKS=all)")
    pictures = memory_section(memory, step.gm, rank_text=rank_text, at=memory_at)
    sizes_block = f"<h2>Batch sizes</h2>\n<pre class='mono'>{_e(chr(10).join(sizes.section()))}</pre>\n" if sizes is not None else ""
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{_e(title)}</title><style>{_CSS}{SECTION_CSS}</style><script>{_JS}</script></head>
<body>
<h1>{_e(title)}</h1>
<table style="width:auto">{info_rows}</table>
{pictures}{sizes_block}<h2>Collectives per rank per step</h2>
<table id="summary"><tr><th>phase</th><th>collective</th><th>axis</th><th>count</th><th>bytes/rank</th><th>sent/rank (ring)</th></tr>{sum_rows}</table>
{modules_section(step.gm, step.traced.gm)}{notes_section(step.gm, notes)}<h2>Per-rank graph</h2>
<p><input id="search" placeholder="search nodes, ops, placements, reasons (e.g. all_reduce, S(0), addmm_3)"> <span id="count" class="muted"></span></p>
<table id="expanded"><tr><th>#</th><th>node</th><th>op</th><th>placements</th><th>global shape</th><th>local shape</th><th>origin / why</th></tr>
{''.join(_expanded_rows(step.gm, traced_names, sizes))}</table>
<h2>Traced graph (single device)</h2>
<table id="traced"><tr><th>#</th><th>node</th><th>op</th><th>args</th><th>shape</th><th>phase</th><th>user line</th></tr>
{''.join(_traced_rows(step.traced.gm))}</table>
</body></html>
"""
