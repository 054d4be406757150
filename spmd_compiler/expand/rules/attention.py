"""Scaled dot-product attention on shards: one rule for every fused SDPA kernel.

``F.scaled_dot_product_attention`` is traced as one of torch's fused kernels and its
``_backward``: ``_scaled_dot_product_flash_attention_for_cpu`` on CPU; on CUDA
``_scaled_dot_product_flash_attention``, ``_scaled_dot_product_efficient_attention``
or ``_scaled_dot_product_cudnn_attention``, whichever torch picks. DTensor has no
strategy for the CPU kernel; for the CUDA ones its strategies gather the whole query for
a sequence shard, and its efficient and cuDNN backward strategies fail (the philox
seed/offset outputs get no placement), so every backward ran on gathered tensors. The
table ``_ROLES`` names what each argument and output of each kernel is, and one rule
lays them out. Attention is independent per batch row and per head, so:

* **batch** (``Shard(0)`` of the query) and **head** (``Shard(1)``) shards stay local:
  key, value, the mask or bias, the output and the saved ``logsumexp`` are laid out the
  same way and no collective is issued. Grouped keys/values (fewer key heads than query
  heads) split by heads only when both head counts divide evenly, so each rank keeps
  whole groups.
* a **sequence** shard of the query (``Shard(2)``) gathers key and value (each query
  row attends to every key); output and ``logsumexp`` stay sharded by query rows, and
  ``max_q`` is the local row count. In backward the query gradient stays sharded and the
  key/value gradients are ``Partial(sum)`` (each rank's rows contribute). With
  ``is_causal`` the mask is relative to local row numbers, so a sequence-sharded query
  is gathered too, except on the plan's context-parallel axis: there query, key and
  value stay split and the kernel runs in blocks (:mod:`.context_parallel`, mode ``CP``). The efficient kernel pads ``logsumexp`` rows to a multiple of 32, so
  it keeps a sequence shard only when every rank's rows are a multiple of 32.
* a bias gradient (efficient kernel) is sharded like the bias; where the bias is
  broadcast over a split dim it is ``Partial(sum)``.
* anything else (a head-dim shard, a Partial value) runs on whole tensors on that mesh
  axis; the scalar outputs (philox seed/offset, ``rng_state``) are Replicate.
* dropout (``dropout_p > 0``), a debug mask and variable-length inputs (``cum_seq_*``)
  run on whole tensors on every rank (the replicate fallback): a kernel that draws
  sees the global tensors, so it draws what one device draws.

Numerics are tested through the CPU kernel; the CUDA kernels' layouts are tested on fake
CUDA tensors (their meta kernels), since they cannot run here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ... import _private_torch as pt
from ..builder import SubgraphBuilder
from ...errors import UnsupportedOpError
from ..args import ExpandContext, TensorArg, _out_tensor, input_placements_text
from ..dispatch import wrap_result
from ..fallback import replicate_fallback
from ..layout import restride_like
from ..redistribute import emit_redistribute
from ..registry import register_rule
from ..values import DSymInt
from . import context_parallel

aten = torch.ops.aten

# Roles. Arguments (by schema name): "q" is laid out like the query's rows (batch,
# heads, query rows), "kv" like key/value (batch, heads, key rows), "mask" like a mask
# broadcast against (batch, heads, query rows, key rows), "rep" whole (philox state),
# "varlen" must be None (dense inputs), "max_q"/"max_k" the local row counts. Outputs,
# per output: "q", "kv" (a key/value gradient), "mask" (the bias gradient), "rep",
# "max_q"/"max_k" (ints). Arguments not named here are plain values passed through.
_FWD_OUT = ("q", "q", "rep", "rep", "max_q", "max_k", "rep", "rep", "rep")
_BWD_FLASH = {"grad_out": "q", "query": "q", "key": "kv", "value": "kv", "out": "q", "logsumexp": "q",
              "cum_seq_q": "varlen", "cum_seq_k": "varlen", "max_q": "max_q", "max_k": "max_k",
              "philox_seed": "rep", "philox_offset": "rep"}
_QKV = {"query": "q", "key": "kv", "value": "kv"}
_VARIANTS = {
    "_scaled_dot_product_flash_attention_for_cpu": ({**_QKV, "attn_mask": "mask"}, ("q", "q")),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        {"grad_out": "q", **_QKV, "out": "q", "logsumexp": "q", "attn_mask": "mask"}, ("q", "kv", "kv")),
    "_scaled_dot_product_flash_attention": (dict(_QKV), _FWD_OUT),
    "_scaled_dot_product_flash_attention_backward": (_BWD_FLASH, ("q", "kv", "kv")),
    "_scaled_dot_product_efficient_attention": ({**_QKV, "attn_bias": "mask"}, ("q", "q", "rep", "rep")),
    "_scaled_dot_product_efficient_attention_backward": (
        {"grad_out_": "q", **_QKV, "attn_bias": "mask", "out": "q", "logsumexp": "q", "philox_seed": "rep",
         "philox_offset": "rep"}, ("q", "kv", "kv", "mask")),
    "_scaled_dot_product_cudnn_attention": ({**_QKV, "attn_bias": "mask"}, _FWD_OUT),
    "_scaled_dot_product_cudnn_attention_backward": ({**_BWD_FLASH, "attn_bias": "mask"}, ("q", "kv", "kv")),
}
# logsumexp rows padded to a multiple of this (the efficient kernel's kAlignLSE)
_LSE_ROW_BLOCK = {"_scaled_dot_product_efficient_attention": 32, "_scaled_dot_product_efficient_attention_backward": 32}


def _lookup(name: str) -> Any:
    packet = getattr(aten, name, None)  # a kernel this torch lacks is skipped
    return getattr(packet, "default", None)


_ROLES = {op: (name, *roles) for name, roles in _VARIANTS.items() if (op := _lookup(name)) is not None}

BATCH, HEADS, SEQ = 0, 1, 2
CP = "cp"  # a mode: the sequence split over the context-parallel axis, computed in blocks


def _bind(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in op._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _modes(ctx: ExpandContext, q: TensorArg, k: TensorArg, causal: bool, row_block: int, cp_axis: int | None = None) -> list[Any]:
    """Per mesh axis: the query dim kept sharded (BATCH, HEADS, SEQ), CP (the sequence on
    the context-parallel axis: :mod:`.context_parallel`) or None (whole)."""
    mesh = ctx.mctx.shape
    modes: list[Any] = []
    for axis, p in enumerate(q.spec.placements):
        dim = p.dim if type(p) is pt.Shard else None
        if dim == SEQ and axis == cp_axis:
            modes.append(CP)
            continue
        if dim == SEQ and (causal or cp_axis is not None):
            dim = None  # is_causal masks by local row numbers; CP keys are split only on its own axis
        modes.append(dim if dim in (BATCH, HEADS, SEQ) else None)
    heads_q, heads_k = q.spec.shape[HEADS], k.spec.shape[HEADS]
    ways = math.prod(mesh[a] for a, m in enumerate(modes) if m == HEADS)
    if heads_q != heads_k and (heads_q % ways or heads_k % ways):
        modes = [None if m == HEADS else m for m in modes]  # a rank would split a key/value group
    rows = q.spec.shape[SEQ]
    ways = math.prod(mesh[a] for a, m in enumerate(modes) if m == SEQ)
    if row_block > 1 and (rows % ways or (rows // ways) % row_block):
        modes = [None if m == SEQ else m for m in modes]  # padded logsumexp rows would not line up
    return modes


def _placements(role: str, modes: list[Any], spec: Any, q_shape: Any) -> list[Any]:
    out: list[Any] = []
    for dim in modes:
        if dim == CP:
            out.append(pt.Replicate() if role == "rep" else pt.Shard(SEQ))
        elif dim is None or role == "rep" or (role == "kv" and dim == SEQ):
            out.append(pt.Replicate())
        elif role == "mask":  # broadcast against (batch, heads, query rows, key rows)
            mdim = dim - (4 - len(spec.shape))
            sharded = mdim >= 0 and spec.shape[mdim] == q_shape[dim] and spec.shape[mdim] != 1
            out.append(pt.Shard(mdim) if sharded else pt.Replicate())
        else:
            out.append(pt.Shard(dim))
    return out


def _output_placements(role: str, modes: list[Any], mask: list[Any] | None) -> list[Any]:
    out: list[Any] = []
    for axis, dim in enumerate(modes):
        if dim == CP:
            out.append(pt.Replicate() if role == "rep" else pt.Shard(SEQ))  # key/value gradients sent home
        elif dim is None or role == "rep":
            out.append(pt.Replicate())
        elif role == "kv" and dim == SEQ:
            out.append(pt.Partial())  # each rank's query rows add to every key's gradient
        elif role == "mask":  # sharded like the bias; a bias broadcast over the split: partial sums
            out.append(pt.Replicate() if mask is None else mask[axis] if mask[axis].is_shard() else pt.Partial())
        else:
            out.append(pt.Shard(dim))
    return out


def _global(x: Any) -> Any:
    return x.global_value if isinstance(x, DSymInt) else pt.size_hint(x)


def _global_results(ctx: ExpandContext, op: Any, bound: dict[str, Any], device: Any) -> Any:
    """The op's results on global fake tensors (their shapes and strides)."""
    with ctx.fake_mode:
        vals = {
            name: torch.empty_strided(tuple(x.spec.shape), tuple(x.spec.stride), dtype=x.spec.tensor_meta.dtype, device=device)
            if isinstance(x, TensorArg) else _global(x)
            for name, x in bound.items()
        }
        return op(**vals)


