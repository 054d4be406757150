"""Splitting the expanded train step into per-stage programs.

The per-rank graph of one micro-batch step (expanded over the mesh axes other than the
pipeline axis) is cut, node by node, into three pieces per stage:

    F[s]  forward of stage s (and, on the last stage, the loss)
    B[s]  backward of stage s (what autograd computes for stage s's forward ops)
    O[s]  optimizer of stage s (runs once per step, on gradients summed over micro-batches)

Each piece is a GraphModule whose inputs are the values it reads from outside itself
(parameters, batch, coordinates, values of other pieces) and whose outputs are the
values other pieces (or the step's outputs) read. A value read by a piece of another
stage crosses a stage boundary: forward values travel to later stages, gradients to
earlier ones; exactly those values are communicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from ..optimize.graph_utils import cut_graph
from ..trace.markers import MARKER
from .partition import StageAssignment

__all__ = ["Piece", "StageProgram", "split_program", "KINDS"]

KINDS = ("F", "B", "O")


@dataclass
class Piece:
    """One piece (F, B or O) of one stage.

    ``inputs``/``outputs`` are node names of the expanded graph, in the order of the
    piece's placeholders/outputs. ``gm`` takes the inputs (by position) and returns the
    outputs as a list.
    """

    stage: int
    kind: str
    gm: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    nodes: list[str] = field(default_factory=list)


@dataclass
class StageProgram:
    """All pieces, and where every value lives and goes.

    ``producer[name] = (stage, kind)`` of every value computed by some piece;
    ``placeholders`` maps expanded-graph placeholder names to their GraphInput (None for
    coordinates); ``vals`` has each value's fake tensor (shapes for receive buffers).
    """

    num_stages: int
    pieces: dict[tuple[int, str], Piece]
    producer: dict[str, tuple[int, str]]
    placeholders: dict[str, Any]
    vals: dict[str, Any]
    outputs: list[str]

    def cross_stage(self) -> list[tuple[str, int, int, str, str]]:
        """``(value, from stage, to stage, from kind, to kind)`` for every value that a
        piece of another stage reads."""
        out = []
        for (s, k), p in self.pieces.items():
            for name in p.inputs:
                if name in self.producer:
                    t, tk = self.producer[name]
                    if t != s:
                        out.append((name, t, s, tk, k))
        return out


def _kind(node: fx.Node) -> str:
    phase = node.meta.get("spmd_phase", "forward")
    return {"forward": "F", "output": "F", "backward": "B", "optimizer": "O"}.get(phase, "F")


def _node_stages(gm: fx.GraphModule, assignment: StageAssignment) -> dict[fx.Node, frozenset[int]]:
    """Stages of every expanded node: its traced origin's, else its inputs'."""
    out: dict[fx.Node, frozenset[int]] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        origin = (n.meta.get("spmd_origin") or {}).get("node")
        stages = assignment.of(origin) if origin else frozenset()
        if not stages:
            stages = frozenset(s for a in n.all_input_nodes for s in out.get(a, ()))
        if not stages and "spmd_writeback" in n.meta:  # copy_ into a parameter / state
            target = n.args[0]
            stages = assignment.of(target.name)
        out[n] = stages
    # values produced for the graph output (the loss reduction) belong to their producer
    return out


def split_program(gm: fx.GraphModule, assignment: StageAssignment) -> StageProgram:
    """Cut the expanded graph ``gm`` into F/B/O pieces per stage."""
    node_stages = _node_stages(gm, assignment)
    placeholders = {n.name: n.meta.get("spmd_input") for n in gm.graph.nodes if n.op == "placeholder"}
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    graph_outputs = [a.name for a in output_node.args[0]]
    members: dict[tuple[int, str], list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is MARKER or _is_size(n):
            continue
        stages = node_stages.get(n) or frozenset([assignment.num_stages - 1])
        kind = _kind(n)
        if kind != "O" and len(stages) > 1:
            stages = frozenset([min(stages)])
        for s in stages:
            members.setdefault((s, kind), []).append(n)
    producer: dict[str, tuple[int, str]] = {}
    for key, nodes in members.items():
        for n in nodes:
            producer.setdefault(n.name, key)
    # values read outside their piece
    needed: dict[tuple[int, str], set[str]] = {k: set() for k in members}
    for key, nodes in members.items():
        names = {n.name for n in nodes}
        for n in nodes:
            for a in n.all_input_nodes:
                if a.op == "call_function" and a.name not in names and not _is_size(a):
                    needed[producer[a.name]].add(a.name)
    for key, nodes in members.items():  # every copy of an output (tied state) is returned
        for n in nodes:
            if n.name in graph_outputs:
                needed[key].add(n.name)
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    pieces = {}
    for key, nodes in members.items():
        pieces[key] = _extract(gm, key, nodes, needed[key])
    return StageProgram(assignment.num_stages, pieces, producer, placeholders, vals, graph_outputs)


def _is_size(node: fx.Node) -> bool:
    """An integer node of a symbolic program (dynamic=True) computing a size from the
    ``size_*`` and coordinate inputs (:mod:`~spmd_compiler.expand.emit_sizes`)."""
    return bool(node.meta.get("spmd_size_expr"))


def _extract(gm: fx.GraphModule, key: tuple[int, str], nodes: list[fx.Node], outputs: set[str]) -> Piece:
    # a symbolic program's integer size nodes are copied into every piece that reads them
    # (from the size_* and coordinate inputs each piece is fed), never sent between stages
    piece_gm, inputs, _ = cut_graph(gm, nodes, recompute=_is_size, outputs=[n for n in nodes if n.name in outputs])
    out_names = [n.name for n in nodes if n.name in outputs]
    return Piece(key[0], key[1], piece_gm, inputs, out_names, [n.name for n in nodes])
