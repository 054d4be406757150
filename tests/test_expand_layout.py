"""The replicate fallback never changes meaning, whatever the layout (spmd_compiler/expand/layout.py).

A value the fallback gathers is contiguous; the traced program may have seen it transposed,
sliced with a step or expanded, and the ops that follow (``view`` above all) were traced
for that layout. Property: a random tensor, a random layout, a pointwise op forced to the
fallback and a chain of shape ops, under a random shard placement, equal one device, and
so do the same programs with some of the shape ops themselves forced to the fallback.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd_compiler as sc
from spmd_compiler.expand import registry
from spmd_compiler.expand.args import NoStrategy
from spmd_compiler.testing import assert_spmd_matches
from spmd_compiler.testing import strategies as sst

aten = torch.ops.aten
SCALE = float(os.environ.get("SPMD_HYPOTHESIS_SCALE", "1.0"))
POINTWISE = aten.mul.Tensor  # always forced: its result takes its input's layout
SHAPE_OPS = [
    aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.clone.default, aten.slice.Tensor, aten.expand.default, aten.t.default,
]


def _no_strategy(ctx: Any, b: Any, op: Any, args: Any, kwargs: Any) -> Any:
    raise NoStrategy(f"{op} forced to the replicate fallback by the test")


@contextlib.contextmanager
def forced_fallback(ops: Sequence[Any]) -> Iterator[None]:
    """Expand ``ops`` with the replicate fallback (a rule that finds no strategy)."""
    saved = {op: registry._RULES.get(op) for op in ops}
    try:
        for op in ops:
            registry._RULES[op] = _no_strategy
        yield
    finally:
        for op, rule in saved.items():
            if rule is None:
                registry._RULES.pop(op, None)
            else:
                registry._RULES[op] = rule


def apply(x: torch.Tensor, ops: Sequence[tuple[str, tuple]]) -> torch.Tensor:
    for name, args in ops:
        if name == "slice":
            dim, step = args
            x = x[(slice(None),) * dim + (slice(None, None, step),)]
        elif name == "expand":
            x = x.unsqueeze(0).expand(args[0], *x.shape)
        elif name == "mul":
            x = x * 2.0
        elif name == "contiguous":
            x = x.contiguous()
        else:
            x = getattr(x, name)(*args)
    return x


@st.composite
def layout_ops(draw: Any, ndim: int) -> list[tuple[str, tuple]]:
    """One or two layout changes: transpose, permute, a slice with a step, expand."""
    out: list[tuple[str, tuple]] = []
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["transpose", "permute", "slice", "expand"]))
        if kind == "transpose":
            out.append(("transpose", tuple(draw(st.permutations(range(ndim)))[:2])))
        elif kind == "permute":
            out.append(("permute", tuple(draw(st.permutations(range(ndim))))))
        elif kind == "slice":
            out.append(("slice", (draw(st.integers(0, ndim - 1)), 2)))
        else:
            out.append(("expand", (2,)))
            ndim += 1
    return out


def memory_order(t: torch.Tensor) -> list[int]:
    """Dims from the largest stride to the smallest (outermost first)."""
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


def _factor(n: int) -> tuple[int, int] | None:
    for a in range(2, n):
        if n % a == 0:
            return a, n // a
    return None


@st.composite
def shape_ops(draw: Any, x: torch.Tensor, max_ops: int = 4) -> list[tuple[str, tuple]]:
    """A chain of shape ops, each valid on the (eager) value it gets, views included only
    where the layout allows them."""
    out: list[tuple[str, tuple]] = []
    for _ in range(draw(st.integers(1, max_ops))):
        nd = x.dim()
        kind = draw(st.sampled_from(
            ["view", "view", "reshape", "flatten", "unflatten", "transpose", "permute", "contiguous", "unsqueeze", "squeeze"]
        ))
        if kind in ("view", "reshape", "flatten"):
            s, e = sorted(draw(st.tuples(st.integers(0, nd - 1), st.integers(0, nd - 1))))
            shape = list(x.shape[:s]) + [int(torch.tensor(x.shape[s:e + 1]).prod())] + list(x.shape[e + 1:])
            op = ("flatten", (s, e)) if kind == "flatten" else (kind, (shape,))
        elif kind == "unflatten":
            d = draw(st.integers(0, nd - 1))
            f = _factor(x.shape[d])
            if f is None:
                continue
            op = ("unflatten", (d, f))
        elif kind == "transpose":
            op = ("transpose", tuple(draw(st.permutations(range(nd)))[:2])) if nd >= 2 else ("contiguous", ())
        elif kind == "permute":
            op = ("permute", tuple(draw(st.permutations(range(nd)))))
        elif kind == "unsqueeze":
            op = ("unsqueeze", (draw(st.integers(0, nd)),))
        elif kind == "squeeze":
            ones = [d for d in range(nd) if x.shape[d] == 1]
            if not ones:
                continue
            op = ("squeeze", (draw(st.sampled_from(ones)),))
        else:
            op = ("contiguous", ())
        try:
            x = apply(x, [op])
        except RuntimeError:  # a view the layout does not allow: not part of the program
            continue
        out.append(op)
    return out


@settings(max_examples=max(5, int(80 * SCALE)))
@given(st.data())
def test_fallback_keeps_meaning_under_random_layouts(data):
    mesh = data.draw(sst.meshes(max_ranks=4))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=2, max_size=3)))
    x = torch.arange(float(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape)
    placements = data.draw(sst.placements(shape, mesh.shape), label="placements")
    layout = data.draw(layout_ops(len(shape)), label="layout")
    y = apply(x, layout + [("mul", ())])
    # half the chains first undo the layout (dims in memory order): the views that follow
    # are then valid for the traced layout only, the case a contiguous gather breaks
    undo = [("permute", (memory_order(y),))] if data.draw(st.booleans(), label="undo the layout") else []
    chain = undo + data.draw(shape_ops(apply(y, undo)), label="shape ops")
    forced = [POINTWISE] + data.draw(st.lists(st.sampled_from(SHAPE_OPS), max_size=3, unique=True), label="also forced")
    ops = layout + [("mul", ())] + chain

    def fn(t: torch.Tensor) -> torch.Tensor:
        return apply(t, ops)

    with forced_fallback(forced):
        run = assert_spmd_matches(fn, [x], mesh, [list(placements)], atol=0, rtol=0, symbolic="none")
    fell_back = {n.target for s in run.steps.values() for n in s.gm.graph.nodes if "spmd_fallback" in n.meta}
    assert POINTWISE in fell_back


def test_forced_fallback_restores_rules():
    before = registry.get_rule(aten.view.default)
    with forced_fallback([aten.view.default, POINTWISE]):
        assert registry.get_rule(POINTWISE) is _no_strategy
    assert registry.get_rule(aten.view.default) is before and registry.get_rule(POINTWISE) is None


def test_attention_shaped_layout_survives_the_fallback(mesh4):
    """The issue's case written out: a (batch, heads, seq, dim) value laid out as
    (batch, seq, heads, dim), through a fallen-back op, transposed back and viewed."""
    x = torch.randn(4, 6, 2, 3, dtype=torch.float64)  # (batch, seq, heads, dim)

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = t.transpose(1, 2) * 2.0  # (batch, heads, seq, dim), laid out as the input
        return h.transpose(1, 2).view(4, 6, 6)

    with forced_fallback([POINTWISE]):
        run = assert_spmd_matches(fn, [x], mesh4, [[sc.Shard(0)]], atol=0, rtol=0)
    restrided = [n for s in run.steps.values() for n in s.gm.graph.nodes if "spmd_layout" in n.meta]
    assert restrided, "the gathered value was not given its traced layout back"
