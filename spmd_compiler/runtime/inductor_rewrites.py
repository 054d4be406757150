"""The graph rewrites a per-rank program goes through before inductor compiles it
(:mod:`.inductor`, on a copy of each segment).

**Host scalars.** The traced optimizer reads its hyperparameters (lr, betas, the step
count) with ``.item()`` and does scalar arithmetic on the Python floats. Inductor passes
such unbacked floats to its C++ kernels as 32-bit ``float``, which rounds lr=0.01 by
2e-10: far outside the float64 contract. :func:`scalars_as_tensors` first rewrites every
float ``.item()`` and the scalar arithmetic after it into 0-d float64 tensor ops, which
kernels read from memory in double precision, with the op order eager uses (``addcdiv``
and ``addcmul`` become ``self + value * t1 / t2`` and ``self + value * t1 * t2``).
A consumer it does not know keeps its ``.item()`` (and inductor's float32 scalar).

**Bool collectives** run on uint8 copies (:func:`bool_collectives_as_uint8`): the C++
vectorizer fails on a gathered bool mask (torch 2.13).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..expand.emit_sizes import true_divide

__all__ = ["bool_collectives_as_uint8", "scalars_as_tensors"]

aten = torch.ops.aten
_SCALAR_OPS = {
    operator.add: aten.add.Tensor, operator.sub: aten.sub.Tensor, operator.mul: aten.mul.Tensor,
    operator.truediv: aten.div.Tensor, true_divide: aten.div.Tensor, operator.pow: aten.pow.Tensor_Tensor, operator.neg: aten.neg.default,
}


def _is_float_item(n: fx.Node) -> bool:
    if n.target is not aten._local_scalar_dense.default:
        return False
    src = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    return isinstance(src, torch.Tensor) and src.dtype.is_floating_point


def _tensor_overload(op: Any, index: int) -> Any:
    """The overload of ``op``'s packet that takes a Tensor where ``op`` takes a Scalar at
    argument ``index`` (same argument names otherwise), or None."""
    schema = op._schema
    names = [a.name for a in schema.arguments]
    for name in op._overloadpacket.overloads():
        other = getattr(op._overloadpacket, name)
        args = other._schema.arguments
        if [a.name for a in args] == names and isinstance(args[index].type, torch.TensorType) and other is not op:
            if all(str(a.type) == str(b.type) for i, (a, b) in enumerate(zip(args, schema.arguments)) if i != index):
                return other
    return None


def _rewrite_consumer(g: fx.Graph, user: fx.Node, tensors: dict[fx.Node, fx.Node]) -> bool:
    """Make ``user`` read 0-d tensors instead of host scalars; False if it cannot."""
    op = user.target
    if not isinstance(op, torch._ops.OpOverload):
        return False
    if op in (aten.addcdiv_.default, aten.addcdiv.default, aten.addcmul_.default, aten.addcmul.default):
        value = user.kwargs.get("value", user.args[3] if len(user.args) > 3 else 1)
        if not (isinstance(value, fx.Node) and value in tensors) or any(a in tensors for a in user.args[:3]):
            return False
        self_, t1, t2 = user.args[:3]
        name = op.overloadpacket.__name__
        with g.inserting_before(user):
            scaled = g.call_function(aten.mul.Tensor, (t1, tensors[value]))  # eager: self + value * t1 / t2
            term = g.call_function(aten.div.Tensor if name.startswith("addcdiv") else aten.mul.Tensor, (scaled, t2))
            new = g.call_function(aten.add_.Tensor if name.endswith("_") else aten.add.Tensor, (self_, term))
        user.replace_all_uses_with(new)
        g.erase_node(user)
        return True
    if op in (aten.add_.Tensor, aten.add.Tensor, aten.sub_.Tensor, aten.sub.Tensor) and len(user.args) == 2:
        alpha = user.kwargs.get("alpha")  # SGD: p.add_(grad, alpha=-lr); eager: self + alpha * other
        if not (isinstance(alpha, fx.Node) and alpha in tensors) or any(a in tensors for a in user.args) or len(user.kwargs) > 1:
            return False
        with g.inserting_before(user):
            term = g.call_function(aten.mul.Tensor, (user.args[1], tensors[alpha]))
            new = g.call_function(op, tuple(user.args[:1]) + (term,))
        user.replace_all_uses_with(new)
        g.erase_node(user)
        return True
    args = op._schema.arguments
    positions = {a.name: i for i, a in enumerate(args)}
    flat = list(user.args) + [None] * (len(args) - len(user.args))
    for k, v in user.kwargs.items():
        flat[positions[k]] = v
    target = op
    for i, v in enumerate(flat):
        if isinstance(v, fx.Node) and v in tensors and not isinstance(args[i].type, torch.TensorType):
            target = _tensor_overload(target, i)
            if target is None:
                return False
    user.target = target
    user.args = tuple(tensors.get(a, a) if isinstance(a, fx.Node) else a for a in user.args)
    user.kwargs = {k: tensors.get(v, v) if isinstance(v, fx.Node) else v for k, v in user.kwargs.items()}
    return True


def scalars_as_tensors(gm: fx.GraphModule) -> int:
    """Rewrite, in place, float ``.item()`` values and the Python scalar arithmetic on them
    into 0-d float64 tensor ops (see the module docstring). Returns how many consumers now
    read a tensor."""
    g = gm.graph
    tensors: dict[fx.Node, fx.Node] = {}
    devices: dict[fx.Node, torch.device] = {}
    default = next((p.meta["val"].device for p in g.nodes if p.op == "placeholder" and isinstance(p.meta.get("val"), torch.Tensor)),
                   torch.device("cpu"))
    for n in list(g.nodes):
        if _is_float_item(n):
            devices[n] = n.args[0].meta["val"].device
            with g.inserting_after(n):
                tensors[n] = g.call_function(aten._to_copy.default, (n.args[0],), {"dtype": torch.float64})
        elif n.op == "call_function" and n.target is float and len(n.args) == 1 and isinstance(n.args[0], fx.Node):
            src = n.args[0]  # float() of a size (dynamic=True: emit_sizes)
            devices[n] = devices.get(src, default)
            if src in tensors:
                tensors[n] = tensors[src]
            else:
                with g.inserting_after(n):
                    tensors[n] = g.call_function(aten.scalar_tensor.default, (src,), {"dtype": torch.float64, "device": devices[n]})
        elif n.op == "call_function" and n.target in _SCALAR_OPS and any(a in tensors for a in n.all_input_nodes):
            if not all(isinstance(a, (int, float)) or a in tensors for a in n.args) or n.kwargs:
                continue
            device = devices[n] = next(devices[a] for a in n.args if isinstance(a, fx.Node))
            with g.inserting_before(n.next):  # in order, after n
                ts = [tensors[a] if isinstance(a, fx.Node) else g.call_function(
                    aten.scalar_tensor.default, (float(a),), {"dtype": torch.float64, "device": device}) for a in n.args]
                tensors[n] = g.call_function(_SCALAR_OPS[n.target], tuple(ts))
    done = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target in _SCALAR_OPS or n in tensors.values():
            continue
        if any(a in tensors for a in n.all_input_nodes) and _rewrite_consumer(g, n, tensors):
            done += 1
    g.eliminate_dead_code()
    gm.recompile()
    return done


def bool_collectives_as_uint8(gm: fx.GraphModule) -> int:
    """Run collectives of bool tensors (an FSDP plan gathers the attention mask) on uint8
    copies, converted back after their wait: inductor's C++ vectorizer fails on a bool
    collective's output used as a ``where`` mask (torch 2.13). Returns how many."""
    g, done = gm.graph, 0
    for n in list(g.nodes):
        if n.op != "call_function" or getattr(n.target, "namespace", None) != "_c10d_functional" or not n.args:
            continue
        x = n.args[0]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        waits = [u for u in n.users if u.target is torch.ops._c10d_functional.wait_tensor.default]
        if not (isinstance(val, torch.Tensor) and val.dtype == torch.bool and waits and len(waits) == len(n.users)):
            continue
        with g.inserting_before(n):
            n.args = (g.call_function(aten._to_copy.default, (x,), {"dtype": torch.uint8}), *n.args[1:])
        for w in waits:
            with g.inserting_after(w):
                back = g.call_function(aten._to_copy.default, (w,), {"dtype": torch.bool})
            w.replace_all_uses_with(back, delete_user_cb=lambda u, back=back: u is not back)
        done += 1
    gm.recompile()
    return done
