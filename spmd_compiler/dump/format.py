"""Small text helpers shared by the printer, the report and the summary."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.fx as fx

from .._format import format_bytes

__all__ = ["shape_text", "target_name", "short_source", "describe_collective", "format_bytes"]


def shape_text(shape: Any) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, str):
        return target
    mod = getattr(target, "__module__", "") or ""
    name = getattr(target, "__name__", str(target))
    return f"{mod.replace('_operator', 'operator')}.{name}" if mod in ("_operator", "operator", "math") else name


def short_source(source: str | None) -> str:
    """``/long/path/model.py:42 in forward: code`` -> ``model.py:42``."""
    if not source:
        return ""
    loc = source.split(" in ", 1)[0]
    path, _, line = loc.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else loc


def describe_collective(node: fx.Node) -> str:
    """``all_reduce <- view_12 @ t_3: P(sum)->R on 'tp' for addmm_3 (models.py:80), 8.0 KiB``."""
    c = node.meta["spmd_comm"]
    value = c.get("value", "?")
    src = short_source(c.get("source"))
    text = f"{c['kind']} <- {value}: {c.get('transition', '')} on '{c['axis_name']}' for {c.get('origin', '?')}"
    op = c.get("op")
    if op:
        text += f" [{op.replace('aten.', '')}]"
    if src:
        text += f" (user line {src})"
    text += f", {format_bytes(c['bytes'])}/rank"
    history = c.get("history")
    if history:
        text += " | " + "; ".join(history)
    return text
