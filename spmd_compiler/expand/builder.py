"""Building a dispatch subgraph (a :class:`Recipe`) for one traced node.

A recipe is a small fx graph over local tensors: its placeholders are the mesh
coordinate (one int per axis, a runtime value so that one graph serves every rank)
followed by the local inputs of the traced node; its output is the local result. The
builder computes each node's fake value as it goes, so shapes, dtypes and strides of
every local tensor are known without running anything.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from .chunks import chunk_size, local_size, strided_local_size
from .values import MeshContext

__all__ = ["Recipe", "OutTensor", "OutScalar", "SubgraphBuilder"]


@dataclass(frozen=True)
class OutTensor:
    """A tensor leaf of a recipe's result: output slot ``index`` of the recipe graph, its
    DTensorSpec and, for MaskPartial results, the output slot of its mask; ``rows``: what
    is known of it as a restricted value of token routing (:mod:`.orders`)."""

    index: int
    spec: Any
    mask_index: int | None = None
    rows: Any = None


@dataclass(frozen=True)
class OutScalar:
    """A run-time Python number in a recipe's result (output slot ``index``)."""

    index: int
    hint: Any


@dataclass
class Recipe:
    """The expansion of one traced node, ready to be spliced into the per-rank graph.

    Attributes:
        graph: placeholders ``coord_*`` (one per mesh axis), then one per input slot;
            a single output node returning a list of nodes.
        num_inputs: number of input slots after the coordinates.
        result: pytree of the node's value with :class:`OutTensor` for tensors and plain
            Python values (or DSymInts) elsewhere.
        notes: free-form facts for logs and dumps (strategy chosen, fallback used).
        coord_dependent: the recipe is only valid for ranks whose coordinate gives the
            same uneven chunk sizes (False for evenly sharded ops).
        replacements: tensor-argument index -> OutTensor of a reduced copy of that argument
            (a Partial input reduced for this op); later users of the argument take the
            reduced copy instead of reducing again.
    """

    graph: fx.Graph
    num_inputs: int
    result: Any
    notes: dict = field(default_factory=dict)
    coord_dependent: bool = False
    replacements: dict = field(default_factory=dict)

    def num_collectives(self) -> int:
        return sum(1 for n in self.graph.nodes if "spmd_comm" in n.meta)


