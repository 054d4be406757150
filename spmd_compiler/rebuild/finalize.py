"""Stage 3: finish the per-rank graph after every node has been spliced.

* Outputs of the step (the loss...) that are ``Partial`` are reduced to ``Replicate``.
* Updated parameters, buffers and optimizer state are brought back to their planned
  placements and written into their input tensors (``copy_``) unless the update was
  already in place, so one call of the graph is one whole training step.
* Optimizer state created by the step (first step of Adam) becomes graph outputs.
* Gradients the step leaves set (no ``zero_grad()`` at its end) are state too: written
  back into their ``grad`` input when the call started with one, else graph outputs, in
  both cases laid out like their parameter (a Partial gradient is reduced: all_reduce to
  Replicate, reduce_scatter to a shard), or as ``grad_placements`` says
  (``Plan(defer_grad_sync=True)``: Partial on the data axes, not reduced).
* Dead code is eliminated and the GraphModule recompiled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..errors import SpmdError, add_context
from ..expand.splice import redistribute_value
from ..expand.symbolic import size_unit
from ..expand.values import DValue, MeshContext, placements_text

__all__ = ["OutputSlot", "ExpandedStep", "finalize"]

log = logging.getLogger(__name__)
aten = torch.ops.aten


@dataclass(frozen=True)
class OutputSlot:
    """One output of the per-rank graph: a tensor leaf of the step's return value
    (``kind="user"``, ``index`` into its leaves), a newly created optimizer state
    (``kind="optim"``) or the gradient of parameter ``name`` (``kind="grad"``) when the
    call started without one."""

    kind: str
    spec: Any
    index: int | None = None
    name: str = ""
    key: str | None = None


@dataclass
class ExpandedStep:
    """The per-rank program of a training step.

    Attributes:
        gm: the per-rank GraphModule. Call it as ``gm(*coordinate, *local_inputs)``: one
            int per mesh axis, then the local tensor of every traced input in order.
            It updates parameters, buffers and optimizer state in place and returns the
            local tensors described by ``outputs``.
        traced: the TracedStep it came from.
        mctx: mesh, coordinate and group names it was expanded for.
        input_specs: DTensorSpec of every traced input (global shape + placements).
        outputs: one OutputSlot per graph output.
        rank_independent: True when the graph is the same for every rank (no uneven
            shard made a size depend on the coordinate).
        stats: expansion counters and timings; ``timings`` has seconds per phase.
    """

    gm: fx.GraphModule
    traced: Any
    mctx: MeshContext
    input_specs: list[Any]
    outputs: list[OutputSlot]
    rank_independent: bool
    stats: Any
    plan_sources: tuple[str, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)
    pass_records: list = field(default_factory=list)
    # dynamic=True (docs/dynamic_shapes.md): the batch size symbols the graph takes as
    # ``size_*`` inputs after the coordinates, the conditions on them (SizeGuards) and
    # the traced nodes whose expansion added conditions
    size_symbols: list = field(default_factory=list)
    size_guards: Any = None
    size_guard_nodes: list = field(default_factory=list)
    size_definitions: dict = field(default_factory=dict)
    size_coordinates: dict = field(default_factory=dict)

    def collectives(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if "spmd_comm" in n.meta]


def _storage_root(node: fx.Node) -> fx.Node:
    """Follow in-place ops (``add_`` returns its mutated self) back to the tensor they write."""
    while node.op == "call_function" and pt.writes_first_arg(node.target) and node.args:
        node = node.args[0]
    return node


def finalize(ex: Any, *, reduce_partial_outputs: bool = True, grad_placements: dict | None = None) -> ExpandedStep:
    """Turn a finished expander run into an :class:`ExpandedStep`.

    ``grad_placements``: parameter FQN to the placements of its gradient kept for the
    next call when the call started without one (default: the parameter's); a kept
    gradient the call started with is written back as its input was planned."""
    traced = ex.traced
    g: fx.Graph = ex.graph
    output_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    out_nodes: list[fx.Node] = []
    slots: list[OutputSlot] = []
    new_keys = set(traced.new_optim_keys)
    out_args = list(output_node.args[0])
    # the trace describes its output node's arguments in order (GraphOutput i is argument i);
    # each value is then looked up by its traced node, not by position in another list
    assert len(out_args) == len(traced.outputs), (len(out_args), len(traced.outputs))
    for desc, traced_out in zip(traced.outputs, out_args):
        try:
            _finish_output(ex, desc, traced_out, output_node, out_nodes, slots, new_keys, reduce_partial_outputs, grad_placements or {})
        except (SpmdError, ValueError, TypeError) as e:
            value = ex.env.get(traced_out) if isinstance(traced_out, fx.Node) else None
            what = f"step output {desc.index}" if desc.kind == "user" else f"{desc.kind} {desc.name}" + (f"[{desc.key!r}]" if desc.key else "")
            have = f"{traced_out.name}: {placements_text(value.spec.placements)} {list(value.spec.shape)}" if isinstance(value, DValue) else ""
            add_context(
                e, traced_out if isinstance(traced_out, fx.Node) else output_node, inputs=f"{have} (becomes {what})",
                fix=f"give {what} placements the step's result can be brought to (Replicate() always can)",
            )
            raise
    g.output(out_nodes)
    g.eliminate_dead_code()
    g.lint()
    root = torch.nn.Module()
    for name, value in ex.constants.items():
        root.register_buffer(name, value, persistent=False)
    gm = fx.GraphModule(root, g)
    return ExpandedStep(
        gm=gm,
        traced=traced,
        mctx=ex.mctx,
        input_specs=[ex.input_value(i.kind, i.name, i.key).spec for i in traced.inputs],
        outputs=slots,
        rank_independent=not ex.stats.coord_dependent,
        stats=ex.stats,
    )


def _finish_output(
    ex: Any, desc: Any, traced_out: Any, output_node: fx.Node, out_nodes: list, slots: list, new_keys: set, reduce_partial: bool,
    grad_placements: dict,
) -> None:
    """One output of the traced step: a user output (Partial reduced), new optimizer
    state (an output of the graph), or updated state written back into its input."""
    g: fx.Graph = ex.graph
    tname = traced_out.name if isinstance(traced_out, fx.Node) else None
    value = ex.env[traced_out] if isinstance(traced_out, fx.Node) else traced_out
    if desc.kind == "user":
        if not isinstance(value, DValue):
            raise SpmdError(f"step output {desc.index} is not a tensor after expansion: {value!r}")
        if reduce_partial and any(p.is_partial() for p in value.spec.placements):
            dst = pt.DTensorSpec(
                value.spec.mesh,
                tuple(pt.Replicate() if p.is_partial() else p for p in value.spec.placements),
                tensor_meta=value.spec.tensor_meta,
            )
            value = redistribute_value(ex, value, dst, f"step output {desc.index} is Partial", output_node, tname)
        if any(isinstance(p, pt.Shard) and size_unit(value.spec.shape[p.dim]) > 1 for p in value.spec.placements):
            # a dim split in units (a flattened symbolic batch, dynamic=True) is not the
            # torch.chunk layout in which the caller assembles a sharded output: gathered
            dst = pt.DTensorSpec(
                value.spec.mesh,
                tuple(pt.Replicate() if isinstance(p, pt.Shard) and size_unit(value.spec.shape[p.dim]) > 1 else p
                      for p in value.spec.placements),
                tensor_meta=value.spec.tensor_meta,
            )
            value = redistribute_value(ex, value, dst, f"step output {desc.index} is split in units of rows", output_node, tname)
        out_nodes.append(value.node)
        slots.append(OutputSlot("user", value.spec, index=desc.index))
        return
    if desc.kind == "optim" and (desc.name, desc.key) in new_keys:
        dst = _new_state_spec(ex, desc, value)
        value = redistribute_value(ex, value, dst, f"new optimizer state {desc.name}[{desc.key!r}]", output_node, tname)
        out_nodes.append(value.node)
        slots.append(OutputSlot("optim", value.spec, name=desc.name, key=desc.key))
        return
    if desc.kind == "grad" and not _has_input(ex, "grad", desc.name):  # p.grad was None when the call started
        placements = grad_placements.get(desc.name) or ex.input_value("param", desc.name).spec.placements
        dst = pt.DTensorSpec(value.spec.mesh, tuple(placements), tensor_meta=value.spec.tensor_meta)
        value = redistribute_value(ex, value, dst, f"gradient of {desc.name} kept for the next call", output_node, tname)
        out_nodes.append(value.node)
        slots.append(OutputSlot("grad", value.spec, name=desc.name))
        return
    target = ex.input_value(desc.kind, desc.name, desc.key)  # as planned, not as later reduced
    if not isinstance(value, DValue):
        raise SpmdError(f"updated {desc.kind} {desc.name} is not a tensor after expansion")
    if _storage_root(value.node) is target.node and tuple(value.spec.placements) == tuple(target.spec.placements):
        return
    value = redistribute_value(ex, value, target.spec, f"write back {desc.kind} {desc.name}", output_node, tname)
    if _storage_root(value.node) is target.node:
        return
    copy = g.call_function(aten.copy_.default, (target.node, value.node))
    copy.meta["val"] = target.local
    copy.meta["spmd_writeback"] = f"{desc.kind} {desc.name}" + (f"[{desc.key!r}]" if desc.key else "")
    copy.meta["spmd_phase"] = "optimizer"


def _has_input(ex: Any, kind: str, name: str) -> bool:
    try:
        ex.input_value(kind, name)
    except KeyError:
        return False
    return True


def _new_state_spec(ex: Any, desc: Any, value: DValue) -> Any:
    """Placement for optimizer state created during the step: that of its parameter
    when shapes match (exp_avg), else Replicate (the scalar ``step``)."""
    pspec = ex.input_value("param", desc.name).spec
    if tuple(pspec.shape) == tuple(value.spec.shape):
        placements = pspec.placements
    else:
        placements = (pt.Replicate(),) * ex.mctx.ndim
    return pt.DTensorSpec(value.spec.mesh, tuple(placements), tensor_meta=value.spec.tensor_meta)
