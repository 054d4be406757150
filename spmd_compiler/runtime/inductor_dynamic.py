"""``backend="inductor"`` with ``dynamic=True``: one inductor compile for every batch size.

A symbolic per-rank program (docs/dynamic_shapes.md) takes the global batch sizes as int
inputs (``size_s3``) and computes every size that depends on them with integer nodes
(``meta["spmd_size_expr"]``). Each of its segments (:mod:`.segments`; the size nodes are
recomputed in every segment that reads them, so only ``size_*`` ints cross) is compiled
by inductor with those ints as symbolic ints and every batch-shaped input's sizes and
strides as the expressions the graph's metadata gives them (a rank's local size
``Max(0, Min((s3 + 1)//2, s3 - coord*((s3 + 1)//2)))`` with this rank's coordinate put
in): :func:`~spmd_compiler._private_torch.inductor_compile_symbolic`.

**Guards.** Inductor may still decide something on the example sizes (it reasons
size-obliviously, so a size of 0 or 1 is not made a constant, but a branch on a hint is
a guard); nobody checks such guards for a graph compiled outside dynamo, so
:class:`SymbolicSegment` does: every compiled variant keeps its guards as a Python
predicate of the sizes, and a call whose sizes break every variant's guards compiles
another one (logged at INFO with the guard). ``float(size)`` becomes a 0-d float64
tensor before inductor sees it (:func:`~.inductor_rewrites.scalars_as_tensors`):
inductor passes a symbolic float to its C++ kernels as a 32-bit ``float`` (and
``float()`` of a symbolic int is a guard pinning it); ``max``/``min`` of sizes become
``torch.sym_max``/``sym_min``.

**Inputs.** Inductor's size asserts stay off; instead each call checks every batch-shaped
input against the templates (its shape, and its strides against the graph's strides or
the contiguous ones of its shape). An input laid out otherwise (a transposed view of a
batch) runs the segment compiled for exactly its shapes, as without ``dynamic=True``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..expand.symbolic import resolve

__all__ = ["SymbolicSizes", "SymbolicSegment", "sym_size_ops", "inline_coordinates"]

log = logging.getLogger(__name__)


def sym_size_ops(gm: fx.GraphModule) -> int:
    """``max``/``min`` of size nodes as ``torch.sym_max``/``torch.sym_min`` (the builtins
    compare symbolic ints: a guard on the example sizes). Returns how many."""
    done = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (max, min) and len(n.args) == 2 and not n.kwargs:
            n.target = torch.sym_max if n.target is max else torch.sym_min
            done += 1
    if done:
        gm.recompile()
    return done


def inline_coordinates(gm: fx.GraphModule, templates: list[Any]) -> int:
    """Put this rank's coordinate (an int template, :meth:`SymbolicSizes.templates`) in place
    of its placeholder's uses: given as an int input, AOTAutograd would make it a symbol of
    its own, and guards on it no size check could evaluate. Returns how many placeholders."""
    done = 0
    for n, t in zip([n for n in gm.graph.nodes if n.op == "placeholder"], templates):
        if isinstance(t, int) and not isinstance(t, bool) and n.users:
            for user in list(n.users):
                user.args = fx.map_arg(user.args, lambda a, n=n, t=t: t if a is n else a)
                user.kwargs = fx.map_arg(user.kwargs, lambda a, n=n, t=t: t if a is n else a)
            done += 1
    if done:
        gm.recompile()
    return done


class SymbolicSizes:
    """How the inputs of a symbolic program's graphs depend on its size symbols: ``symbols``
    (the trace's, one ``size_<symbol>`` input each), ``definitions`` (local size symbols,
    :class:`~spmd_compiler.expand.symbolic.LocalSizes`), ``coordinates`` (this rank's)."""

    def __init__(self, symbols: list[Any], definitions: dict, coordinates: dict) -> None:
        self.by_input = {f"size_{s}": s for s in symbols}
        self.by_coordinate = {str(k): int(v) for k, v in coordinates.items()}  # coord_<axis>: this rank's
        self.definitions = dict(definitions)
        self.coordinates = {k: sympy.Integer(v) for k, v in coordinates.items()}
        self.symbols = list(symbols)
        self._fns: dict[Any, Callable[..., Any]] = {}

    def expr(self, value: Any) -> Any:
        """A size of the graph's metadata as an expression of the size symbols (an int if static);
        None if it depends on anything else (a data-dependent size)."""
        if not pt.is_symbolic(value):
            return int(value)
        e = resolve(pt.sym_expr(value), self.definitions).xreplace(self.coordinates)
        if not e.free_symbols:
            return int(e)
        return _without_min_max(e) if e.free_symbols <= set(self.symbols) else None

    def templates(self, gm: fx.GraphModule) -> list[Any] | None:
        """Per placeholder of ``gm``: a size symbol (a ``size_*`` input), an int (this rank's
        coordinate, a ``coord_*`` input: inlined, :func:`inline_coordinates`), ``(shape, strides)``
        (strides: the candidates, see :meth:`strides`) for a tensor of symbolic shape, or
        None (static). None if ``gm`` has no symbolic input or one this cannot describe."""
        out: list[Any] = []
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            val = n.meta.get("val")
            if n.name in self.by_input:
                out.append(self.by_input[n.name])
            elif n.name in self.by_coordinate:
                out.append(self.by_coordinate[n.name])
            elif isinstance(val, torch.Tensor) and any(pt.is_symbolic(d) for d in (*val.shape, *val.stride())):
                shape, stride = [self.expr(d) for d in val.shape], [self.expr(d) for d in val.stride()]
                if any(e is None for e in (*shape, *stride)):
                    return None
                out.append((shape, self.strides(shape, stride)))
            elif isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)) and pt.is_symbolic(val):
                return None  # a size crossing segments (they are recomputed): not expected
            else:
                out.append(None)
        if not any(isinstance(t, tuple) or isinstance(t, sympy.Symbol) for t in out):
            return None
        read = {t for t in out if isinstance(t, sympy.Symbol)}
        used = {sym for t in out if isinstance(t, tuple) for e in (*t[0], *t[1][0]) for sym in getattr(e, "free_symbols", ())}
        if not used <= read:  # a batch-shaped input without its size input: inductor could not bind it
            log.debug("%s reads batch-shaped inputs of sizes %s without the size inputs: compiled per shape", gm, used - read)
            return None
        return out

    @staticmethod
    def strides(shape: list[Any], graph_strides: list[Any]) -> list[list[Any]]:
        """Stride templates an input may match: the graph's, and the contiguous ones of ``shape``."""
        contiguous, acc = [], sympy.Integer(1)
        for d in reversed(shape):
            contiguous.append(acc)
            acc = acc * d
        candidates = [list(graph_strides), [c if c.free_symbols else int(c) for c in reversed(contiguous)]]
        return candidates if candidates[0] != candidates[1] else candidates[:1]

    def evaluate(self, exprs: list[Any], values: list[int]) -> list[int]:
        """``exprs`` (ints and expressions of the symbols) at the symbols' ``values``."""
        out = []
        for e in exprs:
            if isinstance(e, int):
                out.append(e)
                continue
            fn = self._fns.get(e)
            if fn is None:
                fn = self._fns[e] = pt.sympy_as_python(e, self.symbols) or (lambda *v, e=e: int(e.xreplace(dict(zip(self.symbols, v)))))
            out.append(int(fn(*values)))
        return out


