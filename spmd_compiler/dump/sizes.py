"""Symbolic batch sizes in dumps (``dynamic=True``, docs/dynamic_shapes.md).

A symbolic program takes each global batch size as an int input (``size_s3``) and
computes every size that depends on it with a few integer nodes (``meta["spmd_size_value"]``:
the sympy expression a node computes, in the global size symbols and the coordinate
symbols). This module renders those expressions readably, for one rank (its coordinate
substituted) and next to the concrete values of a call:

* :func:`readable`: ``Max(0, Min((s3 + 2)//3, s3 - coord_dp*((s3 + 2)//3)))`` on rank 0
  of 3 becomes ``ceil(s3/3)``; on rank 2 ``Max(0, s3 - 2*ceil(s3/3))``. Only identities
  exact for every integer size are used (``c = ceil(s/n)``: ``0 <= c <= s <= n*c``).
* :class:`SizeContext`: the symbols, the local sizes' definitions, the mesh and the
  values of the last call; :meth:`SizeContext.section` is the "sizes" block of a dump
  (one entry per size symbol: where it is read, each rank's local size, the values).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import sympy
import torch

from .. import _private_torch as pt
from ..expand.symbolic import coordinate_symbol, resolve

__all__ = ["readable", "SizeContext"]


def _is(e: Any, name: str) -> bool:
    return type(e).__name__ == name or (name in ("Min", "Max") and isinstance(e, getattr(sympy, name)))


def _ceil_forms(expr: Any) -> Any:
    """``FloorDiv(s + n - 1, n)`` -> ``ceiling(s/n)``, other ``FloorDiv(a, n)`` -> ``floor(a/n)``
    (exact for integers)."""

    def rule(e: Any) -> Any:
        a, n = e.args
        const, rest = sympy.sympify(a).as_coeff_Add()
        if n.is_Integer and n > 1 and const == n - 1:
            return sympy.ceiling(rest / n)
        return sympy.floor(a / n)

    return expr.replace(lambda e: _is(e, "FloorDiv"), rule)


def _chunk(e: Any) -> tuple[Any, int, Any, int] | None:
    """``e == s - k*ceiling(s/n)`` (k >= 0 an integer): ``(s, n, c, k)``, else None."""
    for c in e.atoms(sympy.ceiling):
        num, den = c.args[0].as_numer_denom()
        if not den.is_Integer:
            continue
        k = -sympy.expand(e - num) / c
        if k.is_Integer and k >= 0:
            return num, int(den), c, int(k)
    return None


def _simplify(expr: Any) -> Any:
    """torch.chunk's local sizes for a known coordinate: ``Min(c, s - k*c)`` is ``c`` for
    k = 0 and ``s - k*c`` for k = n - 1; ``Max(0, x)`` is ``x`` when ``x >= 0`` (k <= 1)."""

    def min_rule(e: Any) -> Any:
        if len(e.args) != 2:
            return e
        for a, b in (e.args, e.args[::-1]):
            if isinstance(a, sympy.ceiling) and a.args[0].as_numer_denom()[0] == b:
                return a  # Min(ceil(s/n), s)
            part = _chunk(b)
            if part is not None and part[2] == a:
                s, n, c, k = part
                if k == 0:
                    return c
                if k >= n - 1:
                    return b
        return e

    def nonnegative(x: Any) -> bool:
        if _is(x, "Min"):
            return all(nonnegative(a) for a in x.args)
        if isinstance(x, sympy.ceiling):
            return x.args[0].is_nonnegative or x.args[0].as_numer_denom()[0].is_Symbol  # a size over n
        part = _chunk(x)
        return part is not None and part[3] <= 1

    def max_rule(e: Any) -> Any:
        rest = [a for a in e.args if a != 0]
        if len(rest) == 1 and len(e.args) == 2 and nonnegative(rest[0]):
            return rest[0]
        return e

    expr = expr.replace(lambda e: _is(e, "Min"), min_rule)
    return expr.replace(lambda e: _is(e, "Max"), max_rule)


def readable(expr: Any, coordinates: dict[Any, int] | None = None) -> str:
    """``expr`` (sympy, in size and coordinate symbols) as short text, for the rank at
    ``coordinates`` (``{coord symbol: value}``; None: every rank, coordinates left symbolic)."""
    if coordinates:
        expr = expr.xreplace({k: sympy.Integer(v) for k, v in coordinates.items()})
    text = str(_simplify(_ceil_forms(sympy.sympify(expr))))
    return text.replace("ceiling(", "ceil(")


def evaluate(expr: Any, coordinates: dict[Any, int], values: dict[Any, int]) -> Any:
    """The value of ``expr`` for one rank and the global sizes ``values`` (int or float)."""
    subs = {k: sympy.Integer(v) for k, v in {**coordinates, **values}.items()}
    out = sympy.sympify(expr).xreplace(subs)
    out = out.doit() if hasattr(out, "doit") else out
    return int(out) if out.is_Integer else float(out)


class SizeContext:
    """What a dump needs to print a symbolic program's sizes for one rank.

    ``step``: an ExpandedStep with ``size_symbols``; ``values``: the global sizes of the
    last call, in the order of ``step.size_symbols`` (the ``size_*`` inputs), or None."""

    def __init__(self, step: Any, values: Sequence[int] | None = None) -> None:
        self.symbols = list(step.size_symbols)
        self.definitions = dict(step.size_definitions)
        self.aliases = list(getattr(step.size_guards, "aliases", None) or self.symbols)
        self.axis_names = list(step.mctx.axis_names)
        self.mesh_shape = list(step.mctx.shape)
        self.coord_symbols = [coordinate_symbol(a) for a in self.axis_names]
        self.coordinates = dict(zip(self.coord_symbols, step.mctx.coordinate))
        self.values = {s.symbol: int(v) for s, v in zip(self.symbols, values)} if values is not None else None

    def value(self, x: Any) -> int:
        """The value of a size (int, SymInt or sympy expression in the size, local size and
        coordinate symbols) for this rank and the last call. Raises ValueError without a
        last call, or for a symbol the sizes do not determine (a data-dependent size)."""
        if isinstance(x, int):
            return x
        if self.values is None:
            raise ValueError("no call's sizes are known: SizeContext(step, values) needs the values of a call")
        expr = pt.sym_expr(x) if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) else sympy.sympify(x)
        out = evaluate(resolve(expr, self.definitions), self.coordinates, self.values)
        if not isinstance(out, int):
            raise ValueError(f"size {expr} is not an integer for the sizes {self.values}: {out}")
        return out

    def call_text(self) -> str:
        """``s3 = 7 (local u0 = 4)``: the sizes of the last call for this rank ('' if unknown)."""
        if self.values is None:
            return ""
        out = ", ".join(f"{k} = {v}" for k, v in self.values.items())
        local = ", ".join(f"{u} = {self.value(d)}" for u, d in self.definitions.items())
        return out + (f" (this rank: {local})" if local else "")

    def rank_coordinates(self) -> list[dict[Any, int]]:
        return [dict(zip(self.coord_symbols, c)) for c in itertools.product(*[range(n) for n in self.mesh_shape])]

    def annotate(self, expr: Any) -> str:
        """``size: 8*s3 = 56`` for this rank (the value when the last call is known)."""
        text = f"size: {readable(expr, self.coordinates)}"
        if self.values is not None:
            value = evaluate(expr.xreplace(self.definitions), self.coordinates, self.values)
            text += f" = {value:.6g}" if isinstance(value, float) else f" = {value}"
        return text

    def concrete(self, shape: Sequence[Any]) -> str:
        """`` = [3, 8]``: a shape with symbolic sizes for this rank and the last call ('' if
        it has none, or the call is not known)."""
        if self.values is None or not any(pt.is_symbolic(d) for d in shape):
            return ""
        dims = [evaluate(pt.sym_expr(d).xreplace(self.definitions), self.coordinates, self.values) if pt.is_symbolic(d) else int(d)
                for d in shape]
        return " = [" + ", ".join(str(d) for d in dims) + "]"

    def placeholder(self, name: str) -> str:
        """The annotation of a ``size_*`` input (the global size it receives), or ''."""
        for s in self.symbols:
            if name == f"size_{s.symbol}":
                last = f" | last call {self.values[s.symbol]}" if self.values is not None else ""
                return f"global batch size {s.symbol} = {s.label} dim {s.dim}{last}"
        return ""

    def entries(self) -> list[dict[str, Any]]:
        """Per size symbol: where it is read, the last call's value, and per local size
        symbol its definition and each rank's form and value (JSON-able)."""
        out = []
        for s in self.symbols:
            also = [f"{a.label} dim {a.dim}" for a in self.aliases if a.symbol == s.symbol and (a.index, a.dim) != (s.index, s.dim)]
            locals_ = []
            for u, definition in self.definitions.items():
                if s.symbol not in definition.free_symbols:
                    continue
                ranks = []
                for coord in self.rank_coordinates():
                    ranks.append({
                        "rank": self._rank(coord), "coordinate": [coord[c] for c in self.coord_symbols],
                        "expr": readable(definition, coord), "this program": coord == self.coordinates,
                        "value": evaluate(definition, coord, self.values) if self.values is not None else None,
                    })
                locals_.append({"symbol": str(u), "definition": readable(definition), "ranks": ranks})
            out.append({"symbol": str(s.symbol), "input": s.label, "dim": s.dim, "also": also,
                        "last call": self.values[s.symbol] if self.values is not None else None, "local": locals_})
        return out

    def as_json(self) -> list[dict[str, Any]]:
        return self.entries()

    def section(self) -> list[str]:
        """The sizes block: per size symbol, where it is read, and each rank's local size."""
        out = ["sizes (dynamic=True): each global batch size is an int input; local sizes follow torch.chunk"]
        for e in self.entries():
            last = "-" if e["last call"] is None else e["last call"]
            also = f"; also {', '.join(e['also'])}" if e["also"] else ""
            out.append(f"  {e['symbol']}: {e['input']} dim {e['dim']} (input size_{e['symbol']}{also}) | last call: {last}")
            for loc in e["local"]:
                out.append(f"    local {loc['symbol']} = {loc['definition']}")
                for r in loc["ranks"]:
                    where = ", ".join(f"{a}={c}" for a, c in zip(self.axis_names, r["coordinate"]))
                    value = "" if r["value"] is None else f" = {r['value']}"
                    mine = "  <- this program" if r["this program"] else ""
                    out.append(f"      rank {r['rank']} ({where}): {r['expr']}{value}{mine}")
        return out

    def _rank(self, coord: dict[Any, int]) -> int:
        rank = 0
        for c, n in zip(self.coord_symbols, self.mesh_shape):
            rank = rank * n + coord[c]
        return rank
