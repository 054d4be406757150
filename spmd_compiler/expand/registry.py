"""Registry of per-op expansion rules, keyed by aten OpOverload.

A rule has the signature ``rule(ctx, b, op, args, kwargs) -> result`` where tensor
arguments arrive as :class:`~spmd_compiler.expand.args.TensorArg` (already inputs of
the recipe builder ``b``) and sizes as :class:`~spmd_compiler.expand.values.DSymInt`.
It emits local ops and collectives into ``b`` and returns the result pytree
(:class:`~spmd_compiler.expand.builder.OutTensor` for tensors). Ops without a rule go
through DTensor's sharding propagation (:func:`~spmd_compiler.expand.dispatch.generic_expand`).
Rules must depend only on their arguments' placements, shapes and values, and on
``ctx.grad_of`` (the planned layouts of the parameters whose gradients they read): their
result is memoized and replayed for identical arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["register_rule", "get_rule", "registered_ops"]

_RULES: dict[Any, Callable[..., Any]] = {}
_RULES_BY_NAME: dict[str, Callable[..., Any]] = {}  # "namespace::name": ops of libraries imported later


def register_rule(*ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: use the decorated function to expand each of ``ops``.

    An op is an OpOverload, or the qualified name of a custom op (``"mylib::my_op"``, for
    every overload) from a library that may be imported after this registration.

    Example::

        @register_rule(torch.ops.aten.my_op.default)
        def _my_op(ctx, b, op, args, kwargs):
            return replicate_fallback(ctx, b, op, args, kwargs, why="my_op needs whole tensors")
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            if isinstance(op, str):
                if "::" not in op:
                    raise ValueError(f"register_rule: expected an OpOverload or a qualified op name 'namespace::name', got {op!r}")
                _RULES_BY_NAME[op] = fn
            else:
                _RULES[op] = fn
        return fn

    return deco


def get_rule(op: Any) -> Callable[..., Any] | None:
    rule = _RULES.get(op)
    if rule is None and _RULES_BY_NAME:
        schema = getattr(op, "_schema", None)
        rule = _RULES_BY_NAME.get(schema.name) if schema is not None else None
    return rule


def registered_ops() -> list[Any]:
    return list(_RULES)
