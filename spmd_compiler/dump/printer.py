"""Readable Python for traced and per-rank graphs, annotated per node.

Every node is printed as one line of Python, preceded by a comment saying what the
node holds: for the per-rank graph its placements (inputs -> output), global and local
shape, the traced node it came from and the user's source line; for a collective its
kind, mesh axis, bytes per rank and why it exists.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..expand.values import placements_text
from .format import describe_collective, shape_text, short_source, target_name
from .notes import node_notes
from .sizes import SizeContext, readable

__all__ = ["annotated_code", "node_annotation"]


def _fmt(x: Any) -> str:
    if isinstance(x, fx.Node):
        return x.name
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_fmt(v) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
    if isinstance(x, torch.dtype):
        return str(x)
    return repr(x)


def _line(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"{node.name}  # input"
    if node.op == "get_attr":
        return f"{node.name} = self.{node.target}"
    if node.op == "output":
        return f"return {_fmt(node.args[0])}"
    args = ", ".join([_fmt(a) for a in node.args] + [f"{k}={_fmt(v)}" for k, v in node.kwargs.items()])
    return f"{node.name} = {target_name(node.target)}({args})"


def node_annotation(node: fx.Node, sizes: SizeContext | None = None) -> str:
    """One-line description of a node's placements, shapes and origin ('' if none).
    ``sizes`` (a symbolic program's): size expressions for its rank and last call's values."""
    parts = []
    comm = node.meta.get("spmd_comm")
    if comm is not None:
        return describe_collective(node)
    expr = node.meta.get("spmd_size_value")
    if expr is not None:
        parts.append(sizes.annotate(expr) if sizes is not None else f"size: {readable(expr)}")
    if node.op == "placeholder" and sizes is not None and sizes.placeholder(node.name):
        parts.append(sizes.placeholder(node.name))
    spec = node.meta.get("spmd_spec")
    val = node.meta.get("val")
    if spec is not None:
        ins = [placements_text(a.meta["spmd_spec"].placements) for a in node.all_input_nodes if "spmd_spec" in a.meta]
        arrow = f"{', '.join(ins)} -> " if ins else ""
        parts.append(f"{arrow}{placements_text(spec.placements)}")
        parts.append(f"global {shape_text(spec.shape)}" + (sizes.concrete(spec.shape) if sizes is not None else ""))
    if isinstance(val, torch.Tensor):
        parts.append(f"local {shape_text(val.shape)}" + (sizes.concrete(val.shape) if sizes is not None else ""))
    elif isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val):
        parts.append("local " + ", ".join(shape_text(v.shape) for v in val))
    inp = node.meta.get("spmd_input")
    if inp is not None:
        parts.append(f"{inp.kind} {inp.label}")
    origin = node.meta.get("spmd_origin")
    if origin:
        src = short_source(origin.get("source"))
        parts.append(f"from {origin['node']}" + (f" ({src})" if src else ""))
    if "spmd_writeback" in node.meta:
        parts.append(f"write back {node.meta['spmd_writeback']}")
    parts.extend(f"{label}: {text}" for label, text in node_notes(node))
    return " | ".join(parts)


def _traced_annotation(node: fx.Node) -> str:
    parts = []
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        parts.append(f"{str(val.dtype).replace('torch.', '')}{shape_text(val.shape)}")
    inp = node.meta.get("spmd_input")
    if inp is not None:
        parts.append(f"{inp.kind} {inp.label}")
    from ..errors import user_source_line

    src = short_source(user_source_line(node))
    if src:
        parts.append(src)
    return " | ".join(parts)


def annotated_code(gm: fx.GraphModule, *, title: str = "", traced: bool = False, sizes: SizeContext | None = None) -> str:
    """The graph as annotated Python; ``traced`` selects annotations for a traced graph;
    ``sizes`` (a symbolic program, dynamic=True) adds the sizes block and size values."""
    nodes = list(gm.graph.nodes)
    params = [n.name for n in nodes if n.op == "placeholder"]
    out = []
    if title:
        out.append(f"# {title}")
    if sizes is not None:
        out.extend(f"# {line}" for line in sizes.section())
    out.append(f"def forward({', '.join(params)}):")
    phase = None
    for node in nodes:
        if node.op == "placeholder":
            note = _traced_annotation(node) if traced else node_annotation(node, sizes)
            out.append(f"    # {node.name}: {note}" if note else f"    # {node.name}")
            continue
        p = node.meta.get("spmd_phase")
        if p and p != phase:
            phase = p
            out.append(f"\n    # ---------------- {phase} ----------------")
        note = _traced_annotation(node) if traced else node_annotation(node, sizes)
        if note:
            out.append(f"    # {note}")
        out.append(f"    {_line(node)}")
    return "\n".join(out) + "\n"