def _whole_reason(roles: dict[str, str], bound: dict[str, Any]) -> str:
    """Why this call runs on whole tensors, or '' when the shards can stay."""
    if bound.get("dropout_p", 0.0):
        return "dropout inside attention: the kernel draws on whole tensors, as on one device"
    if bound.get("return_debug_mask", False):
        return "attention with return_debug_mask=True"
    if any(roles.get(n) == "varlen" and v is not None for n, v in bound.items()):
        return "variable-length attention (cum_seq_q/cum_seq_k)"
    if not all(isinstance(bound.get(n), TensorArg) for n in ("query", "key", "value")):
        return "attention without tensor query/key/value"
    unknown = [n for n, v in bound.items() if isinstance(v, TensorArg) and n not in roles]
    if unknown:
        return f"tensor arguments {unknown} this torch added, which the attention rule has no role for"
    return ""


@register_rule(*_ROLES)
def _attention(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    name, roles, out_roles = _ROLES[op]
    bound = _bind(op, args, kwargs)
    why = _whole_reason(roles, bound)
    if why:
        if any(isinstance(x, TensorArg) and not all(p.is_replicate() for p in x.spec.placements) for x in bound.values()):
            if ctx.fallback == "error":
                raise UnsupportedOpError(op, input_placements_text(args, kwargs), ctx.node, f"it would run on gathered inputs: {why}")
            ctx.warn_once((op, why), "spmd_compiler: %s runs on gathered inputs: %s", op, why)
        return replicate_fallback(ctx, b, op, args, kwargs, why=why)
    q, k = bound["query"], bound["key"]
    causal = bool(bound.get("is_causal", False))
    cp_axis = _cp_axis(ctx, op, bound, causal)
    modes = _modes(ctx, q, k, causal, _LSE_ROW_BLOCK.get(name, 1), cp_axis)
    local: dict[str, Any] = {}
    mask_placements = None
    for arg, x in bound.items():
        if not isinstance(x, TensorArg):
            local[arg] = x.local_value if isinstance(x, DSymInt) else pt.size_hint(x)
            continue
        placements = _placements(roles[arg], modes, x.spec, q.spec.shape)
        if roles[arg] == "mask":
            mask_placements = placements
        dst = pt.make_spec(ctx.mctx.mesh, placements, x.spec.shape, x.spec.stride, x.spec.tensor_meta.dtype)
        node, _ = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=f"{arg} of {name} (attention layout)",
                                    input_index=x.index, value_label=x.label)
        if node is not x.node:  # a gathered value is contiguous: back to the traced layout
            node = restride_like(b, node, x.spec.shape, x.spec.stride)
        local[arg] = node
    rows = {"max_q": local["query"].meta["val"].shape[SEQ], "max_k": local["key"].meta["val"].shape[SEQ]}
    for arg, role in roles.items():
        if role in rows and arg in local:
            local[arg] = int(rows[role])  # this rank's rows, whatever the trace passed
    if CP in modes:
        return _context_parallel(ctx, b, op, bound, local, modes, mask_placements, cp_axis, causal)
    positional = [a.name for a in op._schema.arguments if not a.kwarg_only and a.name in local]
    node = b.call(op, *(local.pop(n) for n in positional), **local)
    results = _global_results(ctx, op, bound, q.local.device)
    specs = [
        pt.make_spec(ctx.mctx.mesh, _output_placements(role, modes, mask_placements), r.shape, r.stride(), r.dtype)
        if isinstance(r, torch.Tensor) else None
        for role, r in zip(out_roles, results)
    ]
    out = wrap_result(b, node, specs, {}, ctx, op)
    if "max_q" not in out_roles:
        return out
    seq_axes = tuple(a for a, m in enumerate(modes) if m == SEQ and ctx.mctx.shape[a] > 1)
    out = list(out)
    for i, role in enumerate(out_roles):
        if role in rows:
            g, l = int(results[i]), int(node.meta["val"][i])
            axes = seq_axes if role == "max_q" else ()
            out[i] = DSymInt(g, l, axes, f"{name}.{role}") if axes else g
    return tuple(out)


