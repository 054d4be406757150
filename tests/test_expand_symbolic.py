"""compile(dynamic=True) building blocks: symbolic local sizes, their emission as integer
nodes, options (docs/dynamic_shapes.md). Whole programs: tests/test_driver_dynamic.py."""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode

from spmd_compiler import _private_torch as pt
from spmd_compiler.driver import Options
from spmd_compiler.expand.chunks import local_size
from spmd_compiler.expand.emit_sizes import emit_sizes_pass
from spmd_compiler.expand.symbolic import coordinate_symbol, local_size_expr, local_size_symbolic


def _batch_symint(hint: int = 10):
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(hint, 16), source=ConstantSource("x"), symbolic_context=ctx)
    return x.shape[0], env


@pytest.mark.parametrize("n", [2, 3, 4])
def test_local_size_symbolic_is_torch_chunk_for_every_size(n):
    size, env = _batch_symint()
    sym = pt.sym_expr(size)
    for i in range(n):
        expr = pt.sym_expr(local_size_symbolic(size, n, i))
        for b in range(1, 34):
            assert int(expr.xreplace({sym: sympy.Integer(b)})) == local_size(b, n, i), (b, n, i, expr)
    assert not env.guards  # no branch was taken on the size: one expression serves all


@pytest.mark.filterwarnings("ignore:Raw Sym")  # the symbolic constants this pass removes
def test_emit_sizes_pass_computes_every_size_from_the_placeholder():
    size, env = _batch_symint()
    sym = pt.sym_expr(size)
    n, coord = 4, 3
    local = local_size_symbolic(size, n, coord)
    chunk = torch.sym_max(1, (size + 3) // 4)
    scale = 2.0 / torch.sym_float(size * 16)
    g = fx.Graph()
    b = g.placeholder("size_b")
    x = g.placeholder("x")
    view = g.call_function(torch.ops.aten.view.default, (x, [local * 16]))
    pad = g.call_function(torch.ops.aten.new_zeros.default, (x, [chunk - local, 16]))
    mul = g.call_function(torch.ops.aten.mul.Tensor, (x, scale))
    g.output([view, pad, mul])
    gm = emit_sizes_pass(fx.GraphModule(torch.nn.Module(), g), sources={sym: b})
    assert not any(isinstance(a, (torch.SymInt, torch.SymFloat)) for nd in gm.graph.nodes for a in torch.utils._pytree.tree_leaves(nd.args))
    for batch in (1, 2, 7, 8, 9, 33):
        rows = local_size(batch, n, coord)
        v, p, m = gm(batch, torch.ones(rows, 16))
        assert v.shape == (rows * 16,)
        assert p.shape == (max(1, -(-batch // 4)) - rows, 16)
        assert torch.equal(m, torch.full((rows, 16), 2.0 / (batch * 16)))


def test_options_dynamic_is_validated():
    assert Options().dynamic is None  # automatic: static first, symbolic after a batch-size change
    with pytest.raises(ValueError, match="dynamic='yes'"):
        Options(dynamic="yes")
    with pytest.raises(ValueError, match="needs symbolic batch sizes.*got 'none'"):
        Options(dynamic=True, symbolic="none")


def test_local_size_expression_with_a_coordinate_symbol_is_torch_chunk():
    """One expression serves every rank: the coordinate is a symbol (the coord_* input)."""
    b, k = sympy.Symbol("b", integer=True, positive=True), coordinate_symbol("dp")
    for n in (2, 3, 4):
        expr = local_size_expr(b, n, k)
        for size in range(0, 34):
            got = [int(expr.xreplace({b: size, k: i})) for i in range(n)]
            assert got == [local_size(size, n, i) for i in range(n)], (n, size, got)


# ----------------------------------------------------------------------------- size guards as Python functions

def _guards_on_local_sizes(n: int, coord) -> list:
    """Conditions of the kinds torch and the expansion record, on a global size ``s`` and
    the local size of a rank (torch.chunk's layout, FloorDiv/Min/Max), with Mod, floor,
    ceiling, rational coefficients and logic."""
    from torch.utils._sympy.functions import CeilToInt, FloorDiv, FloorToInt, IntTrueDiv, Max, Min, PythonMod

    s = sympy.Symbol("s3", integer=True, positive=True)
    local = local_size_expr(s, n, coord)
    return s, [
        sympy.Ge(local, 1), sympy.Eq(sympy.Mod(local, 2), 0), sympy.Ne(sympy.Mod(s, n), 0),
        sympy.Eq(PythonMod(s + 1, 3), 1), sympy.Lt(FloorDiv(s, n) * n, s), sympy.Gt(Max(local, 3), Min(s, 5)),
        sympy.Eq(sympy.floor(s / n), local), sympy.Le(sympy.ceiling(s / n), local + 1),
        sympy.Eq(sympy.floor(s / 49) * 49, s - sympy.Mod(s, 49)),  # (1/49)*49 < 1 in floats
        sympy.Eq(sympy.ceiling(sympy.Rational(7, 3) * s), 7 * FloorDiv(s, 3) + FloorDiv(7 * sympy.Mod(s, 3) + 2, 3)),
        sympy.Eq(CeilToInt(IntTrueDiv(s, n)), FloorDiv(s + n - 1, n)), sympy.Ge(FloorToInt(IntTrueDiv(s, 7)), 2),
        sympy.Lt(s / 7 + local / 3, 4), sympy.And(sympy.Gt(s, 4), sympy.Ne(local, 2)),
        sympy.Or(sympy.Lt(local * local, 9), sympy.Not(sympy.Eq(s, 6))),
    ]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_size_guards_compiled_to_python_agree_with_sympy_for_sizes_0_to_40(n):
    from spmd_compiler.expand.size_checks import size_check

    coord = coordinate_symbol("dp")
    for k in range(n):
        s, conditions = _guards_on_local_sizes(n, coord)
        for expr in conditions:
            check = size_check(expr, "test", fixed={coord: sympy.Integer(k)})
            assert check.fn is not None, expr  # every one of these has an exact integer form
            for v in range(41):
                by_sympy = bool(expr.xreplace({coord: sympy.Integer(k), s: sympy.Integer(v)}))
                assert bool(check.fn(v)) == by_sympy, (expr, n, k, v)
                assert (check.broken({s: v}) is None) == by_sympy, (expr, n, k, v)


def test_a_size_guard_with_no_integer_form_is_evaluated_with_sympy():
    from spmd_compiler.expand.size_checks import size_check

    s = sympy.Symbol("s3", integer=True, positive=True)
    check = size_check(sympy.Lt(sympy.Float(0.3) * s, 2), "a float coefficient")
    assert check.fn is None
    assert check.broken({s: 6}) is None and "a float coefficient" in check.broken({s: 7})
    other = sympy.Symbol("s9", integer=True)  # a symbol the call does not give
    assert "cannot be evaluated" in size_check(sympy.Gt(s - other, 2)).broken({s: 3})