class SymbolicSegment:
    """A graph of a symbolic program compiled by inductor once for every size its guards
    allow: ``variants`` are ``(layout, guards, holds, fn)`` (``layout``: which stride
    template each batch-shaped input matched; ``holds(*sizes)``: the guards as a Python
    predicate). ``compile(inputs, templates, name)`` returns ``(fn, guards)`` or None (then
    the segment runs on ``eager`` for that layout); with ``templates=None`` it compiles for
    the inputs' shapes: what runs an input laid out unlike every template (``per_shape``)."""

    def __init__(self, gm: fx.GraphModule, templates: list[Any], sizes: SymbolicSizes, name: str,
                 compile: Callable[..., Any], eager: Callable[..., Any]) -> None:
        self.gm, self.templates, self.sizes, self.name = gm, templates, sizes, name
        self._compile, self._eager = compile, eager
        self.variants: list[tuple[tuple, list[Any], Callable[..., bool], Callable[..., Any]]] = []
        self.per_shape: dict[tuple, Callable[..., Any]] = {}
        self.last: Callable[..., Any] | None = None  # the function the last call ran

    def values(self, inputs: tuple) -> list[int]:
        """The size symbols' values in this call (in ``sizes.symbols`` order)."""
        got = {t: int(x) for t, x in zip(self.templates, inputs) if isinstance(t, sympy.Symbol)}
        return [got.get(s, 0) for s in self.sizes.symbols]

    def layout(self, inputs: tuple, values: list[int]) -> tuple | None:
        """Which stride candidate each batch-shaped input matches; None if one matches none."""
        out = []
        for t, x in zip(self.templates, inputs):
            if not isinstance(t, tuple):
                continue
            if not isinstance(x, torch.Tensor) or list(x.shape) != self.sizes.evaluate(t[0], values):
                return None
            stride = list(x.stride())
            match = next((i for i, cand in enumerate(t[1]) if stride == self.sizes.evaluate(cand, values)), None)
            if match is None:
                return None
            out.append(match)
        return tuple(out)

    def __call__(self, *inputs: Any) -> Any:
        values = self.values(inputs)
        layout = self.layout(inputs, values)
        if layout is None:
            key = tuple((tuple(x.shape), x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x for x in inputs)
            if key not in self.per_shape:
                log.info("%s: an input is laid out unlike the program's metadata; compiled for its shapes", self.name)
                got = self._compile(inputs, None, f"{self.name} (for its input shapes)")
                self.per_shape[key] = self._eager if got is None else got[0]
            self.last = self.per_shape[key]
            return self.last(*inputs)
        for lay, _, holds, fn in self.variants:
            if lay == layout and holds(*values):
                self.last = fn
                return fn(*inputs)
        fn = self._new_variant(inputs, layout, values)
        self.last = fn
        return fn(*inputs)

    def _new_variant(self, inputs: tuple, layout: tuple, values: list[int]) -> Callable[..., Any]:
        if self.variants:
            broken = [str(g) for lay, guards, _, _ in self.variants if lay == layout for g in guards]
            log.info("%s: sizes %s break the guards of its %d compiled variant(s) (%s); compiling another", self.name,
                     dict(zip(self.sizes.symbols, values)), len(self.variants), "; ".join(broken) or "another layout")
        it = iter(layout)
        templates = [(t[0], t[1][next(it)]) if isinstance(t, tuple) else t for t in self.templates]
        got = self._compile(inputs, templates, self.name)
        if got is None:  # inductor could not (one WARNING already): eager, for every size of this layout
            fn, guards = self._eager, []
        else:
            fn, guards = got
        holds = _predicate(guards, self.sizes.symbols, values)
        self.variants.append((layout, guards, holds, fn))
        return fn


_SAMPLE = range(0, 4097)


def _without_min_max(expr: Any) -> Any:
    """``expr`` with each ``Min``/``Max`` of one size symbol replaced by the argument that
    equals it at every size 0..4096 (this rank's torch.chunk rows with its coordinate put in:
    rank 0 of 2 holds ``Min(s, (s + 1)//2) = (s + 1)//2`` rows, rank 1 ``s - (s + 1)//2``).
    Left as they are, inductor resolves them on the example size (the guard ``(s + 1)//2 <
    s``: another compile for even and odd sizes). Only a template: every call checks the
    inputs' shapes against it (:meth:`SymbolicSegment.layout`)."""
    if len(expr.free_symbols) != 1:
        return expr
    (sym,) = expr.free_symbols
    for _ in range(8):
        nodes = [a for a in sympy.preorder_traversal(expr) if type(a).__name__ in ("Min", "Max")]
        for node in nodes:
            f = pt.sympy_as_python(node, [sym])
            for arg in node.args:
                g = pt.sympy_as_python(arg, [sym]) if arg.free_symbols else (lambda v, arg=arg: int(arg))
                if f is not None and g is not None and all(f(v) == g(v) for v in _SAMPLE):
                    expr = expr.xreplace({node: arg})
                    break
            else:
                continue
            break  # replaced one: walk the new expression
        else:
            return expr
    return expr


def _predicate(guards: list[Any], symbols: list[Any], values: list[int]) -> Callable[..., bool]:
    """The guards as a Python function of the symbols' values; if one cannot be printed,
    the exact sizes it was compiled for."""
    if not guards:
        return lambda *v: True
    cond = sympy.And(*guards)
    fn = pt.sympy_as_python(cond, symbols) if cond.free_symbols <= set(symbols) else None
    if fn is None:  # a guard on another symbol (or unprintable): these sizes only
        log.info("guards %s are not a function of the sizes %s: this variant serves sizes %s only", guards, symbols, values)
        fixed = list(values)
        return lambda *v: list(v) == fixed
    return lambda *v: bool(fn(*v))
