"""The values the expander carries for each traced node.

Terms:
    global: as the single-device program sees it (the whole tensor).
    local: what one rank holds (its shard, or its partial sum).
    axis: a mesh dimension; ``dim`` is always a tensor dimension.

A traced tensor becomes a :class:`DValue`: the node of the per-rank graph that holds the
local tensor, plus the DTensorSpec (placements and global shape) that says how the local
tensor relates to the global one. A traced size becomes a :class:`DSymInt`: its global
and local value and the mesh axes over which it is split.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from .. import _private_torch as pt

__all__ = ["DSymInt", "DValue", "RScalar", "MeshContext", "placements_text"]


def placements_text(placements: Any) -> str:
    """``(Shard(dim=0), Replicate())`` -> ``S(0)R`` (Partial -> ``P(sum)``)."""
    out = []
    for p in placements:
        if isinstance(p, pt.MaskPartial):
            out.append("MaskP")
        elif isinstance(p, pt.NormPartial):
            out.append(f"P(norm{p.norm_type:g})")
        elif isinstance(p, pt.StridedShard):
            period = pt.split_period(p)
            out.append(f"SS({p.dim},blocks of {period})" if period is not None else f"SS({p.dim},{p.split_factor})")
        elif isinstance(p, pt.Shard):
            out.append(f"S({p.dim})")
        elif isinstance(p, pt.Partial):
            out.append(f"P({p.reduce_op})")
        elif isinstance(p, pt.Replicate):
            out.append("R")
        else:
            out.append(str(p))
    return "".join(out)


@dataclass(frozen=True)
class MeshContext:
    """The mesh as expansion sees it: shape, names, group names and this rank's coordinate;
    ``cp``: the plan's context-parallel layout (``plan.context.CPLayout``) or None."""

    mesh: Any
    coordinate: tuple[int, ...]
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    group_names: tuple[str, ...]
    cp: Any = None

    def head_tail(self, axis: int) -> bool:
        """Whether values split over mesh ``axis`` use the load-balanced head-tail layout."""
        return self.cp is not None and self.cp.head_tail(axis)

    @classmethod
    def of(cls, mesh: Any, coordinate: tuple[int, ...] | None = None, cp: Any = None) -> "MeshContext":
        shape = tuple(mesh.shape)
        names = tuple(mesh.mesh_dim_names or [f"axis{i}" for i in range(len(shape))])
        if coordinate is None:
            coord = mesh.get_coordinate()
            coordinate = tuple(coord) if coord is not None else (0,) * len(shape)
        coordinate = tuple(int(c) for c in coordinate)
        if len(coordinate) != len(shape) or any(not 0 <= c < s for c, s in zip(coordinate, shape)):
            raise ValueError(f"coordinate {coordinate} is not inside mesh of shape {shape}")
        groups = tuple(pt.group_name(mesh, i) for i in range(len(shape)))
        return cls(mesh, coordinate, shape, names, groups, cp)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class DSymInt:
    """A size from the traced program, known both globally and on this rank.

    ``axes`` lists the mesh axes over which the size is split; when empty, the local
    value equals the global one. Arithmetic keeps the split only through multiplication
    by an unsplit value (``batch * seq``); anything else gives a plain global size.

    Comparisons are on global values, as the single-device program made them: ``<``,
    ``<=``, ``>``, ``>=`` with a number or another DSymInt, and ``==``/``!=`` with an int
    (``end >= size`` in a rule asks about the global tensor). Two DSymInts are equal only
    when global value, local value and axes all agree (the same size on this rank); the
    hash is the global value's, so a DSymInt equal to an int hashes like it.
    """

    global_value: int
    local_value: int
    axes: tuple[int, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if not self.axes and self.local_value != self.global_value:
            raise ValueError(
                f"DSymInt {self.source or ''}: local value {self.local_value} differs from global value "
                f"{self.global_value} but no mesh axis splits it"
            )

    @property
    def is_sharded(self) -> bool:
        return bool(self.axes)

    def key(self) -> tuple:
        return ("dsym", _key(self.global_value), _key(self.local_value), self.axes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DSymInt):
            return (self.global_value, self.local_value, self.axes) == (other.global_value, other.local_value, other.axes)
        if isinstance(other, int):
            return self.global_value == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(_key(self.global_value))

    def __lt__(self, other: Any) -> bool:
        return self.global_value < _comparable(other, "<")

    def __le__(self, other: Any) -> bool:
        return self.global_value <= _comparable(other, "<=")

    def __gt__(self, other: Any) -> bool:
        return self.global_value > _comparable(other, ">")

    def __ge__(self, other: Any) -> bool:
        return self.global_value >= _comparable(other, ">=")

    def __repr__(self) -> str:
        if not self.axes:
            return f"DSymInt({self.global_value})"
        return f"DSymInt(global={self.global_value}, local={self.local_value}, axes={self.axes})"


def _comparable(other: Any, op: str) -> int | float:
    """The global value to compare a DSymInt with; a TypeError naming both for the rest."""
    if isinstance(other, DSymInt):
        return other.global_value
    if isinstance(other, (int, float)):
        return other
    raise TypeError(f"'{op}' compares a DSymInt with a number or a DSymInt (on global values), got {type(other).__name__} {other!r}")


def _key(x: Any) -> Any:
    """A hashable stand-in for a size: the int, or a symbolic size's sympy expression
    (``compile(dynamic=True)``; a SymInt itself is unhashable)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        # the ShapeEnv too: another trace's symbols have the same names (s3, u0)
        return ("sym", pt.shape_env_of(x), str(pt.sym_expr(x)))
    return x


def _g(x: Any) -> Any:
    return x.global_value if isinstance(x, DSymInt) else x


def _l(x: Any) -> Any:
    return x.local_value if isinstance(x, DSymInt) else x


def sym_apply(fn: Callable[..., Any], *args: Any) -> Any:
    """Apply a Python-level size function (operator.mul, sym_max, ...) to DSymInts.

    Returns a DSymInt when any argument is one, else the plain result.
    """
    if not any(isinstance(a, DSymInt) for a in args):
        return fn(*args)
    g = fn(*[_g(a) for a in args])
    if not isinstance(g, (int, torch.SymInt)) or isinstance(g, bool):
        return g  # comparisons, floats: only the global meaning is kept
    sharded = [a for a in args if isinstance(a, DSymInt) and a.is_sharded]
    if fn in (operator.mul,) and len(sharded) == 1:
        return DSymInt(g, fn(*[_l(a) for a in args]), sharded[0].axes)
    if fn in (operator.floordiv,) and len(sharded) == 1 and sharded[0] is args[0]:
        divisor = _g(args[1])
        if sharded[0].local_value % divisor == 0 and sharded[0].global_value % divisor == 0:
            return DSymInt(g, sharded[0].local_value // divisor, sharded[0].axes)
    return DSymInt(g, g)


@dataclass
class DValue:
    """A distributed tensor value during expansion.

    Attributes:
        node: the per-rank graph node holding the local tensor.
        spec: DTensorSpec (placements + global tensor metadata).
        mask: for a ``MaskPartial`` placement (vocab-parallel embedding), the node of the
            boolean mask that must zero out-of-range rows before the reduction.
    """

    node: fx.Node
    spec: Any
    mask: fx.Node | None = None
    extra: dict = field(default_factory=dict)

    @property
    def local(self) -> torch.Tensor:
        return self.node.meta["val"]

    @property
    def placements(self) -> tuple:
        return self.spec.placements

    def __repr__(self) -> str:
        return f"DValue({self.node.name}: {placements_text(self.placements)} global={tuple(self.spec.shape)})"


@dataclass
class RScalar:
    """A Python number computed at run time on every rank (``tensor.item()`` and the
    arithmetic on it, e.g. Adam's bias correction from its ``step`` tensor).

    ``node`` produces the number in the per-rank graph; ``hint`` is a stand-in value for
    sharding propagation and fake execution (it never reaches the compiled program).
    """

    node: fx.Node
    hint: Any

    def key(self) -> tuple:
        return ("rscalar", type(self.hint).__name__)
