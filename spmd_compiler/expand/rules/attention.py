"""Scaled dot-product attention on shards.

``F.scaled_dot_product_attention`` on CPU is traced as
``_scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``), for which DTensor
has no strategy. Attention is independent per batch row and per head, so:

* **batch** (``Shard(0)`` of the query) and **head** (``Shard(1)``) shards stay local:
  key, value, the mask, the output and the saved ``logsumexp`` are laid out the same
  way and no collective is issued. Grouped keys/values (fewer key heads than query
  heads) split by heads only when both head counts divide evenly, so each rank keeps
  whole groups.
* a **sequence** shard of the query (``Shard(2)``) gathers key and value (each query
  row attends to every key); output and ``logsumexp`` stay sharded by query rows. In
  backward the query gradient stays sharded and the key/value gradients are
  ``Partial(sum)`` (each rank's rows contribute). With ``is_causal`` the mask is
  relative to local row numbers, so a sequence-sharded query is gathered too.
* anything else (a head-dim shard, a Partial value, dropout) runs on whole tensors
  on that mesh axis.

The CUDA variants (flash, efficient, cuDNN) have DTensor strategies that already keep
batch and head shards local; they go through DTensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import SubgraphBuilder
from ..dispatch import ExpandContext, TensorArg, generic_expand, wrap_result
from ..layout import restride_like
from ..redistribute import emit_redistribute
from ..registry import register_rule

aten = torch.ops.aten

# argument roles: "q" is laid out like the query's rows (batch, heads, query rows),
# "kv" like key/value (batch, heads, key rows); outputs likewise
_ROLES = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (
        {"query": "q", "key": "kv", "value": "kv", "attn_mask": "mask"},
        ("q", "q"),
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        {"grad_out": "q", "query": "q", "key": "kv", "value": "kv", "out": "q", "logsumexp": "q", "attn_mask": "mask"},
        ("q", "kv", "kv"),
    ),
}

BATCH, HEADS, SEQ = 0, 1, 2


def _bind(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in op._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _modes(ctx: ExpandContext, q: TensorArg, k: TensorArg, causal: bool) -> list[int | None]:
    """Per mesh axis: the query dim kept sharded (BATCH, HEADS, SEQ) or None (whole)."""
    mesh = ctx.mctx.shape
    modes: list[int | None] = []
    for p in q.spec.placements:
        dim = p.dim if type(p) is pt.Shard else None
        if dim == SEQ and causal:
            dim = None  # is_causal masks by local row numbers
        modes.append(dim if dim in (BATCH, HEADS, SEQ) else None)
    heads_q, heads_k = q.spec.shape[HEADS], k.spec.shape[HEADS]
    ways = math.prod(mesh[a] for a, m in enumerate(modes) if m == HEADS)
    if heads_q != heads_k and (heads_q % ways or heads_k % ways):
        modes = [None if m == HEADS else m for m in modes]  # a rank would split a key/value group
    return modes


def _placements(role: str, modes: list[int | None], spec: Any, q_shape: Any) -> list[Any]:
    out: list[Any] = []
    for dim in modes:
        if dim is None or (role == "kv" and dim == SEQ):
            out.append(pt.Replicate())
        elif role == "mask":  # broadcast against (batch, heads, query rows, key rows)
            mdim = dim - (4 - len(spec.shape))
            sharded = mdim >= 0 and spec.shape[mdim] == q_shape[dim] and spec.shape[mdim] != 1
            out.append(pt.Shard(mdim) if sharded else pt.Replicate())
        else:
            out.append(pt.Shard(dim))
    return out


def _output_placements(role: str, modes: list[int | None]) -> list[Any]:
    out: list[Any] = []
    for dim in modes:
        if dim is None:
            out.append(pt.Replicate())
        elif role == "kv" and dim == SEQ:
            out.append(pt.Partial())  # each rank's query rows add to every key's gradient
        else:
            out.append(pt.Shard(dim))
    return out


def _global_results(ctx: ExpandContext, op: Any, bound: dict[str, Any], device: Any) -> Any:
    """The op's results on global fake tensors (their shapes and strides)."""
    with ctx.fake_mode:
        vals = {
            name: torch.empty_strided(tuple(x.spec.shape), tuple(x.spec.stride), dtype=x.spec.tensor_meta.dtype, device=device)
            if isinstance(x, TensorArg) else pt.size_hint(x)
            for name, x in bound.items()
        }
        return op(**vals)


@register_rule(*_ROLES)
def _attention(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    roles, out_roles = _ROLES[op]
    bound = _bind(op, args, kwargs)
    q, k = bound["query"], bound["key"]
    if bound.get("dropout_p", 0.0) or not all(isinstance(bound.get(n), TensorArg) for n in ("query", "key", "value")):
        return generic_expand(ctx, b, op, args, kwargs)  # random dropout: no shard-local meaning
    modes = _modes(ctx, q, k, bool(bound.get("is_causal", False)))
    name = str(op).replace("aten.", "")
    local: dict[str, Any] = {}
    for arg, x in bound.items():
        if not isinstance(x, TensorArg):
            local[arg] = pt.size_hint(x)
            continue
        dst = pt.make_spec(ctx.mctx.mesh, _placements(roles[arg], modes, x.spec, q.spec.shape), x.spec.shape, x.spec.stride, x.spec.tensor_meta.dtype)
        node, _ = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=f"{arg} of {name} (attention layout)",
                                    input_index=x.index, value_label=x.label)
        if node is not x.node:  # a gathered value is contiguous: back to the traced layout
            node = restride_like(b, node, x.spec.shape, x.spec.stride)
        local[arg] = node
    positional = [a.name for a in op._schema.arguments if not a.kwarg_only and a.name in local]
    node = b.call(op, *(local.pop(n) for n in positional), **local)
    results = _global_results(ctx, op, bound, q.local.device)
    specs = [
        pt.make_spec(ctx.mctx.mesh, _output_placements(role, modes), r.shape, r.stride(), r.dtype)
        for role, r in zip(out_roles, results)
    ]
    return wrap_result(b, node, specs, {}, ctx, op)
