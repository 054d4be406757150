"""Splitting the expanded train step into per-stage programs.

The per-rank graph of one micro-batch step (expanded over the mesh axes other than the
pipeline axis) is cut, node by node, into pieces per stage:

    G[s]  what the forward and backward of stage s compute from its parameters alone (FSDP
          gathers and their copy-outs, views such as ``t(weight)``, casts): run once per
          step, before the stage's first micro-batch, and read by every micro-batch, so an
          FSDP parameter is gathered once per step and stage (``hoist_params``; without it,
          as with ``Pipeline(reshard_between_microbatches=True)``, those nodes stay in F/B
          and run per micro-batch)
    F[s]  forward of stage s (and, on the last stage, the loss)
    B[s]  backward of stage s (what autograd computes for stage s's forward ops)
    O[s]  optimizer of stage s (runs once per step, on gradients summed over micro-batches;
          the gradients' reductions are optimizer nodes, so they run once per step too)

Each piece is a GraphModule whose inputs are the values it reads from outside itself
(parameters, batch, coordinates, values of other pieces) and whose outputs are the
values other pieces (or the step's outputs) read. A value read by a piece of another
stage crosses a stage boundary: forward values travel to later stages, gradients to
earlier ones; exactly those values are communicated. A ``G`` value is never sent:
a stage that reads a parameter-only value (a tied weight's gather) computes it in its own
``G`` from its own copy of the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from ..optimize.graph_utils import alias_root, cut_graph, is_pure, written_inputs
from ..trace.markers import MARKER
from .partition import StageAssignment

__all__ = ["Piece", "StageProgram", "split_program", "KINDS"]

KINDS = ("G", "F", "B", "O")


@dataclass
class Piece:
    """One piece (G, F, B or O) of one stage.

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

    ``producer[name] = (stage, kind)`` of every value computed by some F, B or O piece
    (a G value is computed by the G piece of each stage that reads it);
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


def _parameter_only(gm: fx.GraphModule) -> set[fx.Node]:
    """Forward and backward nodes that compute from parameters and buffers alone (and the
    mesh coordinates): pure, and reading no state that forward or backward writes
    (BatchNorm's running statistics). The same for every micro-batch of a step, since the
    optimizer writes the parameters only after the last one."""
    written = {alias_root(x) for n in gm.graph.nodes if _kind(n) != "O" for x in written_inputs(n)}
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            inp = n.meta.get("spmd_input")
            if (inp is None or inp.kind in ("param", "buffer")) and n not in written and not _is_size(n):
                out.add(n)
        elif n.op == "get_attr":
            out.add(n)
        elif (n.op == "call_function" and _kind(n) in ("F", "B") and n.target is not MARKER and not _is_size(n)
              and is_pure(n) and n.all_input_nodes and all(a in out for a in n.all_input_nodes)):
            out.add(n)
    outputs = set(next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes)
    return {n for n in out if n.op == "call_function" and n not in outputs}


def _stage_gathers(gm: fx.GraphModule, members: dict[tuple[int, str], list[fx.Node]], hoisted: set[fx.Node],
                   num_stages: int) -> dict[int, set[fx.Node]]:
    """Per stage, its G piece's nodes: the parameter-only values its other nodes read and
    what they are computed from, when that includes a collective (a gather), or a value
    another stage's G takes out of its F or B. A stage whose parameter-only nodes are views
    and local ops keeps them in F and B (nothing to save)."""
    closures: dict[int, set[fx.Node]] = {}
    for s in range(num_stages):
        reads = {a for k in ("F", "B", "O") for n in members.get((s, k), ()) if n not in hoisted
                 for a in n.all_input_nodes if a in hoisted}
        closure, stack = set(), list(reads)
        while stack:
            x = stack.pop()
            if x not in closure:
                closure.add(x)
                stack.extend(a for a in x.all_input_nodes if a in hoisted)
        closures[s] = closure
    out = {s: c for s, c in closures.items() if any("spmd_comm" in n.meta for n in c)}
    changed = True
    while changed:  # a value moved into one stage's G is no longer sent from its F: each reader computes it
        taken = set().union(*out.values()) if out else set()
        more = {s: c for s, c in closures.items() if s not in out and c & taken}
        out.update(more)
        changed = bool(more)
    return out


def split_program(gm: fx.GraphModule, assignment: StageAssignment, *, hoist_params: bool = False) -> StageProgram:
    """Cut the expanded graph ``gm`` into F/B/O pieces per stage (and G pieces, with
    ``hoist_params``: the parameter-only nodes of each stage's forward and backward)."""
    node_stages = _node_stages(gm, assignment)
    hoisted = _parameter_only(gm) if hoist_params else set()
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
    gathered = _stage_gathers(gm, members, hoisted, assignment.num_stages)
    for s, nodes in gathered.items():  # out of the stage's forward and backward, into its G
        for k in ("F", "B"):
            if (s, k) in members:
                members[(s, k)] = [n for n in members[(s, k)] if n not in nodes]
        members[(s, "G")] = [n for n in gm.graph.nodes if n in nodes]
    producer: dict[str, tuple[int, str]] = {}
    for key, nodes in members.items():
        for n in nodes:
            if key[1] != "G":
                producer.setdefault(n.name, key)
    # values read outside their piece
    needed: dict[tuple[int, str], set[str]] = {k: set() for k in members}
    for key, nodes in members.items():
        names = {n.name for n in nodes}
        for n in nodes:
            for a in n.all_input_nodes:
                if a.op == "call_function" and a.name not in names and not _is_size(a):
                    needed[(key[0], "G") if a in gathered.get(key[0], ()) else producer[a.name]].add(a.name)
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
    first = next(n for n in piece_gm.graph.nodes if n.op != "placeholder")
    for ph in [n for n in piece_gm.graph.nodes if n.op == "placeholder"]:  # inputs first, in order: every input exists
        first.prepend(ph)                                            # from the start (passes place collectives by it)
    piece_gm.recompile()
    out_names = [n.name for n in nodes if n.name in outputs]
    return Piece(key[0], key[1], piece_gm, inputs, out_names, [n.name for n in nodes])
