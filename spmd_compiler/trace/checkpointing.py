"""Selective activation checkpointing: recompute in backward what the policy does not save.

``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=...)``
with ``create_selective_checkpoint_contexts(policy)`` (torchtitan's per-op save lists:
``mm``, SDPA, ``reduce_scatter``... saved, the rest recomputed) decides per op whether
its output is kept from forward to backward or computed again. Eagerly, backward reruns
the region and takes the saved outputs from a cache. Under a tracer (our make_fx), torch
instead saves *every* output and only records the policy on each forward node
(``node.meta["recompute"]``, read by :func:`~spmd_compiler._private_torch.selective_policy`)
for torch.compile's partitioner to act on: backward reads the forward's values through
``detach`` nodes in the region's (empty) recomputation, and nothing is recomputed.

:func:`recompute_selected` does what the partitioner would: every forward node of a
checkpointed region (``meta[CHECKPOINTED]``) whose policy is "recompute" and that
backward reads is computed again right before that read, from the saved outputs and the
region's inputs; the copies carry the region's ``meta[RECOMPUTE]``, so the passes keep
them apart from the forward (``optimize/redundant.py``). Saved outputs, values that
are not tensors (sizes), random ops (they would draw again) and in-place ops stay as
the forward computed them. Full checkpointing (no policy) is traced as it runs: its
recomputation is already in backward.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from .markers import CHECKPOINTED, RECOMPUTE

__all__ = ["recompute_selected"]

_PASS_THROUGH = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


def _recomputable(node: fx.Node) -> bool:
    if node.op != "call_function" or CHECKPOINTED not in node.meta or pt.selective_policy(node) != "recompute":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if pt.written_args(target) or torch.Tag.nondeterministic_seeded in target.tags:
            return False
    vals = pytree.tree_leaves(node.meta.get("val"))
    return bool(vals) and all(isinstance(v, torch.Tensor) for v in vals)


def recompute_selected(gm: fx.GraphModule) -> int:
    """Recompute in backward the forward values a selective-checkpoint policy did not
    save (see module doc); returns the number of nodes added."""
    copies: dict[tuple[int, fx.Node], fx.Node] = {}
    added = 0

    def recompute(node: fx.Node, region: int, before: fx.Node) -> fx.Node:
        nonlocal added
        if node.meta.get(CHECKPOINTED) != region or not _recomputable(node):
            return node
        key = (region, node)
        if key not in copies:
            args = {a: recompute(a, region, before) for a in node.all_input_nodes}
            with gm.graph.inserting_before(before):
                new = gm.graph.node_copy(node, lambda a: args[a])
            new.meta.pop(CHECKPOINTED, None)
            new.meta.update({RECOMPUTE: region, "spmd_phase": before.meta.get("spmd_phase", "backward")})
            copies[key] = new
            added += 1
        return copies[key]

    for node in list(gm.graph.nodes):
        region = node.meta.get(RECOMPUTE)
        if region is None or node.op != "call_function" or node.target not in _PASS_THROUGH:
            continue
        # the region's recomputation hands backward the forward's value: detach(detach(x))
        src = node.args[0]
        while isinstance(src, fx.Node) and src.target in _PASS_THROUGH and CHECKPOINTED in src.meta:
            src = src.args[0]
        if isinstance(src, fx.Node) and src.meta.get(CHECKPOINTED) == region and _recomputable(src):
            node.replace_input_with(node.args[0], recompute(src, region, node))
    return added
