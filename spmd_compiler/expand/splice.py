"""Splicing a recipe (the dispatch subgraph of one traced node) into the per-rank graph.

Expansion splices as it goes (each traced node's recipe right after its inputs);
:mod:`spmd_compiler.rebuild` only finishes the graph that results.

Splicing maps the recipe's placeholders to nodes of the per-rank graph (the mesh
coordinates and the local inputs), copies every other node, and records on each copy
where it came from (``node.meta["spmd_origin"]``), so a dump can say why a collective
exists. Nothing is matched by position in the target graph.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..errors import user_source_line
from ..trace.markers import RECOMPUTE
from .builder import OutScalar, OutTensor, Recipe, SubgraphBuilder
from .orders import ROWS
from .redistribute import emit_redistribute
from .values import DValue, RScalar

__all__ = ["splice_recipe", "fresh_spec", "redistribute_value", "RANK_SIZES", "FSDP_GATHER"]

# node.meta key: the node's size arguments are this rank's (an uneven shard), other ranks
# have other sizes in the same place; a pass that compares sizes must leave it alone, or
# the ranks' programs stop being the same program
RANK_SIZES = "spmd_rank_sizes"
# node.meta key: the node is part of an FSDP parameter gather made for this phase
# ("forward" or "backward") under Plan(reshard_after_forward=True); a pass must not merge
# it with the other phase's gather, which would keep the full parameter alive in between
FSDP_GATHER = "spmd_fsdp_gather"


def fresh_spec(spec: Any) -> Any:
    """Copy ``spec`` giving each MaskPartial placement its own mask buffer.

    MaskPartial placements compare equal only when they share a mask buffer; a recipe
    replayed for two embeddings must not make their outputs look interchangeable.
    """
    if not any(isinstance(p, pt.MaskPartial) for p in spec.placements):
        return spec
    placements = tuple(
        pt.MaskPartial(p.reduce_op, offset_shape=p.offset_shape, offset_dim=p.offset_dim) if isinstance(p, pt.MaskPartial) else p
        for p in spec.placements
    )
    return pt.DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def splice_recipe(
    graph: fx.Graph,
    recipe: Recipe,
    coords: list[fx.Node],
    inputs: list[fx.Node],
    origin: fx.Node | None,
    arg_names: list[str] | None = None,
) -> Any:
    """Copy ``recipe`` into ``graph`` with its placeholders bound to ``coords + inputs``.

    ``arg_names`` names the traced value behind each tensor argument (for provenance:
    a collective says which value it moves).

    Returns ``(value, replacements)``: the traced node's value (the recipe result with
    every :class:`OutTensor` replaced by a :class:`DValue` over the copied node), and
    reduced copies of tensor arguments by argument index (see ``Recipe.replacements``).
    """
    placeholders = [n for n in recipe.graph.nodes if n.op == "placeholder"]
    bound = list(coords) + list(inputs)
    assert len(placeholders) == len(bound), (len(placeholders), len(bound))
    env: dict[fx.Node, fx.Node] = dict(zip(placeholders, bound))
    record = None
    if origin is not None:
        record = {
            "node": origin.name,
            "op": str(origin.target),
            "source": user_source_line(origin),
        }
    outputs: list[fx.Node] = []
    for n in recipe.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            outputs = [env[x] for x in n.args[0]]
            break
        new = graph.node_copy(n, lambda x: env[x])
        if recipe.coord_dependent:  # sizes differ between ranks: passes must not decide on them
            new.meta[RANK_SIZES] = True
        if record is not None:
            new.meta["spmd_origin"] = record
            new.meta["spmd_phase"] = origin.meta.get("spmd_phase", "output")
            if RECOMPUTE in origin.meta:  # a checkpointed region's recomputation: passes keep it apart
                new.meta[RECOMPUTE] = origin.meta[RECOMPUTE]
            if "stack_trace" in origin.meta:
                new.meta["stack_trace"] = origin.meta["stack_trace"]
            if "spmd_comm" in n.meta:
                comm = {**n.meta["spmd_comm"], "origin": origin.name, "op": str(origin.target), "source": record["source"]}
                idx = comm.get("input_index")
                if arg_names is not None and idx is not None and idx < len(arg_names):
                    comm["value"] = arg_names[idx]
                elif "value_label" in comm:
                    label = comm["value_label"]
                    try:
                        comm["value"] = label.format(*(arg_names or []))
                    except (IndexError, KeyError, ValueError):
                        comm["value"] = label
                new.meta["spmd_comm"] = comm
        env[n] = new

    def to_value(leaf: Any) -> Any:
        if isinstance(leaf, OutTensor):
            mask = outputs[leaf.mask_index] if leaf.mask_index is not None else None
            node = outputs[leaf.index]
            spec = fresh_spec(leaf.spec)
            node.meta["spmd_spec"] = spec
            value = DValue(node, spec, mask)
            if leaf.rows is not None:
                value.extra[ROWS] = leaf.rows
            return value
        if isinstance(leaf, OutScalar):
            return RScalar(outputs[leaf.index], leaf.hint)
        return leaf

    if origin is not None and isinstance(recipe.result, OutTensor):
        main = outputs[recipe.result.index]
        if main not in bound:  # the op's own result takes the traced node's name
            pt.rename_node(main, origin.name)
    result = pytree.tree_map(to_value, recipe.result, is_leaf=lambda x: isinstance(x, (OutTensor, OutScalar)))
    replacements = {i: to_value(o) for i, o in recipe.replacements.items()}
    return result, replacements


def redistribute_value(ex: Any, value: DValue, dst: Any, reason: str, origin: fx.Node | None, value_name: str | None = None) -> DValue:
    """Splice the redistribution of ``value`` to ``dst`` into the per-rank graph."""
    if tuple(value.spec.placements) == tuple(dst.placements):
        return value
    b = SubgraphBuilder(ex.mctx, ex.fake_mode)
    b.sizes = getattr(ex, "local_sizes", None)  # dynamic=True: symbolic local sizes
    x = b.input(value.local, value.node.name)
    mask = b.input(value.mask.meta["val"], "mask") if value.mask is not None else None
    out, _ = emit_redistribute(b, x, value.spec, dst, mask=mask, reason=reason, input_index=0)
    recipe = b.finish(OutTensor(b.slot(out), dst))
    inputs = [value.node] + ([value.mask] if value.mask is not None else [])
    return splice_recipe(ex.graph, recipe, ex.coords, inputs, origin, [value_name or value.node.name])[0]
