"""Fused optimizer kernels (``optimizer(fused=True)``): one op updates every parameter.

``_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, ...)``
and its siblings (Adam, SGD, Adagrad) take lists and write them in place. Element ``i``
of every list belongs to parameter ``i``, and the update is elementwise, so each
parameter's shard can be updated where it lives: element ``i`` of every other list is
laid out like parameter ``i`` (its gradient reduced or re-sharded to match, a Partial
gradient of a replicated parameter all-reduced), 0-d tensors (step counts, a tensor
``lr``) replicated, and the op runs once on the local lists. DTensor registers a
strategy for Adam and AdamW only (none for SGD or Adagrad); this rule covers all of
them the same way. A parameter must not be Partial (it never is in a plan).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ... import _private_torch as pt
from ...errors import UnsupportedOpError
from ..builder import OutTensor, SubgraphBuilder
from ..args import ExpandContext, TensorArg, input_placements_text, _global_leaf, _is_tensor_arg
from ..dispatch import _reduces_partial
from ..follow import laid_out_like
from ..redistribute import emit_redistribute
from ..registry import register_rule

aten = torch.ops.aten


def _fused_ops() -> list[Any]:
    out = []
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
        packet = getattr(aten, name, None)
        for overload in ("default", "tensor_lr"):
            op = getattr(packet, overload, None) if packet is not None else None
            if op is not None:
                out.append(op)
    return out


def _replicated(x: TensorArg) -> Any:
    return pt.DTensorSpec(x.spec.mesh, tuple(pt.Replicate() for _ in x.spec.placements), tensor_meta=x.spec.tensor_meta)


@register_rule(*_fused_ops())
def _fused_optimizer(ctx: ExpandContext, b: SubgraphBuilder, op: Any, args: tuple, kwargs: dict) -> Any:
    params = args[0]
    bad = [p for p in params if not isinstance(p, TensorArg) or any(pl.is_partial() for pl in p.spec.placements)]
    if bad:
        raise UnsupportedOpError(
            op, input_placements_text(args, kwargs), ctx.node,
            "a fused optimizer needs every parameter laid out as Shard or Replicate, got a Partial one",
        )
    name = str(op).replace("aten.", "")

    def place(x: Any, param: TensorArg | None, what: str, written: bool = False) -> Any:
        if not isinstance(x, TensorArg):
            return _global_leaf(x)
        dst = _replicated(x) if param is None else laid_out_like(param.spec, x.spec)  # 0-d step counts come out replicated
        reason = f"{what} of {name} laid out like its parameter" if param is not None else f"{what} of {name} (replicated)"
        node, _ = emit_redistribute(b, x.node, x.spec, dst, mask=x.mask, reason=reason, input_index=x.index, value_label=x.label)
        if node is not x.node and x.index is not None and (written or _reduces_partial(x.spec, dst)):
            # the op updates (or later readers reuse) the re-laid-out tensor: it is the value now
            b.replacements[x.index] = OutTensor(b.slot(node), dst, None)
        return node

    schema = op._schema.arguments
    written_at = {i for i, _ in pt.written_args(op)}
    local_args = [[p.node for p in params]]
    for i, a in enumerate(args[1:], start=1):
        written = i in written_at
        if isinstance(a, (list, tuple)) and len(a) == len(params):
            local_args.append([place(x, params[j], f"list argument {schema[i].name}[{j}]", written) for j, x in enumerate(a)])
        else:
            local_args.append(pytree.tree_map(lambda x, i=i: place(x, None, schema[i].name), a, is_leaf=_is_tensor_arg))
    local_kwargs = {k: pytree.tree_map(lambda x, k=k: place(x, None, k), v, is_leaf=_is_tensor_arg) for k, v in kwargs.items()}
    b.call(op, *local_args, **local_kwargs)
    return None
