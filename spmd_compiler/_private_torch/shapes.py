"""Symbolic sizes (``compile(dynamic=True)``): ShapeEnv, SymInt and sympy helpers, and
torch's real-value propagation used to record data-dependent branches.

Touches ``torch.fx.experimental.symbolic_shapes`` (ShapeEnv and its ``guards``,
``var_to_range``, ``backed_var_to_val``/``var_to_val``, ``replacements``,
``deferred_runtime_asserts``, ``real_tensor_prop_unbacked_vals``; ``guard_or_true``,
``guard_or_false``, ``_constrain_range_for_size``, ``canonicalize_bool_expr``,
``free_unbacked_symbols``, ``StatelessSymbolicContext``), ``torch.fx.experimental._config``
(``backed_size_oblivious``), SymNode internals (``node.hint``, ``node._expr``),
``torch._dynamo.source.ConstantSource``, ``torch.utils._sympy.printers.PythonPrinter`` and
FakeTensorMode's ``propagate_real_tensors`` / ``cache_enabled``, ``torch._decomp.decomposition_table``. Checked against torch 2.13.0 and 2.14.1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = [
    "FakeTensor", "FakeTensorMode", "symbolic_fake_mode", "to_symbolic_fake", "size_hint", "fake_mode_of", "sym_expr", "is_symbolic", "sym_free_symbols",
    "symbol_of", "unbacked_symbols", "shape_env_of", "shape_env_guards", "num_guards", "symbol_range", "example_values",
    "replaced_symbols", "is_pinned", "new_size_symint", "size_oblivious", "true_unless_proven_false",
    "false_unless_proven_true", "definitely_contiguous", "branch_atom", "sympy_as_python", "set_real_value", "propagating_real_values",
    "real_value_branches", "is_real_value_log", "fake_call",
]


# ops whose fake kernel reads symbolic sizes as ints (a guard per size) where torch's
# Python decomposition keeps them symbolic
_GUARDING_KERNELS = {torch.ops.aten.constant_pad_nd.default}


def fake_call(target: Any, args: tuple, kwargs: dict) -> Any:
    """``target(*args, **kwargs)`` on fake values; where the op's C++ kernel reads a
    symbolic size as an int (``constant_pad_nd`` calls ``sizes()``: a guard on a rank's
    unbacked local size), its Python decomposition from ``torch._decomp`` computes the
    same result with symbolic sizes."""
    from torch._decomp import decomposition_table
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if target in _GUARDING_KERNELS and any(isinstance(a, torch.Tensor) and any(is_symbolic(s) for s in a.shape) for a in args):
        return decomposition_table[target](*args, **kwargs)
    try:
        return target(*args, **kwargs)
    except GuardOnDataDependentSymNode:
        decomposed = decomposition_table.get(target)
        if decomposed is None:
            raise
        return decomposed(*args, **kwargs)


def symbolic_fake_mode(*, specialize_zero_one: bool = True) -> FakeTensorMode:
    """A fake mode whose sizes are symbols, one per input dim (no duck sizing).

    Without ``duck_shape=False`` two unrelated dims of equal size share a symbol and a
    size read from one tensor would be attributed to the other. ``specialize_zero_one``
    makes a size 0 or 1 a constant and assumes the others are at least 2; without it a
    size of 1 stays a symbol too (dynamic=True: one program for every batch size).
    """
    shape_env = ShapeEnv(duck_shape=False, specialize_zero_one=specialize_zero_one)
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
    _no_folding_through_symbols(mode)
    return mode


def _no_folding_through_symbols(mode: FakeTensorMode) -> None:
    """Make ``mode`` trace an op on a constant tensor that takes a symbolic number.

    FakeTensorMode folds ops whose tensor inputs are all constants (``torch.tensor(1.0)``
    made inside the step) by running them on the constants, with any SymFloat/SymInt
    argument converted to a number: an unbacked SymFloat (a ``.item()``) becomes NaN, a
    backed SymInt its example value (and a guard). NAdam's ``mu_product *= mu`` on the
    call that creates its state folded to ``tensor(nan)``, and ``mu_product.item()`` put
    that NaN into the graph as a constant. Here such a constant is dropped (with its
    aliases) before the op runs, so the op is traced and the number stays a symbol.
    Touches ``FakeTensorMode._dispatch_impl``, ``FakeTensor.constant`` and the
    converter's ``invalidate_constant_aliases``."""
    from torch.utils import _pytree as pytree

    dispatch = mode._dispatch_impl
    converter = mode.fake_tensor_converter

    def _dispatch_impl(func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        flat = pytree.arg_tree_leaves(*args, **(kwargs or {}))
        if any(is_symbolic(a) for a in flat):
            for a in flat:
                if isinstance(a, FakeTensor) and a.constant is not None:
                    converter.invalidate_constant_aliases(a.constant)
                    a.constant = None
        return dispatch(func, types, args, kwargs)

    mode._dispatch_impl = _dispatch_impl  # type: ignore[method-assign]



def to_symbolic_fake(mode: FakeTensorMode, t: torch.Tensor, name: str, dynamic: bool | Sequence[int] = True) -> FakeTensor:
    """Fakeify ``t`` with a symbolic size per dim (static sizes when ``dynamic`` is False;
    a sequence of dims makes just those symbolic)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    if isinstance(dynamic, bool):
        dims = set(range(t.dim())) if dynamic else set()
    else:
        dims = {d % max(1, t.dim()) for d in dynamic}
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())])
    return mode.from_tensor(t, source=ConstantSource(name), symbolic_context=ctx)



def size_hint(x: Any) -> Any:
    """The concrete value behind a SymInt/SymFloat/SymBool (identity for plain values)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = x.node
        hint = node.hint if node.hint is not None else node.shape_env.size_hint(node.expr)
        if isinstance(x, torch.SymInt):
            return int(hint)
        if isinstance(x, torch.SymFloat):
            return float(hint)
        return bool(hint)
    return x



def fake_mode_of(value: Any) -> FakeTensorMode | None:
    """The fake mode a traced fake tensor belongs to (None for anything else)."""
    return getattr(value, "fake_mode", None) if isinstance(value, FakeTensor) else None



def sym_expr(value: Any) -> Any:
    """The sympy expression of a SymInt/SymFloat/SymBool, simplified with everything its
    ShapeEnv learned (``s60`` -> ``s3`` after a guard made them equal)."""
    node = value.node
    return node.shape_env.simplify(node.expr)



def is_symbolic(value: Any) -> bool:
    """Whether ``value`` is a SymInt/SymFloat/SymBool that is not a plain constant."""
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and not value.node.is_constant() and bool(
        getattr(value.node.expr, "free_symbols", ())
    )



def sym_free_symbols(value: Any) -> set:
    """The sympy symbols a SymInt / SymFloat / SymBool is made of (empty otherwise)."""
    node = getattr(value, "node", None)
    expr = getattr(node, "expr", None)
    return set(getattr(expr, "free_symbols", ()))



def symbol_of(value: Any) -> Any:
    """The sympy expression a SymInt/SymFloat/SymBool was created as (before torch
    replaced any of its symbols by what it learned later)."""
    node = value.node
    return getattr(node, "_expr", node.expr)



def unbacked_symbols(value: Any) -> set:
    """The data-dependent ("unbacked") symbols in a traced value's sizes (a tensor's
    shape, or a SymInt/SymFloat/SymBool itself); empty for anything else."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return set(free_unbacked_symbols(value))
    except Exception:  # values free_unbacked_symbols does not walk (None, strings...)
        return set()



def shape_env_of(value: Any) -> ShapeEnv:
    """The ShapeEnv of a SymInt/SymFloat/SymBool (of a fake mode for a FakeTensorMode)."""
    if isinstance(value, FakeTensorMode):
        return value.shape_env
    return value.node.shape_env



def shape_env_guards(shape_env: ShapeEnv) -> list[tuple[Any, str]]:
    """Every guard the ShapeEnv recorded so far: (sympy condition, where it was made)."""
    out = []
    for g in shape_env.guards:
        stack = getattr(g, "sloc", None) or getattr(g, "stack", None)
        out.append((g.expr, str(stack) if stack is not None else ""))
    return out



def num_guards(shape_env: ShapeEnv) -> int:
    """How many guards the ShapeEnv recorded so far."""
    return len(shape_env.guards)



def symbol_range(shape_env: ShapeEnv, symbol: Any) -> tuple[int | None, int | None]:
    """The value range torch assumes for a size symbol (2.. without an upper bound for a
    batch dim traced with 0/1 specialization); None for an infinite end."""
    vr = shape_env.var_to_range.get(symbol)
    if vr is None:
        return None, None

    def end(x: Any) -> int | None:
        return int(x) if isinstance(x, (int, sympy.Integer)) else None  # torch's int_oo is neither

    return end(vr.lower), end(vr.upper)



def example_values(shape_env: ShapeEnv) -> dict[Any, int]:
    """``{symbol: example value}`` of the ShapeEnv's backed symbols."""
    values = getattr(shape_env, "backed_var_to_val", None)
    if values is None:
        values = shape_env.var_to_val
    return {k: v for k, v in values.items() if isinstance(v, (int, sympy.Integer))}



def replaced_symbols(shape_env: ShapeEnv) -> dict[Any, Any]:
    """``{symbol: expression}`` for symbols torch replaced after a guard (``s60 -> s3``)."""
    return {k: v for k, v in getattr(shape_env, "replacements", {}).items() if isinstance(k, sympy.Symbol)}



def is_pinned(shape_env: ShapeEnv, symbol: Any) -> bool:
    """Whether torch replaced ``symbol`` by a constant (a guard fixed its value)."""
    rep = getattr(shape_env, "replacements", {}).get(symbol)
    return rep is not None and not getattr(rep, "free_symbols", None)



def new_size_symint(shape_env: ShapeEnv) -> torch.SymInt:
    """A fresh size symbol without example value (torch's "unbacked", marked size-like):
    fake kernels reason about it size-obliviously (never 0 or 1 for contiguity and
    broadcasting decisions), so no guard pins a rank's local size to its example."""
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    u = shape_env.create_unbacked_symint()
    _constrain_range_for_size(u)
    return u



def size_oblivious(on: bool = True) -> Any:
    """Within: torch reasons about backed size symbols size-obliviously (a size is never
    asked whether it is 0 or 1 by contiguity and broadcasting checks, and is not made a
    constant when it is), as it does for unbacked ones; a branch the program itself takes
    on a size is still a guard. ``on=False``: a null context."""
    if not on:
        return contextlib.nullcontext()
    from torch.fx.experimental import _config

    return _config.patch(backed_size_oblivious=True)



def true_unless_proven_false(cond: Any) -> bool:
    """A condition on sizes: a plain bool as it is; a symbolic one is True unless torch can
    prove it False, and never becomes a guard (for checks where True is the safe answer)."""
    if isinstance(cond, torch.SymBool):
        from torch.fx.experimental.symbolic_shapes import guard_or_true

        return guard_or_true(cond)
    return bool(cond)



def false_unless_proven_true(cond: Any) -> bool:
    """A condition on sizes: a plain bool as it is; a symbolic one is False unless torch
    can prove it True, and never becomes a guard (for checks where False is the safe answer)."""
    if isinstance(cond, torch.SymBool):
        from torch.fx.experimental.symbolic_shapes import guard_or_false

        return guard_or_false(cond)
    return bool(cond)



def definitely_contiguous(t: torch.Tensor) -> bool:
    """Whether a (fake) tensor is contiguous for every value of its symbolic sizes; False
    when torch cannot prove it, never a guard (``x.contiguous()`` itself asks
    ``Eq(16*s3, 16)`` of a moved dim, which pins the size)."""
    from torch._prims_common import is_contiguous_or_false

    return bool(is_contiguous_or_false(t))



def branch_atom(expr: Any) -> Any:
    """One form for a branch condition and its negation (``x > 5`` and ``x <= 5`` give the
    same), in torch's canonical form for symbolic conditions."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import canonicalize_bool_expr

    forms = [canonicalize_bool_expr(e) for e in (expr, sympy.Not(expr))]
    return min(forms, key=str)



def sympy_as_python(expr: Any, symbols: Sequence[Any]) -> Any:
    """``expr`` (a symbolic condition) as a Python function of ``symbols``' values (a
    thousand times faster than sympy's substitution), or None if torch cannot print it."""
    import math

    from torch.utils._sympy.printers import PythonPrinter

    try:
        code = PythonPrinter().doprint(expr)
        return eval(f"lambda {', '.join(str(s) for s in symbols)}: {code}", {"math": math, "torch": torch})  # noqa: S307
    except Exception:  # an expression the printer does not know
        return None



_REAL_MARK = "propagate_real_tensors"  # how torch labels what it decided on real values



def set_real_value(fake: Any, real: torch.Tensor) -> None:
    """Give a fake tensor its real value, for :func:`propagating_real_values`."""
    fake.real_tensor = real



def propagating_real_values(mode: FakeTensorMode, on: bool) -> None:
    """Switch torch's real-tensor propagation in ``mode``: an op whose tensor inputs all
    have a real value computes it too, and ``.item()`` of it is a symbol with a known
    value (a branch on it is taken and recorded, see :func:`real_value_branches`)."""
    if not hasattr(mode, "_spmd_saved"):
        mode._spmd_saved = (mode.propagate_real_tensors, mode.cache_enabled)
    mode.propagate_real_tensors, mode.cache_enabled = (True, False) if on else mode._spmd_saved



def real_value_branches(mode: FakeTensorMode) -> list[tuple[Any, Any]]:
    """``(condition, stack)`` of every branch the trace took on real values: torch's
    deferred runtime asserts so labelled, and ``x == c`` decisions it kept only as a
    replacement of x by c (stack None)."""
    env = mode.shape_env
    known = env.real_tensor_prop_unbacked_vals
    if not known:
        return []
    out = [(ra.expr, ra.stack) for asserts in env.deferred_runtime_asserts.values() for ra in asserts if ra.msg.startswith(_REAL_MARK)]
    import sympy

    out += [(sympy.Eq(s, r), None) for s, r in env.replacements.items() if s in known and r.is_number]
    return out



def is_real_value_log(record: Any) -> bool:
    """torch's warning at each branch it takes on a real value (noise for our users)."""
    return str(record.msg).startswith(_REAL_MARK)
