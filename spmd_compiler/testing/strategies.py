"""Hypothesis strategies for sharding tests: meshes, placements, small random programs.

Use them to property-test your own plans::

    from hypothesis import given, strategies as st
    from spmd_compiler.testing import strategies as sst
    from spmd_compiler.testing import assert_spmd_matches

    @given(st.data())
    def test_my_op(data):
        mesh = data.draw(sst.meshes())
        x = torch.randn(6, 10)
        pl = data.draw(sst.placements(x.shape, mesh.shape))
        assert_spmd_matches(my_fn, [x], mesh, [pl])

Needs the ``hypothesis`` package (the ``test`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from .mesh import fake_mesh

__all__ = ["mesh_shapes", "meshes", "placements", "shapes", "Program", "programs", "DPProgram", "dp_programs"]


@st.composite
def mesh_shapes(draw: Any, max_ranks: int = 8, ndims: Sequence[int] = (1, 2)) -> tuple[int, ...]:
    """Mesh shapes of 1 or 2 axes, each of size >= 2, at most ``max_ranks`` ranks."""
    ndim = draw(st.sampled_from(list(ndims)))
    if ndim == 1:
        return (draw(st.integers(2, max_ranks)),)
    a = draw(st.integers(2, max(2, max_ranks // 2)))
    b = draw(st.integers(2, max(2, max_ranks // a)))
    return (a, b)


@st.composite
def meshes(draw: Any, max_ranks: int = 8, ndims: Sequence[int] = (1, 2)) -> Any:
    """DeviceMeshes over a fake process group (see :func:`~spmd_compiler.testing.fake_mesh`)."""
    shape = draw(mesh_shapes(max_ranks, ndims))
    names = ("x",) if len(shape) == 1 else ("x", "y")
    return fake_mesh(shape, names)


@st.composite
def placements(draw: Any, shape: Sequence[int], mesh_shape: Sequence[int], *, uneven: bool = True, nested: bool = True) -> tuple:
    """Placements valid for a tensor of ``shape`` on a mesh of ``mesh_shape``: one per
    axis, ``Replicate()`` or ``Shard(d)``. With ``uneven``, dims that do not divide (and
    dims smaller than the axis, giving empty shards) are allowed; with ``nested``, two
    axes may shard the same dim."""
    out = []
    used: set[int] = set()
    for size in mesh_shape:
        options: list[Any] = [Replicate()]
        for d, n in enumerate(shape):
            if d in used and not nested:
                continue
            if n == 0:
                continue
            if uneven or n % size == 0:
                options.append(Shard(d))
        p = draw(st.sampled_from(options))
        if isinstance(p, Shard):
            used.add(p.dim)
        out.append(p)
    return tuple(out)


def shapes(min_dims: int = 1, max_dims: int = 3, min_side: int = 1, max_side: int = 8) -> Any:
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


@dataclass
class Program:
    """A small random program: ``fn(*inputs)`` applies ``ops`` to the first input."""

    input_shapes: list[tuple[int, ...]]
    ops: list[tuple[str, tuple]] = field(default_factory=list)

    def fn(self, *xs: torch.Tensor) -> torch.Tensor:
        v = xs[0]
        extra = iter(xs[1:])
        for name, params in self.ops:
            v = _APPLY[name](v, extra, *params)
        return v

    def inputs(self, seed: int = 0, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(s, generator=g, dtype=dtype) for s in self.input_shapes]

    def __repr__(self) -> str:
        body = " -> ".join(f"{n}{p if p else ''}" for n, p in self.ops)
        return f"Program(inputs={self.input_shapes}: {body})"


def _take(extra: Any) -> torch.Tensor:
    return next(extra)


_APPLY: dict[str, Callable[..., torch.Tensor]] = {
    "relu": lambda v, e: torch.relu(v),
    "tanh": lambda v, e: torch.tanh(v),
    "sigmoid": lambda v, e: torch.sigmoid(v),
    "neg": lambda v, e: -v,
    "affine": lambda v, e: v * 2.0 + 1.0,
    "exp_tanh": lambda v, e: torch.exp(torch.tanh(v)),
    "add": lambda v, e: v + _take(e),
    "mul": lambda v, e: v * _take(e),
    "sub": lambda v, e: v - _take(e),
    "maximum": lambda v, e: torch.maximum(v, _take(e)),
    "sum": lambda v, e, d, k: v.sum(d, keepdim=k),
    "mean": lambda v, e, d, k: v.mean(d, keepdim=k),
    "amax": lambda v, e, d, k: v.amax(d, keepdim=k),
    "matmul": lambda v, e: v @ _take(e),
    "transpose": lambda v, e, a, b: v.transpose(a, b),
    "flatten": lambda v, e: v.flatten(-2, -1),
    "unflatten": lambda v, e, k: v.unflatten(-1, (k, -1)),
    "softmax": lambda v, e, d: torch.softmax(v, d),
    "log_softmax": lambda v, e, d: torch.log_softmax(v, d),
    "cumsum": lambda v, e, d: torch.cumsum(v, d),
    "cat": lambda v, e, d: torch.cat([v, v * 0.5], d),
    "stack": lambda v, e, d: torch.stack([v, v + 1.0], d),
    "narrow": lambda v, e, d, s, n: v.narrow(d, s, n),
    "index_select": lambda v, e, d, idx: v.index_select(d, torch.tensor(idx)),
    "square_mean": lambda v, e: (v * v).mean(),
}


@st.composite
def programs(draw: Any, max_ops: int = 4, max_side: int = 8) -> Program:
    """Chains of elementwise, reduction, matmul, view/reshape/transpose, softmax,
    cat/stack and indexing ops over one or more inputs (shapes drawn, sides 1..8)."""
    first = draw(shapes(2, 3, 1, max_side))
    prog = Program([first])
    shape = list(first)
    for _ in range(draw(st.integers(1, max_ops))):
        nd = len(shape)
        choices = ["relu", "tanh", "sigmoid", "neg", "affine", "exp_tanh", "add", "mul", "sub", "maximum", "matmul", "cat", "stack"]
        if nd >= 1:
            choices += ["sum", "mean", "amax", "softmax", "log_softmax", "cumsum", "narrow", "index_select"]
        if nd >= 2:
            choices += ["transpose", "flatten"]
        if nd <= 3 and shape and shape[-1] % 2 == 0 and shape[-1] >= 2:
            choices += ["unflatten"]
        name = draw(st.sampled_from(choices))
        if name in ("add", "mul", "sub", "maximum"):
            prog.input_shapes.append(tuple(shape))
            prog.ops.append((name, ()))
        elif name == "matmul":
            k = draw(st.integers(1, max_side))
            prog.input_shapes.append((shape[-1], k) if nd >= 1 else (1, k))
            prog.ops.append((name, ()))
            shape = shape[:-1] + [k]
        elif name in ("sum", "mean", "amax"):
            d = draw(st.integers(0, nd - 1))
            keep = draw(st.booleans())
            prog.ops.append((name, (d, keep)))
            shape = shape[:d] + ([1] if keep else []) + shape[d + 1 :]
            if not shape:
                break
        elif name in ("softmax", "log_softmax", "cumsum"):
            prog.ops.append((name, (draw(st.integers(0, nd - 1)),)))
        elif name in ("cat", "stack"):
            d = draw(st.integers(0, nd - 1 if name == "cat" else nd))
            prog.ops.append((name, (d,)))
            if name == "cat":
                shape[d] *= 2
            else:
                shape.insert(d, 2)
        elif name == "transpose":
            a, b = draw(st.lists(st.integers(0, nd - 1), min_size=2, max_size=2, unique=True))
            prog.ops.append((name, (a, b)))
            shape[a], shape[b] = shape[b], shape[a]
        elif name == "flatten":
            prog.ops.append((name, ()))
            shape = shape[:-2] + [shape[-2] * shape[-1]]
        elif name == "unflatten":
            prog.ops.append((name, (2,)))
            shape = shape[:-1] + [2, shape[-1] // 2]
        elif name == "narrow":
            d = draw(st.integers(0, nd - 1))
            if shape[d] < 1:
                continue
            s = draw(st.integers(0, shape[d] - 1))
            n = draw(st.integers(1, shape[d] - s))
            prog.ops.append((name, (d, s, n)))
            shape[d] = n
        elif name == "index_select":
            d = draw(st.integers(0, nd - 1))
            if shape[d] < 1:
                continue
            idx = draw(st.lists(st.integers(0, shape[d] - 1), min_size=1, max_size=4))
            prog.ops.append((name, (d, tuple(idx))))
            shape[d] = len(idx)
        else:
            prog.ops.append((name, ()))
    return prog


# ----------------------------------------------------------- data-parallel train steps

_DP_LAYERS: dict[str, Callable[..., Any]] = {
    "relu": lambda v: torch.relu(v),
    "tanh": lambda v: torch.tanh(v),
    # a view over the batch dim: [b, f] -> [b, 2, f/2] -> [b, f]
    "view": lambda v: (v.view(v.shape[0], 2, -1) * 1.5).reshape(v.shape[0], -1),
    "scale_by_batch": lambda v: v * (4.0 / v.shape[0]),  # arithmetic on the batch size itself
    "center": lambda v: v - v.mean(0, keepdim=True),  # a mean over the sharded batch dim
}
_DP_LOSSES: dict[str, Callable[..., Any]] = {
    "mse": lambda out, y: torch.nn.functional.mse_loss(out, y),
    "sum": lambda out, y: (out * y).sum() * 0.1,
    "row_mean": lambda out, y: ((out - y) ** 2).sum(1).mean(),
}


@dataclass
class DPProgram:
    """A random train step for data parallel plans: linear layers (sizes ``widths``)
    interleaved with ``layers`` (elementwise, views and arithmetic over the batch dim),
    then ``loss``; ``step(model, optimizer, x, y)`` trains :meth:`model` on a batch."""

    widths: list[int]
    layers: list[str]
    loss: str

    def model(self) -> torch.nn.Module:
        mods = [torch.nn.Linear(a, b) for a, b in zip(self.widths, self.widths[1:])]
        return torch.nn.ModuleList(mods).double()

    def step(self, model: Any, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        v = x
        for lin, layer in zip(model, self.layers):
            v = _DP_LAYERS[layer](lin(v))
        loss = _DP_LOSSES[self.loss](v, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def batch(self, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(rows, self.widths[0], generator=generator, dtype=torch.float64),
                torch.randn(rows, self.widths[-1], generator=generator, dtype=torch.float64))

    def __repr__(self) -> str:
        return f"DPProgram(widths={self.widths}, layers={self.layers}, loss={self.loss})"


@st.composite
def dp_programs(draw: Any, max_layers: int = 3) -> DPProgram:
    """Train steps a data-parallel plan (batch ``Shard(0)``) distributes: 1..``max_layers``
    linear layers of even widths 2..8, each followed by one of relu, tanh, a view over
    the batch dim, a scaling by the batch size, or centering over the batch; then an
    MSE, sum or per-row loss."""
    n = draw(st.integers(1, max_layers))
    widths = draw(st.lists(st.sampled_from([2, 4, 6, 8]), min_size=n + 1, max_size=n + 1))
    layers = draw(st.lists(st.sampled_from(sorted(_DP_LAYERS)), min_size=n, max_size=n))
    return DPProgram(widths, layers, draw(st.sampled_from(sorted(_DP_LOSSES))))
