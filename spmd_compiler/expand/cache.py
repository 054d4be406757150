"""Memoized expansion: one recipe per distinct (op, argument layout) case.

A transformer repeats the same ops on the same shapes and placements layer after layer.
The key holds everything that determines a recipe: the op overload; for each tensor
argument its placements, global shape/stride, dtype, local shape/stride and whether it
is a position tensor (:mod:`.positions`); every
non-tensor argument (sizes as ``DSymInt`` keys); the mesh; for an argument that is a
parameter's gradient, the parameter's planned layout (``ExpandContext.grad_of``, added by
:func:`.recipes.expand_node`). Replaying a cached recipe
splices the same subgraph again, so the result is identical to expanding afresh.
Recipes that depend on this rank's coordinate (uneven shards) are stored per coordinate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .builder import Recipe
from .orders import ROWS
from .positions import POSITIONS
from .values import DSymInt, DValue, RScalar, _key

__all__ = ["ExpansionCache", "abstract_key"]


def abstract_key(x: Any) -> Any:
    """A hashable description of an expansion argument, free of graph nodes."""
    if isinstance(x, DValue):
        local = x.local
        return (
            "T",
            tuple(x.spec.placements),
            tuple(_key(s) for s in x.spec.shape),
            tuple(_key(s) for s in x.spec.stride),
            x.spec.tensor_meta.dtype,
            tuple(_key(s) for s in local.shape),
            tuple(_key(s) for s in local.stride()),
            x.mask is not None,
            x.extra.get(POSITIONS),
            x.extra[ROWS].key() if ROWS in x.extra else None,
        )
    if isinstance(x, (DSymInt, RScalar)):
        return x.key()
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(abstract_key(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, abstract_key(v)) for k, v in sorted(x.items())))
    if isinstance(x, float) and math.isnan(x):
        return ("nan",)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _key(x)
    if isinstance(x, torch.Tensor):
        raise TypeError("a raw tensor reached the expansion cache key; expected a DValue")
    return (type(x).__name__, x)


@dataclass
class ExpansionCache:
    """Recipes by key, with hit/miss counters.

    One cache may serve several expansions on the same mesh (a recompile for new shapes
    reuses the recipes of unchanged layers). ``warned`` holds the keys of the warnings
    already logged by those expansions, so each is logged once per compiled step.
    """

    enabled: bool = True
    hits: int = 0
    misses: int = 0
    _store: dict = field(default_factory=dict)
    warned: set = field(default_factory=set)

    def lookup(self, key: Any, coordinate: tuple[int, ...]) -> Recipe | None:
        if not self.enabled:
            return None
        recipe = self._store.get(key)
        if recipe is None:
            recipe = self._store.get((key, coordinate))
        if recipe is None:
            self.misses += 1
        else:
            self.hits += 1
        return recipe

    def store(self, key: Any, coordinate: tuple[int, ...], recipe: Recipe) -> None:
        if not self.enabled:
            return
        self._store[(key, coordinate) if recipe.coord_dependent else key] = recipe

    def __len__(self) -> int:
        return len(self._store)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._store), "hits": self.hits, "misses": self.misses}
