"""Emission of the sizes of a symbolic program (``dynamic=True``, :mod:`.symbolic`).

:func:`emit_sizes_pass` replaces every symbolic argument of the per-rank graph by a few
integer nodes computed from the ``size_*`` placeholders and the coordinates (local size
symbols replaced by their definitions; one node per distinct sub-expression, marked
``meta["spmd_size_expr"]``, with the expression it computes in ``meta["spmd_size_value"]``).
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from .symbolic import resolve

__all__ = ["emit_sizes_pass", "true_divide"]

log = logging.getLogger(__name__)


_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def true_divide(a: Any, b: Any) -> float:
    """``a / b`` of two sizes with the C++ double semantics one device computes them with
    (torch's ``var`` backward scales by ``2 / (N - correction)`` in C++): a zero divisor
    gives an infinity (NaN for ``0 / 0``) where Python raises ZeroDivisionError."""
    try:
        return a / b
    except ZeroDivisionError:
        a = float(a)
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, float(b))


def emit_sizes_pass(gm: fx.GraphModule, *, sources: dict[Any, fx.Node], definitions: dict | None = None) -> fx.GraphModule:
    """Replace every symbolic argument of ``gm``'s nodes by integer nodes computed from
    ``sources`` (``{symbol: placeholder node}``), local size symbols replaced by their
    ``definitions`` (:class:`LocalSizes`); the sub-expressions are emitted once
    each, right after the last placeholder. Raises if an argument depends on a symbol
    with no source (a bug: such a size cannot be computed at run time)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    memo: dict[Any, Any] = {}
    emitted = [0]

    def emit(expr: Any, as_float: bool) -> Any:
        key = (expr, as_float)
        if key in memo:
            return memo[key]
        out = _emit(expr)
        if as_float and not isinstance(out, float):
            out = call(float, out) if isinstance(out, fx.Node) else float(out)
        memo[key] = out
        return out

    symbols = {node: sym for sym, node in sources.items()}

    def call(fn: Any, *args: Any) -> fx.Node:
        nonlocal anchor
        with graph.inserting_after(anchor):
            node = graph.call_function(fn, args)
        node.meta["spmd_size_expr"] = True
        value = _value_expr(fn, [symbols.get(a, a.meta.get("spmd_size_value")) if isinstance(a, fx.Node) else a for a in args])
        if value is not None:  # for dumps (dump/sizes.py): what the node computes, in sizes and coordinates
            node.meta["spmd_size_value"] = value
        anchor = node
        emitted[0] += 1
        return node

    def _emit(expr: Any) -> Any:
        if expr in sources:
            return sources[expr]
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if isinstance(expr, (sympy.Float, sympy.Rational)):
            return float(expr)
        if expr.is_Symbol:
            raise AssertionError(f"size symbol {expr} has no run-time source among {list(sources)}")
        name = type(expr).__name__
        args = [emit(a, False) for a in expr.args]
        if isinstance(expr, sympy.Add):
            return _fold(call, operator.add, args)
        if isinstance(expr, sympy.Mul):
            return _fold(call, operator.mul, args)
        if isinstance(expr, sympy.Pow):
            base, exp = args
            if isinstance(exp, int) and exp < 0:
                return call(true_divide, 1.0, _fold(call, operator.mul, [base] * (-exp)))
            return call(operator.pow, base, exp)
        table = {
            "FloorDiv": operator.floordiv, "Mod": operator.mod, "PythonMod": operator.mod, "IntTrueDiv": true_divide,
            "FloatTrueDiv": true_divide, "Max": max, "Min": min, "ToFloat": float, "TruncToInt": int,
            "FloorToInt": math.floor, "CeilToInt": math.ceil, "CleanDiv": operator.floordiv,
        }
        fn = table.get(name)
        if fn is None:
            raise NotImplementedError(f"cannot emit size expression {expr} ({name}) as integer ops")
        if fn in (max, min):
            return _fold(call, fn, args)
        return call(fn, *args)

    for node in list(graph.nodes):
        if node.target is operator.truediv:  # a size division the trace recorded
            node.target = true_divide
        if node.op != "call_function" or node.meta.get("spmd_size_expr"):
            continue
        leaves = [x for x in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(x, _SYM_TYPES)]
        if not leaves:
            continue

        def lower(x: Any) -> Any:
            if not isinstance(x, _SYM_TYPES):
                return x
            expr = resolve(pt.sym_expr(x), definitions)
            return emit(expr, isinstance(x, torch.SymFloat))

        # the expression nodes go before their first user, which follows every placeholder
        node.args, node.kwargs = pytree.tree_map(lower, (node.args, node.kwargs))
    graph.lint()
    gm.recompile()
    log.debug("emitted %d integer nodes for symbolic sizes", emitted[0])
    return gm


def _value_expr(fn: Any, args: list[Any]) -> Any:
    """The sympy expression an emitted integer node computes from its arguments' ones."""
    from torch.utils._sympy.functions import FloorDiv

    if any(a is None for a in args):
        return None
    a = [sympy.sympify(x) for x in args]
    table: dict[Any, Callable[..., Any]] = {
        operator.add: lambda x, y: x + y, operator.mul: lambda x, y: x * y, operator.floordiv: FloorDiv,
        operator.mod: sympy.Mod, operator.truediv: lambda x, y: x / y, true_divide: lambda x, y: x / y, operator.pow: lambda x, y: x**y,
        max: sympy.Max, min: sympy.Min, float: lambda x: x, int: lambda x: x if x.is_integer else sympy.Function("int")(x),
        math.floor: sympy.floor, math.ceil: sympy.ceiling,
    }
    build = table.get(fn)
    return build(*a) if build is not None else None


def _fold(call: Callable[..., fx.Node], fn: Any, args: list[Any]) -> Any:
    consts = [a for a in args if not isinstance(a, fx.Node)]
    nodes = [a for a in args if isinstance(a, fx.Node)]
    acc: Any = None
    if consts:
        acc = consts[0]
        for c in consts[1:]:
            acc = fn(acc, c)
    for n in nodes:
        acc = n if acc is None else call(fn, acc, n)
    return acc
