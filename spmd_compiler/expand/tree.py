"""Fast traversal of op arguments (lists, tuples, dicts), for the expander's hot path.

torch's pytree is general and slow; op arguments only nest lists, tuples and dicts
(fx's immutable variants included). Every traversal here visits leaves in the same
order: sequence items in order, dict values in insertion order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.fx.node import map_aggregate

__all__ = ["leaves", "tree_map"]


def leaves(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for v in x:
            yield from leaves(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from leaves(v)
    else:
        yield x


def tree_map(fn: Callable[[Any], Any], x: Any) -> Any:
    """Apply ``fn`` to every leaf, keeping the structure (fx's immutable containers
    become plain lists/dicts)."""
    return map_aggregate(x, fn)
