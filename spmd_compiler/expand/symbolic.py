"""Symbolic batch sizes (``compile(..., dynamic=True)``): one per-rank program for every size.

Terms:
    size symbol: a sympy symbol the trace made for a sharded batch dim (``s3``), the
        *global* size of that dim; after expansion it is a run-time int input of the
        per-rank graph (placeholder ``size_s3``), fed by the driver every call.
    local size: this rank's piece of it, ``Max(0, Min(c, s3 - k*c))`` with
        ``c = (s3 + n - 1) // n`` for coordinate ``k`` of an axis of ``n`` ranks
        (torch.chunk's layout, uneven and empty shards included).
    size guard: a condition on the symbols that some decision during trace or
        expansion relied on (``Ne(Mod(s3, 4), 0)``: the batch splits unevenly); the
        program serves exactly the sizes that satisfy all of them, and a call with other
        sizes compiles again (:class:`SizeGuards`).

How it works: the expander runs on the trace's own fake mode, so every local tensor has
symbolic sizes and every int derived from a symbol (a view's sizes, a pad, a narrow,
a mean's divisor, a float such as ``2 / (16 * s3)``) is a SymInt/SymFloat whose sympy
expression says exactly how it depends on the global sizes; nothing is inferred from
example values. :func:`.emit_sizes.emit_sizes_pass` then replaces every symbolic argument of the
per-rank graph by a few integer nodes computed from the ``size_*`` placeholders (one
node per distinct sub-expression). Every decision torch or DTensor made on a symbol is a
guard in the ShapeEnv; :class:`SizeGuards` checks them for a new call.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from .. import _private_torch as pt
from ..errors import UnsupportedPlacementError

__all__ = ["resolve", "size_unit", "trace_fake_mode", "symint_of", "symbolic_local_shape", "partial_needs_replicate", "size_hint", "coordinate_symbol", "local_size_expr", "LocalSizes", "concrete_shape", "local_size_symbolic", "SizeGuards", "size_symbols_of", "SizeSymbol"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SizeSymbol:
    """A global batch size the program takes as a run-time input: ``symbol`` is the
    trace's sympy symbol, read from dim ``dim`` of batch input ``label`` each call."""

    symbol: Any
    label: str
    index: int  # position of the batch input among the traced inputs
    dim: int


def size_symbols_of(traced: Any, *, every: bool = False) -> list[SizeSymbol]:
    """The size symbols of a traced step's batch inputs (one per distinct symbol, in
    input order; ``every``: every batch dim that is one, so two dims torch found equal
    both appear); a dim whose size is an expression of other symbols is not a source."""
    if every:
        return [
            SizeSymbol(pt.sym_expr(s), inp.label, i, d)
            for i, (inp, node) in enumerate(zip(traced.inputs, traced.placeholders()))
            if inp.kind == "batch" and isinstance(node.meta.get("val"), torch.Tensor)
            for d, s in enumerate(node.meta["val"].shape)
            if pt.is_symbolic(s) and isinstance(pt.sym_expr(s), sympy.Symbol)
        ]
    out: dict[Any, SizeSymbol] = {}
    placeholders = traced.placeholders()
    for i, (inp, node) in enumerate(zip(traced.inputs, placeholders)):
        val = node.meta.get("val")
        if inp.kind != "batch" or not isinstance(val, torch.Tensor):
            continue
        for d, s in enumerate(val.shape):
            if pt.is_symbolic(s):
                expr = pt.sym_expr(s)
                if isinstance(expr, sympy.Symbol) and expr not in out:
                    out[expr] = SizeSymbol(expr, inp.label, i, d)
    return list(out.values())


def trace_fake_mode(traced: Any) -> Any:
    """The fake mode (and so the ShapeEnv) of a trace's placeholder values."""
    for node in traced.placeholders():
        mode = pt.fake_mode_of(node.meta.get("val"))
        if mode is not None:
            return mode
    raise AssertionError("dynamic expansion of a trace without fake placeholder values")


