"""Communication by module and by layer: which part of the model each collective serves.

Terms: a *module* is a path in the model (``blocks.0.attn.q``; ``<model>`` for the model's
own ``forward``); its *layer* is the path up to its first numeric part (``blocks.0``), or its
first part (``tok``, ``head``). Work of the step function outside any module (a loss,
``optimizer.step()``'s own counters) is ``(outside modules)``.

A traced node's module (:func:`traced_modules`): a forward node's innermost entry of
``meta["nn_module_stack"]`` (recorded while tracing, :mod:`spmd_compiler.trace.modules`);
a backward node's forward op's, matched by ``seq_nr``; a parameter's, gradient's or
optimizer state's input: the module holding the parameter; any other backward or
optimizer node: the module of the nearest node it reads that has one (a gradient's
``detach``, an optimizer's ``lerp_`` reading the parameter's state).

A collective (:func:`comm_by_module`) is counted for the module of the traced node that
needs it (its ``origin``, else the value it moves); a bucket (gradients, FSDP gathers) is
split into its values, each counted for its own module with its own bytes.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

__all__ = ["ModuleComm", "traced_modules", "comm_by_module", "layer_of", "MODEL", "OUTSIDE"]

MODEL = "<model>"
OUTSIDE = "(outside modules)"
_STATE_KINDS = ("param", "grad", "optim", "buffer")


def layer_of(module: str) -> str:
    """``blocks.0.attn.q`` -> ``blocks.0``; ``head`` -> ``head``; the labels stay."""
    if module in (MODEL, OUTSIDE):
        return module
    parts = module.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _innermost(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack)[-1]
    return path or MODEL


def traced_modules(gm: fx.GraphModule) -> dict[str, str]:
    """The module of every node of the traced graph ``gm``, by node name (see the module doc)."""
    out: dict[str, str] = {}
    by_seq: dict[int, str] = {}
    for n in gm.graph.nodes:
        mod = _innermost(n)
        if mod is not None:
            out[n.name] = mod
            if n.meta.get("spmd_phase") == "forward" and "seq_nr" in n.meta:
                by_seq.setdefault(n.meta["seq_nr"], mod)
        elif n.op == "placeholder":
            inp = n.meta.get("spmd_input")
            if inp is not None and inp.kind in _STATE_KINDS:
                out[n.name] = inp.name.rpartition(".")[0] or MODEL
    for n in gm.graph.nodes:
        if n.name in out or n.op != "call_function":
            continue
        phase = n.meta.get("spmd_phase")
        if phase == "backward" and n.meta.get("seq_nr") in by_seq:
            out[n.name] = by_seq[n.meta["seq_nr"]]
        elif phase in ("backward", "optimizer"):
            out[n.name] = _nearest(n, out) or OUTSIDE
        else:
            out[n.name] = OUTSIDE
    return out


def _nearest(node: fx.Node, known: dict[str, str]) -> str | None:
    """The module of the nearest node ``node`` reads (breadth first) that has one."""
    seen = {node}
    queue = deque(node.all_input_nodes)
    while queue:
        n = queue.popleft()
        if n in seen:
            continue
        seen.add(n)
        if n.name in known and known[n.name] != OUTSIDE:
            return known[n.name]
        queue.extend(n.all_input_nodes)
    return None


@dataclass
class ModuleComm:
    """The collectives one module (or layer) needs per rank per step.

    ``launches``: collective nodes it has a value in (a bucket counts for each of its
    modules); ``values``: values moved for it; ``bytes``: their bytes per rank; ``kinds``:
    ``"<phase> <kind>/<axis>"`` -> values; ``first``: where it first appears in the program."""

    module: str
    layer: str
    launches: int = 0
    values: int = 0
    bytes: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    first: int = 0

    def kinds_text(self) -> str:
        return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in self.kinds.items())


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _entry_module(entry: dict[str, Any], modules: dict[str, str]) -> str:
    for key in ("origin", "value"):
        for name in str(entry.get(key) or "").split(", "):
            if _NAME.fullmatch(name) and name in modules and modules[name] != OUTSIDE:
                return modules[name]
    return OUTSIDE


def comm_by_module(gm: fx.GraphModule, traced: fx.GraphModule, *, by_layer: bool = False) -> list[ModuleComm]:
    """The collectives of the per-rank program ``gm`` per module of the traced graph
    ``traced`` (``by_layer``: per layer), in order of first appearance in ``gm``."""
    modules = traced_modules(traced)
    rows: dict[str, ModuleComm] = {}
    for i, node in enumerate(gm.graph.nodes):
        comm = node.meta.get("spmd_comm")
        if comm is None:
            continue
        entries = comm.get("bucket") or [comm]
        kind = f"{node.meta.get('spmd_phase', '?')} {comm['kind']}/{comm['axis_name']}"
        touched = set()
        for entry in entries:
            mod = _entry_module(entry, modules)
            key = layer_of(mod) if by_layer else mod
            row = rows.get(key)
            if row is None:
                row = rows[key] = ModuleComm(key, layer_of(mod), first=i)
            row.values += 1
            row.bytes += int(entry.get("bytes", comm["bytes"] if len(entries) == 1 else 0))
            row.kinds[kind] = row.kinds.get(kind, 0) + 1
            touched.add(key)
        for key in touched:
            rows[key].launches += 1
    return sorted(rows.values(), key=lambda r: r.first)
