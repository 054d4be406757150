"""One traced aten op in expansion: its recipe, from the cache or built, spliced in.

:func:`expand_node` looks the op's recipe up in the expansion's cache (:mod:`.cache`) or
builds it (:func:`build_recipe`: :func:`.dispatch.expand_op` on a fresh
:class:`.builder.SubgraphBuilder`), then splices it into the per-rank graph
(:mod:`.splice`). ``ex`` is the :class:`.expander.Expansion` in progress.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from . import dispatch, positions
from .. import _private_torch as pt
from .args import RESULT, ExpandContext, ScalarArg, TensorArg
from .builder import Recipe, SubgraphBuilder
from ..trace.grad_links import GRAD_OF
from .cache import abstract_key
from . import orders
from .orders import rows_of
from .splice import splice_recipe
from .tree import leaves, tree_map
from .values import DValue, RScalar, _key, placements_text

__all__ = ["expand_node", "build_recipe", "inputs_by_leaf"]

aten = torch.ops.aten

log = logging.getLogger("spmd_compiler.expand.expander")  # the logger name users filter on


def inputs_by_leaf(args: Any, kwargs: Any) -> list[fx.Node]:
    """The per-rank node of every DValue argument, in flatten order."""
    return [x.node for x in leaves((args, kwargs)) if isinstance(x, DValue)]


def expand_node(ex: Any, node: fx.Node, op: Any, args: tuple, kwargs: dict) -> Any:
    """Splice the recipe of traced ``node`` (``op`` on expanded ``args``/``kwargs``) into
    ``ex.graph``; returns its value (a reduced Partial argument replaces its env entry)."""
    traced_args = [a for a in leaves((node.args, node.kwargs)) if isinstance(a, fx.Node) and isinstance(ex.env.get(a), DValue)]
    grad_of = _gradient_params(ex, traced_args)
    result_of = _result_param(ex, node)
    if result_of is not None:  # a rule may compute a gradient in its parameter's layout
        grad_of[RESULT] = result_of
    key = (op, abstract_key(args), abstract_key(kwargs), ex.fallback, ex.activation_sharding, ex.rng, ex.mctx.cp)
    if grad_of:  # a rule may lay a gradient out like its parameter
        key += (tuple((i, tuple(s.placements), tuple(_key(d) for d in s.shape)) for i, s in grad_of.items()),)
    if op in orders.ENTRY_OPS:  # a sort of token routing: its order is named after it; local, or global after an escape
        key += (node.name, node.name in ex.routing_global)
    if ex.dynamic:  # recipes hold this trace's fake values: shared by its ranks, not by other traces
        key += (ex.fake_mode,)
    recipe = ex.cache.lookup(key, ex.mctx.coordinate)
    hit = recipe is not None
    if recipe is None:
        recipe = build_recipe(ex, node, op, args, kwargs, grad_of=grad_of)
        ex.cache.store(key, ex.mctx.coordinate, recipe)
    if log.isEnabledFor(logging.DEBUG):
        ins = ", ".join(placements_text(a.spec.placements) for a in leaves((args, kwargs)) if isinstance(a, DValue))
        out = recipe.result.spec.placements if hasattr(recipe.result, "spec") else None
        log.debug(
            "expand %s = %s(%s) -> %s: %d nodes, %d collectives (%s)",
            node.name, op, ins, placements_text(out) if out else "-", len(recipe.graph.nodes), recipe.num_collectives(), "cached" if hit else "new",
        )
    if recipe.coord_dependent:
        ex.stats.coord_dependent = True
    if "fallback" in recipe.notes:
        ex.stats.fallbacks.append((node.name, str(op), recipe.notes["fallback"]))
    inputs: list[fx.Node] = []
    for leaf in leaves((args, kwargs)):
        if isinstance(leaf, DValue):
            inputs.append(leaf.node)
            if leaf.mask is not None:
                inputs.append(leaf.mask)
        elif isinstance(leaf, RScalar):
            inputs.append(leaf.node)
    value, replacements = splice_recipe(ex.graph, recipe, ex.coords, inputs, node, [a.name for a in traced_args])
    if replacements:
        # a Partial argument was reduced for this op: later users take the reduced copy
        for i, new in replacements.items():
            if i < len(traced_args) and ex.env[traced_args[i]].node is inputs_by_leaf(args, kwargs)[i]:
                ex.env[traced_args[i]] = new
    return value


def _gradient_params(ex: Any, traced_args: list[fx.Node]) -> dict[int, Any]:
    """Index of each argument that is a parameter's gradient (``spmd_grad_of``, tagged
    while tracing) -> the parameter's spec as planned."""
    out = {}
    for i, a in enumerate(traced_args):
        name = a.meta.get(GRAD_OF)
        if name is not None:
            try:
                out[i] = ex.input_value("param", name).spec
            except KeyError:  # not a traced input (a frozen parameter)
                pass
    return out


def _result_param(ex: Any, node: fx.Node) -> Any:
    """The spec, as compute sees it, of the parameter whose gradient ``node`` computes:
    ``p.grad``'s node itself, or a term of it (the embedding's part of a tied embedding's
    gradient, added to the output layer's), followed through at most three adds or
    detaches; else None. On ``fsdp_axes`` the parameter is gathered for compute, so it is
    Replicate there (its gradient is reduce-scattered into the shard afterwards)."""
    seen = node
    for _ in range(4):
        name = seen.meta.get(GRAD_OF)
        if name is not None:
            try:
                spec = ex.input_value("param", name).spec
            except KeyError:
                return None
            if not any(spec.placements[a].is_shard() for a in ex.fsdp_axes):
                return spec
            placements = [pt.Replicate() if a in ex.fsdp_axes else p for a, p in enumerate(spec.placements)]
            return pt.DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)
        adds = [u for u in seen.users if u.target in (aten.add.Tensor, aten.detach.default)]
        if len(seen.users) != 1 or not adds:
            return None
        seen = adds[0]
    return None


def build_recipe(ex: Any, node: fx.Node, op: Any, args: tuple, kwargs: dict, grad_of: dict[int, Any] | None = None) -> Recipe:
    """The recipe of ``op`` on these arguments: dispatch (a rule or DTensor) on a fresh builder."""
    b = SubgraphBuilder(ex.mctx, ex.fake_mode)
    b.sizes = ex.local_sizes
    ctx = ExpandContext(ex.mctx, ex.fake_mode, ex.fallback, node, ex.warned, ex.activation_sharding, ex.rng, grad_of=grad_of,
                        routing_global=ex.routing_global)

    counter = iter(range(1 << 30))

    def to_arg(x: Any) -> Any:
        if isinstance(x, DValue):
            n = b.input(x.local, x.node.name)
            mask = b.input(x.mask.meta["val"], x.node.name + "_mask") if x.mask is not None else None
            return TensorArg(n, x.spec, mask, index=next(counter), positions=positions.positions_of(x), rows=rows_of(x))
        if isinstance(x, RScalar):
            return ScalarArg(b.input(x.hint, "scalar"), x.hint)
        return x

    r_args, r_kwargs = tree_map(to_arg, (args, kwargs))
    result = dispatch.expand_op(ctx, b, op, r_args, r_kwargs)
    notes = {}
    fallback = [n.meta["spmd_fallback"] for n in b.graph.nodes if "spmd_fallback" in n.meta]
    if fallback:
        notes["fallback"] = fallback[0]
    return b.finish(result, notes)