def symint_of(traced: Any, sym: SizeSymbol) -> Any:
    """The trace's SymInt of a size symbol (the example value of its placeholder)."""
    return traced.placeholders()[sym.index].meta["val"].shape[sym.dim]


def size_unit(size: Any) -> int:
    """The integer factor ``g`` of a symbolic size ``g * m`` (1 for a plain symbol, or a
    static size). A ``Shard`` of such a dim is split in units of ``g`` elements
    (torch.chunk of ``m``, each piece ``g`` times longer): exactly what flattening a
    sharded batch ``(B, T, ...)`` into ``(B*T, ...)`` leaves on each rank, for every B.
    For an even B it is also torch.chunk's layout of ``B*T``; for an uneven B it is not
    (5 rows of 4 over 3 ranks: 8, 8, 4 elements, where chunk(20) gives 7, 7, 6), so every
    local size and offset of such a dim goes through this convention (:meth:`LocalSizes.local`,
    ``builder.shard_offset``, the collectives of ``redistribute``)."""
    if not pt.is_symbolic(size):
        return 1
    coeff, _ = sympy.sympify(pt.sym_expr(size)).as_coeff_Mul()
    return int(coeff) if isinstance(coeff, sympy.Integer) and coeff > 1 else 1


def symbolic_local_shape(shape: tuple, placements: Any, mctx: Any, sizes: "LocalSizes") -> tuple:
    """The local shape of a batch input whose sharded dims may be symbolic (Shard only)."""
    out = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, pt.StridedShard):
            raise UnsupportedPlacementError(
                f"dynamic=True: batch placement {p} has no symbolic form yet (expected Shard or Replicate); "
                f"this step compiles per batch shape"
            )
        if isinstance(p, pt.Shard) and size_unit(out[p.dim]) > 1:
            # the driver splits inputs with torch.chunk, not in units (see size_unit)
            raise UnsupportedPlacementError(
                f"dynamic=True: batch dim {p.dim} of size {out[p.dim]} is a multiple of another batch size; expected "
                f"a size of its own. This step compiles per batch shape"
            )
        if isinstance(p, pt.Shard):
            out[p.dim] = sizes.local(out[p.dim], mctx.shape[axis], axis)
    return tuple(out)


def local_size_symbolic(size: Any, n: int, i: int) -> Any:
    """:func:`.chunks.local_size` on a SymInt: ``max(0, min(chunk, size - i*chunk))``
    with ``chunk = ceil(size / n)``, built with torch's sym_min/sym_max so no branch is
    taken (and no guard recorded)."""
    if not isinstance(size, torch.SymInt):
        from .chunks import local_size

        return local_size(size, n, i)
    if n == 1:
        return size
    chunk = (size + (n - 1)) // n
    return torch.sym_max(0, torch.sym_min(chunk, size - i * chunk))


def coordinate_symbol(axis_name: str) -> Any:
    """The sympy symbol of a rank's coordinate on a mesh axis (the ``coord_<axis>`` input)."""
    return sympy.Symbol(f"coord_{axis_name}", integer=True, nonnegative=True)


def local_size_expr(size: Any, n: int, coord: Any) -> Any:
    """torch.chunk's local size as a sympy expression of the global ``size`` and the
    coordinate ``coord`` (a symbol: the same expression on every rank)."""
    from torch.utils._sympy.functions import FloorDiv, Max, Min

    if n == 1:
        return size
    unit, rest = sympy.sympify(size).as_coeff_Mul()
    if isinstance(unit, sympy.Integer) and unit > 1 and rest.free_symbols:  # in units (see size_unit)
        return unit * local_size_expr(rest, n, coord)
    chunk = FloorDiv(size + (n - 1), n)
    return Max(0, Min(chunk, size - coord * chunk))


def partial_needs_replicate(size: Any, ways: int, ops: set) -> bool:
    """Whether a dim of ``size`` split ``ways`` ways must be replicated before a Partial
    reduction ``ops`` of it: an average of unequal chunks, a max/min with an empty chunk.
    A symbolic size (dynamic=True) takes the answer valid for every size, without a guard."""
    if pt.is_symbolic(size):
        return bool(ops & {"avg", "max", "min"})
    from .chunks import chunk_sizes

    return bool(("avg" in ops and size % ways) or (ops & {"max", "min"} and 0 in chunk_sizes(size, ways)))


