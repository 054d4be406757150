"""The arguments and results of one op inside a recipe, and the context a rule gets.

Terms: a *recipe* is the local program one traced op becomes (built into a
:class:`~.builder.SubgraphBuilder`). A :class:`TensorArg` is a distributed tensor argument
of the op inside the recipe (its recipe node, its DTensorSpec: global shape and
placements, and the mask of a MaskPartial value); a :class:`ScalarArg` a run-time Python
number. A *schema leaf* is what DTensor's propagation sees for an argument (the spec, a
global size, a hint), a *global leaf* what the local op gets for a non-tensor argument.
An *out tensor* (:func:`_out_tensor`) is a local result node with the spec DTensor (or a
rule) gave it. :class:`NoStrategy` is how every stage of expansion says "DTensor cannot
shard this op with these inputs" (the op then falls back, :mod:`.fallback`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..errors import SpmdError
from .builder import OutTensor, SubgraphBuilder
from .values import DSymInt, MeshContext, placements_text

__all__ = ["TensorArg", "ScalarArg", "ExpandContext", "NoStrategy", "input_placements_text", "RESULT"]

RESULT = "result"  # ExpandContext.grad_of: the parameter whose gradient the op computes

log = logging.getLogger("spmd_compiler.expand.dispatch")  # the logger name users filter on


class NoStrategy(Exception):
    """DTensor has no sharding strategy for an op with these inputs."""


@dataclass
class TensorArg:
    """A tensor argument inside a recipe: its recipe node, spec and optional mask node.

    ``index`` is its position among the traced node's tensor arguments (None for values
    a rule derives inside the recipe, which ``label`` describes instead). ``positions``:
    the dim along which the value holds its own global positions (:mod:`.positions`).
    ``rows``: what is known of it as a restricted value of token routing (:mod:`.orders`).
    """

    node: fx.Node
    spec: Any
    mask: fx.Node | None = None
    index: int | None = None
    label: str | None = None
    positions: int | None = None
    rows: Any = None

    def moved(self, node: fx.Node, spec: Any, mask: fx.Node | None) -> "TensorArg":
        """The same argument after a redistribution (same global values; a restricted
        value's facts, :mod:`.orders`, do not survive one)."""
        return TensorArg(node, spec, mask, self.index, self.label, self.positions)

    @property
    def local(self) -> torch.Tensor:
        return self.node.meta["val"]


@dataclass
class ScalarArg:
    """A run-time Python number inside a recipe (see :class:`~.values.RScalar`)."""

    node: fx.Node
    hint: Any


@dataclass
class ExpandContext:
    """What a rule may use while building a recipe.

    ``activation_sharding`` is the plan's rule for choosing among DTensor's strategies
    (see :func:`follow_inputs`): ``"follow"`` or ``"greedy"``. ``rng`` is how random ops
    draw (:mod:`.rules.random`): ``"exact"`` or ``"fast"``. ``grad_of`` maps the index of
    a tensor argument that is a parameter's gradient (traced node tagged by
    :mod:`spmd_compiler.trace.grad_links`) to that parameter's planned spec, and
    :data:`RESULT` to the spec of the parameter whose gradient (or a term of it) the op's
    result is; it is part of the recipe's cache key.
    """

    mctx: MeshContext
    fake_mode: Any
    fallback: str = "replicate"
    node: fx.Node | None = None
    warned: set | None = None
    activation_sharding: str = "follow"
    rng: str = "exact"
    grad_of: dict[int | str, Any] | None = None
    routing_global: frozenset = frozenset()

    def warn_once(self, key: Any, msg: str, *args: Any) -> None:
        if self.warned is None:
            self.warned = set()
        if key not in self.warned:
            self.warned.add(key)
            log.warning(msg, *args)


def _is_tensor_arg(x: Any) -> bool:
    return isinstance(x, TensorArg)


def _schema_leaf(x: Any) -> Any:
    if isinstance(x, TensorArg):
        return x.spec
    if isinstance(x, DSymInt):
        return x.global_value
    if isinstance(x, ScalarArg):
        return x.hint
    return x


def _global_leaf(x: Any) -> Any:
    """The value a local op gets for a non-tensor argument."""
    if isinstance(x, DSymInt):
        return x.global_value
    if isinstance(x, ScalarArg):
        return x.node
    return x


def input_placements_text(args: Any, kwargs: Any) -> list[str]:
    leaves = pytree.tree_leaves((args, kwargs))
    return [f"{placements_text(a.spec.placements)} {list(a.spec.shape)}" for a in leaves if isinstance(a, TensorArg)]


def _input_specs(args: Any, kwargs: Any) -> list[Any]:
    return [t.spec for t in pytree.tree_leaves((args, kwargs), is_leaf=_is_tensor_arg) if isinstance(t, TensorArg)]


def _is_sharded(p: Any) -> bool:
    return isinstance(p, (pt.Shard, pt.StridedShard))


def _op_name(op: Any) -> str:
    return str(op).replace("aten.", "")


def _out_tensor(b: SubgraphBuilder, node: fx.Node, spec: Any, masks: dict[int, fx.Node]) -> OutTensor:
    mask_index = None
    for p in spec.placements:
        if isinstance(p, pt.MaskPartial):
            mask = masks.get(id(p.mask_buffer))
            if mask is None:
                # every MaskPartial is made by redistribute with its mask (or a zero mask
                # once applied), so no plan reaches this
                raise SpmdError(f"a {placements_text(spec.placements)} output has no mask among its inputs' masks; this is a bug in spmd-compiler")
            mask_index = b.slot(mask)
    node.meta["spmd_spec"] = spec
    return OutTensor(b.slot(node), spec, mask_index)