def _cp_axis(ctx: ExpandContext, op: Any, bound: dict[str, Any], causal: bool) -> int | None:
    """The context-parallel axis when this call runs in blocks there (:mod:`.context_parallel`):
    the plan names one, the kernel has a block form, query/key/value are split by rows
    on it alike (self-attention, equal lengths), no mask; else None."""
    cp = ctx.mctx.cp
    if cp is None or op not in context_parallel.KERNELS or any(bound.get(n) is not None for n in ("attn_mask", "attn_bias")):
        return None
    q, k, v = bound["query"], bound["key"], bound["value"]
    if q.spec.placements[cp.axis] != pt.Shard(SEQ) or not q.spec.shape[SEQ] == k.spec.shape[SEQ] == v.spec.shape[SEQ]:
        return None
    if k.spec.placements[cp.axis] != pt.Shard(SEQ) or v.spec.placements[cp.axis] != pt.Shard(SEQ):
        return None
    n = ctx.mctx.shape[cp.axis]
    chunks = 2 if cp.load_balance and causal else 1
    if q.spec.shape[SEQ] % n or not context_parallel.supports(op, q.spec.shape[SEQ] // n, chunks) or any(type(p) is pt.Shard and p.dim == SEQ for a, p in enumerate(q.spec.placements) if a != cp.axis):
        return None
    return cp.axis


def _context_parallel(ctx: ExpandContext, b: SubgraphBuilder, op: Any, bound: dict[str, Any], local: dict[str, Any], modes: list[Any],
                      mask: Any, axis: int, causal: bool) -> Any:
    """The kernel in blocks over the context-parallel axis; results laid out as the op's."""
    cp = ctx.mctx.cp
    kernel = context_parallel.KERNELS[op]
    options = dict(axis=axis, causal=causal, chunks=2 if cp.load_balance else 1, method=cp.attention, scale=bound.get("scale"),
                   reason=f"{op}")
    if op in context_parallel.FORWARD_OPS:
        out, lse, first = context_parallel.forward(b, kernel, local["query"], local["key"], local["value"], **options)
        nodes = [out, lse, *first[2:]]  # the kernel's other results: the first call's (philox state, row counts)
    else:
        grad = local.get("grad_out", local.get("grad_out_"))
        nodes = list(context_parallel.backward(b, kernel, grad, local["query"], local["key"], local["value"], local["out"],
                                               local["logsumexp"], extra=local, **options))
    name, roles, out_roles = _ROLES[op]
    results = _global_results(ctx, op, bound, bound["query"].local.device)
    rows = local["query"].meta["val"].shape[SEQ]
    out: list[Any] = []
    for role, node, r in zip(out_roles, nodes, results):
        if role in ("max_q", "max_k"):  # this rank's rows of a sequence split over the axis
            out.append(DSymInt(int(r), int(rows), (axis,), f"{name}.{role}"))
        elif not isinstance(r, torch.Tensor):
            out.append(r)
        else:
            node = restride_like(b, node, tuple(r.shape), tuple(r.stride()))
            spec = pt.make_spec(ctx.mctx.mesh, _output_placements(role, modes, mask), r.shape, r.stride(), r.dtype)
            out.append(_out_tensor(b, node, spec, {}))
    while len(out) < len(out_roles):  # results the block form has none of (efficient backward's bias gradient)
        out.append(None)
    return tuple(out)