class LocalSizes:
    """This rank's local sizes of symbolic dims, as fresh size symbols (``u0``) whose
    definitions (``u0 = Max(0, Min(c, s3 - coord_dp*c))``, ``c = (s3 + 3)//4``) are kept
    here, in terms of the coordinate symbols so that every rank emits the same program.

    A fresh symbol rather than the expression itself: fake kernels decide contiguity and
    broadcasting by asking whether a size is 1; on an expression with an example value
    that question becomes a guard pinning the rank's size class (0, 1 or more rows),
    while on a size symbol torch answers it size-obliviously, for every value."""

    def __init__(self, shape_env: Any, mctx: Any) -> None:
        self.shape_env = shape_env
        self.coordinates = {coordinate_symbol(a): c for a, c in zip(mctx.axis_names, mctx.coordinate)}
        self.symbols = [coordinate_symbol(a) for a in mctx.axis_names]
        # shared by every expansion of the same trace (every rank): the definitions are in
        # terms of the coordinate symbols, so all ranks' recipes use the same size symbols
        shared = _SHARED.setdefault(shape_env, ({}, {}))
        self.definitions: dict[Any, Any] = shared[0]
        self._memo: dict[Any, Any] = shared[1]

    def local(self, size: Any, n: int, axis: int) -> Any:
        """The local size on this rank of a dim of global ``size`` split ``n`` ways on ``axis``."""
        if not pt.is_symbolic(size):
            return local_size_symbolic(size, n, list(self.coordinates.values())[axis])
        unit = size_unit(size)
        if unit > 1:  # g * (this rank's chunk of m): the same size symbol as m's own shard
            return unit * self.local(size // unit, n, axis)
        return self.fresh(local_size_expr(pt.sym_expr(size), n, self.symbols[axis]))

    def fresh(self, expr: Any) -> Any:
        """A size symbol standing for ``expr`` (a sympy expression, or a SymInt's)."""
        if isinstance(expr, torch.SymInt):
            if not pt.is_symbolic(expr):
                return expr
            expr = pt.sym_expr(expr)
        if expr not in self._memo:
            u = pt.new_size_symint(self.shape_env)
            self.definitions[pt.sym_expr(u)] = expr
            self._memo[expr] = u
        return self._memo[expr]


def resolve(expr: Any, definitions: dict | None) -> Any:
    """``expr`` with every local size symbol replaced by its definition, also those
    defined through others (a dim split by two mesh axes: the inner split's size is a
    chunk of the outer one's local size)."""
    for _ in range(8):
        if not definitions or not (getattr(expr, "free_symbols", set()) & definitions.keys()):
            return expr
        expr = expr.xreplace(definitions)
    raise AssertionError(f"local size definitions nest deeper than 8 levels: {expr}")


def size_hint(x: Any) -> int:
    """The example value of a size, also for a size symbol of :class:`LocalSizes`
    (which has none of its own: computed from its definition)."""
    if not pt.is_symbolic(x):
        return int(x)
    env = pt.shape_env_of(x)
    definitions = _SHARED.get(env, ({}, {}))[0]
    expr = resolve(pt.sym_expr(x), definitions)
    return int(expr.xreplace({k: sympy.Integer(v) for k, v in pt.example_values(env).items()}).xreplace(_coordinate_hints(expr)))


def _coordinate_hints(expr: Any) -> dict:
    # a metadata estimate only: the coordinate of rank 0
    return {s: sympy.Integer(0) for s in getattr(expr, "free_symbols", ()) if str(s).startswith("coord_")}


_SHARED: "weakref.WeakKeyDictionary[Any, tuple[dict, dict]]" = weakref.WeakKeyDictionary()


class SizeGuards:
    """The conditions on the size symbols a compiled program relies on.

    ``guards`` are torch's (trace and expansion) plus each symbol's assumed range;
    :meth:`holds` evaluates them for the global sizes of a call, :meth:`failing` names
    the first one that fails."""

    def __init__(self, shape_env: Any, symbols: list[SizeSymbol], definitions: dict | None = None,
                 coordinates: dict | None = None, aliases: list[SizeSymbol] | None = None) -> None:
        self.symbols = list(symbols)
        self.aliases = list(aliases or symbols)  # every batch dim that reads a symbol
        self.coordinates = {k: sympy.Integer(v) for k, v in (coordinates or {}).items()}
        self.conditions: list[tuple[Any, str]] = []
        # other symbols (y's batch size) torch replaced by these ones
        self._replaced = pt.replaced_symbols(shape_env)
        sizes = {s.symbol for s in self.symbols} | set(self.coordinates) | set(self._replaced)
        for expr, where in pt.shape_env_guards(shape_env):
            expr = resolve(expr, definitions)
            # guards on other numbers (hyperparameters read with .item()) are the trace's
            # value guards, part of the call signature; the rest are size guards
            if expr.free_symbols and expr.free_symbols <= sizes:
                self.conditions.append((expr, where))
        for s in self.symbols:
            lo, hi = pt.symbol_range(shape_env, s.symbol)
            if lo is not None:
                self.conditions.append((sympy.Ge(s.symbol, lo), f"range assumed for {s.label} dim {s.dim}"))
            if hi is not None:
                self.conditions.append((sympy.Le(s.symbol, hi), f"range assumed for {s.label} dim {s.dim}"))
    def values_of(self, leaves: list[Any]) -> dict[Any, int]:
        """``{symbol: size}`` read from the global batch leaves (indexed by traced input)."""
        return {s.symbol: int(leaves[s.index].shape[s.dim]) for s in self.symbols}

    def disagreement(self, leaves: list[Any]) -> str | None:
        """Two batch dims the program takes as one size (``x`` and ``y`` rows) that differ
        in this call (text), or None."""
        seen: dict[Any, tuple[str, int, int]] = {}
        for a in self.aliases:
            size = int(leaves[a.index].shape[a.dim])
            first = seen.setdefault(a.symbol, (a.label, a.dim, size))
            if first[2] != size:
                return f"{a.label} dim {a.dim} has {size} rows but {first[0]} dim {first[1]} has {first[2]} (compiled as one size)"
        return None

    def checks(self) -> list[Any]:
        """The conditions as :class:`~.size_checks.SizeCheck` (this rank's coordinates and the
        replaced symbols substituted, compiled into Python functions once; not pickled)."""
        checks = self.__dict__.get("_checks")
        if checks is None:
            from .size_checks import size_check

            # a replaced symbol stands for the symbol torch found it equal to (``s60 -> s3``)
            replaced = {k: v for k, v in self._replaced.items() if isinstance(v, sympy.Symbol)}
            checks = self.__dict__["_checks"] = [
                size_check(expr, where, fixed=self.coordinates, replaced=replaced) for expr, where in self.conditions
            ]
        return checks

    def failing(self, values: dict[Any, int]) -> str | None:
        """The first condition the sizes break (text), or None if the program serves them.
        A condition that cannot be evaluated counts as broken (the call compiles again)."""
        for check in self.checks():
            broken = check.broken(values)
            if broken is not None:
                return broken
        return None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_checks"}  # functions do not pickle

    def __len__(self) -> int:
        return len(self.conditions)

    def text(self) -> list[str]:
        return [str(e) for e, _ in self.conditions]


def concrete_shape(shape: Any, values: dict[Any, int], definitions: dict | None = None) -> tuple[int, ...]:
    """A global shape whose sizes may be symbolic, for the global sizes ``values`` of a call."""
    subs = {k: sympy.Integer(v) for k, v in values.items()}
    out = []
    for s in shape:
        if pt.is_symbolic(s):
            out.append(int(resolve(pt.sym_expr(s), definitions).xreplace(subs)))
        else:
            out.append(int(s))
    return tuple(out)
