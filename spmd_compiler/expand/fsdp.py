"""FSDP parameters in expansion (``Plan(fsdp_axes=...)``): gathered for compute, stored sharded.

A parameter sharded on an FSDP mesh axis is all-gathered (Replicate on that axis) where
forward or backward compute reads it; so is a buffer the plan names sharded there (an exact FQN entry, such as
Llama's ``rotary_emb.inv_freq``) unless the step writes it in place (BatchNorm's running
statistics: a write to the gathered copy would be lost, so they stay sharded operands).
``Plan(reshard_after_forward=True)`` (the default,
as ``fully_shard``'s) gathers it once per phase and marks each gather's nodes
(``FSDP_GATHER``) so that no pass merges the two; a backward op that reads a view of the
forward's gather that autograd saved (``t(weight)``) reads the same view of the backward
gather instead (:func:`regathered_view`), so the full parameter is not resident between
its forward and its backward. With ``False`` one gather serves both phases.

Mixed precision (``compile(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))``
or ``torch.autocast``): a cast of an FSDP parameter to a narrower float dtype is made on
the shard, before the gather (:func:`fsdp_cast`), so the gather carries the narrow dtype
(half the bytes for bfloat16), as ``fully_shard``'s ``param_dtype`` does; the cast shard
is then an FSDP value like its parameter (gathered per phase, fused per unit, its nodes
marked ``spmd_param_cast`` so passes see the parameter through it, and placed at the
program's start, so a unit's casts are ready together and its gathers fuse). Its gradient, cast
back to the parameter's dtype by the cast's backward, is reduced in that dtype (float32:
FSDP2's ``reduce_dtype=torch.float32``).

The root unit (parameters outside any numbered block, :func:`unit_of`: embeddings, the
final norm, the output head) is kept from forward to backward under ``True`` too, as
``fully_shard`` does for its root module: its parameters are read last in forward and
first in backward, so a backward gather would be all-gathered right after the forward's
was freed, bytes for no memory (the GPT benchmark's head and final norm: 263,168 bytes
per step, docs/architecture.md).
"""

from __future__ import annotations

import re

from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from .recipes import expand_node
from .splice import FSDP_GATHER, redistribute_value
from .tree import tree_map
from .values import DValue

__all__ = ["fsdp_gathered", "regathered_view", "is_view_op", "nodes_after", "unit_of", "kept_for_backward", "fsdp_cast",
           "is_precision_cast", "PARAM_CAST"]

PARAM_CAST = "spmd_param_cast"  # meta of the nodes casting an FSDP shard (the parameter's FQN)
_CAST_KWARGS = {"dtype", "layout", "device", "pin_memory"}


def unit_of(fqn: str) -> str:
    """``blocks.3.attn.q.weight`` -> ``blocks.3``; names without a number -> ``""`` (the
    root unit), as torchtitan wraps every block of a ModuleList and the root."""
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if re.fullmatch(r"\d+", part):
            return ".".join(parts[: i + 1])
    return ""


def kept_for_backward(ex: Any, value: DValue) -> bool:
    """Whether backward reuses the forward's gather of the FSDP parameter ``value``:
    always without ``reshard_after_forward``, and for the root unit's parameters with it
    (``fully_shard`` does not reshard its root after forward either)."""
    return not ex.reshard_after_forward or unit_of(value.extra["fsdp"]) == ""


def nodes_after(graph: fx.Graph, last: fx.Node) -> list[fx.Node]:
    """The nodes appended to ``graph`` after ``last`` (its last node before)."""
    out, n = [], last.next
    while n.op != "root":
        out.append(n)
        n = n.next
    return out


def is_view_op(target: Any) -> bool:
    """An aten op whose result is a view of its first argument (``t``, ``view``, ``detach``)."""
    rets = getattr(getattr(target, "_schema", None), "returns", None)
    return bool(rets and rets[0].alias_info is not None and not rets[0].alias_info.is_write)


def is_precision_cast(target: Any, args: tuple, kwargs: dict) -> bool:
    """``_to_copy(p, dtype=...)`` of an FSDP value to a narrower floating dtype, nothing else changed."""
    if target is not torch.ops.aten._to_copy.default or not args or not isinstance(args[0], DValue) or "fsdp" not in args[0].extra:
        return False
    src, dtype = args[0].spec.tensor_meta.dtype, kwargs.get("dtype")
    device = kwargs.get("device")
    return (set(kwargs) <= _CAST_KWARGS and isinstance(dtype, torch.dtype) and dtype.is_floating_point and src.is_floating_point
            and dtype.itemsize < src.itemsize and (device is None or torch.device(device) == args[0].local.device)
            and kwargs.get("layout") in (None, torch.strided))


