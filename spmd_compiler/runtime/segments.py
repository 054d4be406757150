"""Cutting a per-rank program into segments for inductor, at the points where Python
must run between them.

Inductor compiles a graph into one call, but two things of the step must happen in the
middle of the program: the step guard's check, right before the first effect (so the
flag's round trip hides behind the ops before it), and, when the check rides on the
program's first collective (:mod:`spmd_compiler.driver.fold`), the host-side
``resync_if_flagged`` after that collective's wait, which reads the flag and raises
``Resync`` before any other effect. :func:`split_segments` cuts the graph there: each
:class:`Segment` is either a GraphModule (compiled by inductor) or one host node (run in
Python), and the check runs before the segment marked ``check_before``.

A segment reads the program's inputs and earlier segments' values by name. A view of a
program input (``t(weight)``) is never handed from one segment to the next: it is
recomputed in the segment that reads it, so no compiled graph gets an input aliasing
another input that it updates in place (the parameters and optimizer state).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..optimize.graph_utils import cut_graph

__all__ = ["Segment", "split_segments"]


@dataclass
class Segment:
    """``gm`` (compiled by inductor) or ``host`` (a node run in Python); ``inputs`` and
    ``outputs`` are value names; ``check_before``: the step check runs before it;
    ``free``: names no later segment nor the program's output reads."""

    gm: fx.GraphModule | None
    host: fx.Node | None
    inputs: list[str]
    outputs: list[str]
    check_before: bool = False
    free: list[str] = field(default_factory=list)
    boxed: list[str] = field(default_factory=list)  # float inputs ``gm`` takes as 0-d float64 tensors
    device: torch.device = torch.device("cpu")  # where those tensors go
    made: dict[str, fx.Node] = field(default_factory=dict)  # original name -> node of ``gm``


def _input_view(n: fx.Node) -> bool:
    """A view op whose inputs are program inputs or such views (cheap to recompute)."""
    return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and pt.is_view_op(n.target)
            and all(a.op == "placeholder" or _input_view(a) for a in n.all_input_nodes))


def _size_node(n: fx.Node) -> bool:
    """An integer node computing a size from the ``size_*`` inputs (dynamic=True: so that
    only those ints cross segments, expand/emit_sizes.py)."""
    return n.op == "call_function" and bool(n.meta.get("spmd_size_expr"))


def split_segments(gm: fx.GraphModule, *, host: Callable[[fx.Node], bool], check_before: fx.Node | None) -> list[Segment]:
    """Cut ``gm`` into segments: one per ``host(node)`` node, and graph segments between
    them, with a cut before ``check_before`` (the step check's place; None: no cut)."""
    runs: list[tuple[list[fx.Node], bool]] = [([], False)]
    run_of: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n is check_before:
            runs.append(([], True))
        if n.op == "call_function" and host(n):
            runs.append(([n], runs[-1][1] and not runs[-1][0]))
            runs.append(([], False))
        elif n.target is operator.getitem and n.args[0] in run_of:  # with its tuple: no tuple crosses segments
            run_of[n] = run_of[n.args[0]]
            runs[run_of[n]][0].append(n)
            continue
        else:
            runs[-1][0].append(n)
        run_of[n] = len(runs) - 1
    runs = [(nodes, check) for nodes, check in runs if nodes]
    segments = [_extract(gm, nodes, check, host) for nodes, check in runs]
    # outputs: what later segments and the program's output read
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    wanted = {a.name for a in out_node.all_input_nodes}
    for seg in reversed(segments):
        made = list(seg.made) if seg.gm is not None else [seg.host.name]
        seg.outputs = [name for name in made if name in wanted]
        if seg.gm is not None:
            seg.gm.graph.output([seg.made[name] for name in seg.outputs])
            seg.gm.recompile()
        wanted |= set(seg.inputs)
    needed = {a.name for a in out_node.all_input_nodes}
    for seg in reversed(segments):  # free what nothing after this segment reads
        seg.free = [name for name in seg.inputs if name not in needed]
        needed |= set(seg.inputs)
    return segments


def _extract(gm: fx.GraphModule, nodes: list[fx.Node], check: bool, host: Callable[[fx.Node], bool]) -> Segment:
    if len(nodes) == 1 and nodes[0].op == "call_function" and host(nodes[0]):
        n = nodes[0]
        return Segment(None, n, [a.name for a in n.all_input_nodes], [], check)
    inside = set(nodes)
    # a get_attr, a view of the program's inputs or a size (dynamic=True) read here is recomputed here
    piece, inputs, env = cut_graph(gm, nodes, recompute=lambda a: a not in inside and (_input_view(a) or _size_node(a)))
    made = {n.name: env[n] for n in nodes if n.op == "call_function"}
    seg = Segment(piece, None, inputs, [], check, made=made)
    _box_floats(seg)
    return seg


def _box_floats(seg: Segment) -> None:
    """A host float read from an earlier segment (the optimizer's ``-lr``) enters ``seg.gm``
    as a 0-d float64 tensor read with ``.item()``: inductor passes a float input to its
    kernels as a 32-bit ``float``, and ``scalars_as_tensors`` turns the ``.item()`` into a
    float64 tensor read (runtime/inductor.py)."""
    g = seg.gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    tensors = [n.meta["val"] for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
    seg.device = tensors[0].device if tensors else torch.device("cpu")
    for p in placeholders:
        val = p.meta.get("val")
        if not isinstance(val, (float, torch.SymFloat)) or not p.users:
            continue
        with g.inserting_after(p):  # placeholders and nodes interleave (cut_graph adds inputs as read)
            item = g.call_function(torch.ops.aten._local_scalar_dense.default, (p,))
        p.replace_all_uses_with(item, delete_user_cb=lambda u, item=item: u is not item)
        item.meta["val"] = val
        p.meta["val"] = torch.empty((), dtype=torch.float64, device=seg.device)
        seg.boxed.append(p.name)
    if seg.boxed:
        seg.gm.recompile()
