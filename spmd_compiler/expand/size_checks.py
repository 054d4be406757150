"""Size guards as Python functions, compiled once, exact for every size.

A size guard (:class:`~spmd_compiler.expand.symbolic.SizeGuards`) is a sympy condition
on the global batch sizes. Evaluating it by sympy substitution costs ~0.1 ms, and a
``compile(dynamic=True)`` step checks every rank's guards at every call. :func:`as_python`
compiles a condition once into a Python function of the sizes
(:func:`spmd_compiler._private_torch.sympy_as_python`, as value guards do), after
rewriting it into integer operations only, so that Python's exact ints give sympy's
answer for every size:

* a relation with rational coefficients is multiplied through by the (positive) common
  denominator: ``s/3 < 2`` becomes ``s - 6 < 0``;
* ``floor(p/q)`` becomes ``p // q`` and ``ceiling(p/q)`` becomes ``-((-p) // q)``
  (torch's printer would write ``math.floor((1/3)*s)``, a float product that is wrong
  for some sizes: ``(1/49)*49`` is ``0.999...``);
* ``FloorDiv``, ``Mod``, ``Min``, ``Max``, sums, products and non-negative integer
  powers are kept (exact on ints).

Anything else (a float, an unknown function) is not compiled: :class:`SizeCheck` then
evaluates it with sympy, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
from sympy.logic.boolalg import BooleanAtom

from .. import _private_torch as pt

__all__ = ["integer_form", "as_python", "SizeCheck", "size_check"]

_KEPT = {"FloorDiv", "CleanDiv", "Mod", "PythonMod", "Min", "Max"}
_FLOOR = {"floor", "FloorToInt"}
_CEIL = {"ceiling", "CeilToInt"}


def integer_form(expr: Any) -> Any:
    """``expr`` rewritten with integer operations only (equal to it for every integer value
    of its symbols), or None when it holds something else (floats, unknown functions)."""
    if isinstance(expr, BooleanAtom) or expr.is_Integer or expr.is_Symbol:
        return expr
    if isinstance(expr, sympy.core.relational.Relational):
        num = _over_positive(expr.lhs - expr.rhs)
        return None if num is None else expr.func(num[0], 0)
    if isinstance(expr, (sympy.And, sympy.Or, sympy.Not)):
        args = [integer_form(a) for a in expr.args]
        return None if any(a is None for a in args) else expr.func(*args)
    name = type(expr).__name__
    if name in _FLOOR | _CEIL:
        num = _over_positive(expr.args[0])
        if num is None:
            return None
        p, q = num
        if q == 1:
            return p
        from torch.utils._sympy.functions import FloorDiv

        return FloorDiv(p, q) if name in _FLOOR else -FloorDiv(-p, q)
    if isinstance(expr, sympy.Pow):
        base, exp = expr.args
        if not (exp.is_Integer and exp >= 0):
            return None
        base = integer_form(base)
        return None if base is None else sympy.Pow(base, exp)
    if isinstance(expr, (sympy.Add, sympy.Mul)) or name in _KEPT:
        args = [integer_form(a) for a in expr.args]
        return None if any(a is None for a in args) else expr.func(*args)
    return None


def _over_positive(expr: Any) -> tuple[Any, int] | None:
    """``expr`` as ``p / q``: ``p`` in :func:`integer_form`, ``q`` a positive int; or None."""
    if type(expr).__name__ == "IntTrueDiv":  # a / b of ints
        a, b = expr.args
        p = integer_form(a)
        return (p, int(b)) if p is not None and b.is_Integer and b > 0 else None
    if expr.is_Integer or expr.is_Symbol:
        return expr, 1
    p, q = sympy.fraction(sympy.together(expr))
    if not (q.is_Integer and q > 0):
        return None
    p = integer_form(p)
    return None if p is None else (p, int(q))


def as_python(expr: Any, symbols: tuple[Any, ...]) -> Callable[..., Any] | None:
    """``expr`` (a condition on integer ``symbols``) as an exact Python function of their
    values, or None when it has no integer form (sympy must evaluate it)."""
    form = integer_form(expr)
    return None if form is None else pt.sympy_as_python(form, symbols)


@dataclass(frozen=True)
class SizeCheck:
    """One size guard, ready to evaluate: ``bound`` is ``expr`` with the rank's coordinates
    (and the symbols torch replaced) substituted, ``fn`` it as a Python function of
    ``args`` (None: evaluated with sympy)."""

    expr: Any
    where: str
    bound: Any
    args: tuple[Any, ...]
    fn: Callable[..., Any] | None = field(compare=False, repr=False)

    def broken(self, values: dict[Any, int]) -> str | None:
        """Why the sizes ``values`` ({symbol: int}) break the guard (text), or None when it
        holds. A guard that cannot be evaluated counts as broken."""
        if self.fn is not None and all(a in values for a in self.args):
            holds = bool(self.fn(*[values[a] for a in self.args]))
        else:
            value = self.bound.xreplace({k: sympy.Integer(v) for k, v in values.items()})
            if not isinstance(value, (bool, BooleanAtom)):
                return f"{self.expr} cannot be evaluated for {values}"
            holds = bool(value)
        if holds:
            return None
        return f"{self.expr} ({self.where})" if self.where else str(self.expr)


def size_check(expr: Any, where: str = "", fixed: dict | None = None, replaced: dict | None = None) -> SizeCheck:
    """The :class:`SizeCheck` of guard ``expr``: symbols torch ``replaced`` by others
    ({symbol: symbol}) are renamed, then ``fixed`` ({symbol: value}) substituted, once."""
    bound = expr.xreplace(replaced) if replaced else expr
    bound = bound.xreplace(fixed) if fixed else bound
    args = tuple(sorted(getattr(bound, "free_symbols", ()), key=str))
    return SizeCheck(expr, where, bound, args, as_python(bound, args))