class SubgraphBuilder:
    """Emit local ops and collectives into a fresh recipe graph, tracking fake values."""

    def __init__(self, mctx: MeshContext, fake_mode: Any) -> None:
        self.mctx = mctx
        self.fake_mode = fake_mode
        self.graph = fx.Graph()
        self.coords = []
        for name, c in zip(mctx.axis_names, mctx.coordinate):
            node = self.graph.placeholder(f"coord_{name}")
            node.meta["val"] = c
            self.coords.append(node)
        self.inputs: list[fx.Node] = []
        self._outputs: list[fx.Node] = []
        # set when a size used here depends on which rank we expand for (uneven shards)
        self.coord_dependent = False
        self.replacements: dict[int, OutTensor] = {}
        self.sizes: Any = None  # dynamic=True: the expansion's LocalSizes (symbolic sizes)
        # token axes on which a restricted value of token routing takes part (-> the sorts
        # it derives from): no redistribution on them in this recipe (expand/orders.py)
        self.routing: dict[int, frozenset] = {}
        self.routing_done = False  # a routing rule stated its results' facts (no generic transfer)

    # ------------------------------------------------------------------ sizes
    def local_chunk(self, size: int, axis: int) -> int:
        """This rank's chunk of a dim of ``size`` split over mesh ``axis``."""
        n = self.mctx.shape[axis]
        if self.sizes is not None and pt.is_symbolic(size):  # dynamic=True: one expression for every rank
            self.coord_dependent = True
            return self.sizes.local(size, n, axis)
        if size % n:
            self.coord_dependent = True
        return local_size(size, n, self.mctx.coordinate[axis])

    def shard_offset(self, size: int, axis: int, uneven: bool | None = None) -> Any:
        """Where this rank's chunk of a dim of ``size`` split over ``axis`` starts: a
        run-time int of the recipe, ``coord * chunk``, clamped to ``size`` when ``uneven``.

        ``uneven`` is decided from global sizes, so every rank emits the same ops. Left
        ``None`` it is computed here from ``size`` alone: a symbolic size (dynamic=True)
        counts as uneven (clamped with ``sym_min``, no guard), a static one when ``n``
        does not divide it. Callers whose split depends on more (earlier shards of the
        tensor, as in ``redistribute``) pass it explicitly."""
        n = self.mctx.shape[axis]
        if uneven is None:
            uneven = pt.is_symbolic(size) or size % n != 0
        if pt.is_symbolic(size):  # in units of size_unit(size) elements (see expand/symbolic.py)
            from .symbolic import size_unit

            unit = size_unit(size)
            chunk = unit * ((size // unit + (n - 1)) // n)
        else:
            chunk = chunk_size(size, n)
        start = self.call(operator.mul, self.coords[axis], chunk)
        if uneven:  # a symbolic size: torch's sym_min for the value, so no guard picks a side
            start = self.call(min, start, size, _val=torch.sym_min(start.meta["val"], size) if pt.is_symbolic(size) else None)
        return start

    def local_strided(self, size: int, split_factor: int, axis: int) -> int:
        """This rank's share of a dim of ``size`` under ``_StridedShard(split_factor)``:
        its chunk of each of the ``split_factor`` blocks."""
        n = self.mctx.shape[axis]
        if size % (split_factor * n):
            self.coord_dependent = True
        return strided_local_size(size, split_factor, n, self.mctx.coordinate[axis])

    def local_shape(self, global_shape: Any, placements: Any) -> tuple[int, ...]:
        """Local shape of a tensor with ``placements`` on this rank (shards left to right)."""
        from .. import _private_torch as pt

        strided = {p.dim for p in placements if isinstance(p, pt.StridedShard) and pt.split_period(p) is None}
        if strided and any(pt.is_symbolic(s) for s in global_shape) and self._static_strided(global_shape, placements, strided):
            # a strided split of static dims only (Megatron's fused qkv) beside a symbolic
            # batch: DTensor's layout of those dims alone, the batch's chunk as below
            alone = [p if getattr(p, "dim", None) in strided else pt.Replicate() for p in placements]
            static = [1 if pt.is_symbolic(s) else int(s) for s in global_shape]
            piece, _ = pt.local_shape_and_offset(static, self.mctx.shape, self.mctx.coordinate, alone)
            for axis, p in enumerate(alone):
                if getattr(p, "dim", None) in strided and static[p.dim] % self.mctx.shape[axis]:
                    self.coord_dependent = True
            rest = self.local_shape(global_shape, [pt.Replicate() if getattr(p, "dim", None) in strided else p for p in placements])
            return tuple(piece[d] if d in strided else s for d, s in enumerate(rest))
        if strided:
            if any(pt.is_symbolic(s) for s in global_shape):  # DTensor's layout would pin the sizes (int())
                from ..errors import UnsupportedPlacementError

                raise UnsupportedPlacementError(
                    f"dynamic=True: {placements} of a symbolic shape {list(global_shape)} has no symbolic local shape yet "
                    f"(expected Shard or Replicate); this step compiles per batch shape"
                )
            for axis, p in enumerate(placements):
                dim = getattr(p, "dim", None)
                if dim is not None and global_shape[dim] % self.mctx.shape[axis]:
                    self.coord_dependent = True
            shape, _ = pt.local_shape_and_offset(global_shape, self.mctx.shape, self.mctx.coordinate, placements)
            return shape
        shape = list(global_shape)
        for axis, p in enumerate(placements):
            dim = getattr(p, "dim", None)
            if pt.split_period(p) is not None:  # pt.symbolic_split: its piece of every block
                shape[dim] = shape[dim] // pt.split_period(p) * (pt.split_period(p) // self.mctx.shape[axis])
            elif dim is not None and p.is_shard():
                shape[dim] = self.local_chunk(shape[dim], axis)
        return tuple(shape)

    @staticmethod
    def _static_strided(global_shape: Any, placements: Any, strided: set[int]) -> bool:
        """The strided splits are of static dims that no other placement splits."""
        from .. import _private_torch as pt

        others = [p.dim for p in placements if isinstance(p, (pt.Shard, pt.StridedShard)) and p.dim in strided and not isinstance(p, pt.StridedShard)]
        return not others and not any(pt.is_symbolic(global_shape[d]) for d in strided)

    # ------------------------------------------------------------------ inputs
    def input(self, val: Any, name: str = "x") -> fx.Node:
        node = self.graph.placeholder(f"in{len(self.inputs)}_{name}")
        node.meta["val"] = val
        self.inputs.append(node)
        return node

    # ------------------------------------------------------------------ ops
    def call(self, target: Any, *args: Any, meta: dict | None = None, _val: Any = None, **kwargs: Any) -> fx.Node:
        """Emit ``target(*args, **kwargs)``; args may mix nodes and constants.

        ``_val`` gives the value to record instead of running the op on fake values
        (for ops whose result depends on data, like ``.item()``).
        """
        if _val is not None:
            val = _val
        else:
            vals_args, vals_kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (args, kwargs))
            with self.fake_mode:
                val = pt.fake_call(target, vals_args, vals_kwargs)
        node = self.graph.call_function(target, tuple(args), dict(kwargs))
        node.meta["val"] = val
        if meta:
            node.meta.update(meta)
        return node

    def getitems(self, node: fx.Node) -> list[fx.Node]:
        """Split a tuple-valued node into one ``getitem`` node per element."""
        out = []
        for i, v in enumerate(node.meta["val"]):
            item = self.graph.call_function(operator.getitem, (node, i))
            item.meta["val"] = v
            out.append(item)
        return out

    def val(self, node: Any) -> Any:
        return node.meta["val"] if isinstance(node, fx.Node) else node

    # ------------------------------------------------------------------ output
    def slot(self, node: fx.Node) -> int:
        """Register ``node`` as a recipe output and return its slot index."""
        for i, n in enumerate(self._outputs):
            if n is node:
                return i
        self._outputs.append(node)
        return len(self._outputs) - 1

    def finish(self, result: Any, notes: dict | None = None) -> Recipe:
        self.graph.output(list(self._outputs))
        return Recipe(self.graph, len(self.inputs), result, notes or {}, self.coord_dependent, dict(self.replacements))


def local_fake(
    fake_mode: Any, shape: tuple[int, ...], dtype: torch.dtype, stride: tuple[int, ...] | None = None, *, device: Any = None
) -> torch.Tensor:
    """A fake local tensor with the given shape (contiguous unless ``stride`` is given) on
    ``device`` (the device of the value it stands for; None: torch's default device)."""
    with fake_mode:
        if stride is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