def fsdp_cast(ex: Any, node: fx.Node, target: Any, args: tuple, kwargs: dict) -> DValue:
    """The cast of an FSDP parameter made on its shard (:func:`is_precision_cast`): an FSDP
    value itself, which its readers gather; one per parameter and dtype."""
    value = args[0]
    key = (value.node, kwargs["dtype"])
    got = ex._cast_shards.get(key)
    if got is None:
        last = next(iter(reversed(ex.graph.nodes)))
        got = expand_node(ex, node, target, args, kwargs)
        if tuple(got.spec.placements) != tuple(value.spec.placements):  # not cast where it lies: the plain path
            return expand_node(ex, node, target, (fsdp_gathered(ex, value, node, node.meta.get("spmd_phase")), *args[1:]), kwargs)
        made = nodes_after(ex.graph, last)
        first = next(n for n in ex.graph.nodes if n.op != "placeholder")
        for n in made:  # at the program's start, as the parameter: every cast shard exists before any unit's gather
            n.meta[PARAM_CAST] = value.extra["fsdp"]
            if first not in made:
                first.prepend(n)
        got.extra["fsdp"] = value.extra["fsdp"]
        ex._cast_shards[key] = got
    return got


def fsdp_gathered(ex: Any, value: DValue, node: fx.Node, phase: str) -> DValue:
    """FSDP: the parameter gathered (Replicate on the FSDP axes) for forward or
    backward compute, the shard stays stored. With ``reshard_after_forward`` one gather
    per parameter and phase, its nodes marked (``FSDP_GATHER``) so that no pass merges
    the two; without, and for the root unit's parameters, one gather per parameter that
    backward reuses (:func:`kept_for_backward`)."""
    kept = kept_for_backward(ex, value)
    key = (value.node, "step" if kept else phase)
    got = ex._gathered.get(key)
    if got is None:
        pl = tuple(pt.Replicate() if a in ex.fsdp_axes else p for a, p in enumerate(value.spec.placements))
        dst = pt.DTensorSpec(value.spec.mesh, pl, tensor_meta=value.spec.tensor_meta)
        last = next(iter(reversed(ex.graph.nodes)))
        inp = value.node.meta.get("spmd_input")
        what = "buffer" if inp is not None and inp.kind == "buffer" else "parameter"  # rotary inv_freq is a buffer
        got = redistribute_value(ex, value, dst, f"FSDP: gather {what} {value.extra['fsdp']} for {phase}", node)
        if ex.reshard_after_forward:
            for n in nodes_after(ex.graph, last):
                n.meta[FSDP_GATHER] = phase
        ex._gathered[key] = got
    return got


def regathered_view(ex: Any, x: fx.Node, node: fx.Node) -> DValue | None:
    """Under ``reshard_after_forward``, a backward op that reads a forward view of an
    FSDP parameter (autograd saved ``t(weight)``) reads the same view of the backward
    gather instead, so the forward's gather is not kept alive for it. ``x``: the traced
    argument; None when it is no such view."""
    got = ex._regathered.get(x)
    if got is not None:
        return got
    chain = []
    root = x
    while root.op == "call_function" and root.meta.get("spmd_phase") == "forward" and is_view_op(root.target):
        chain.append(root)
        if not (root.args and isinstance(root.args[0], fx.Node)):
            return None
        root = root.args[0]
    shard = ex.env.get(root)  # the parameter's shard, or its cast (fsdp_cast)
    if not chain or not (isinstance(shard, DValue) and "fsdp" in shard.extra):
        return None
    if kept_for_backward(ex, shard):
        return None  # the root unit: the view autograd saved reads the forward's gather, kept
    cur = fsdp_gathered(ex, shard, node, "backward")
    for c in reversed(chain):
        prev = c.args[0]
        c_args, c_kwargs = tree_map(ex._lookup, (c.args[1:], c.kwargs))
        last = next(iter(reversed(ex.graph.nodes)))
        cur = expand_node(ex, c, c.target, (cur, *c_args), c_kwargs)
        for n in nodes_after(ex.graph, last):
            n.meta["spmd_phase"] = "backward"
            n.meta["spmd_regathered"] = f"{c.name} taken again from the backward gather of {shard.extra['fsdp']}"
        assert isinstance(cur, DValue), (c.format_node(), prev)
        ex._regathered[c] = cur
    return cur
