"""Position tensors: integer tensors whose values are their own global positions.

``torch.arange(n)`` and views of it (``arange(b)[:, None, None, None]``, an ``expand``)
hold, at every global position ``i`` along one dim, the value ``i``, whatever the other
coordinates. Models build such tensors to index a batch-shaped tensor row by row:
Hugging Face's ``create_causal_mask`` evaluates its mask functions as
``packed_sequence_mask[batch_arange, q_arange]``. That is a fact about the *global*
tensor, so it holds under any placement, and it says what a rank's local elements are:
under ``Shard`` its global row numbers (the arange rule builds them as
``offset + arange(local)``). :mod:`.rules.indexing` uses it to index a sharded tensor by
such rows with this rank's local rows, where DTensor would gather the indexed tensor.

The fact is tracked per traced value (``DValue.extra[POSITIONS]`` = the dim) by the
transfer functions below, one per aten op, each exact for its op: anything not listed
drops it. The traced graph keeps in-place ops, so a value whose storage any op writes
(``r = arange(b); r += 1``, or a write through a view of it) is never tagged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt

from .values import DSymInt, DValue

__all__ = ["POSITIONS", "positions_of", "follow", "written_storages"]

aten = torch.ops.aten

POSITIONS = "positions"
_INDEX_DTYPES = (torch.int64, torch.int32)


def positions_of(value: Any) -> int | None:
    """The dim along which ``value`` (a DValue) holds its own global positions, or None."""
    return value.extra.get(POSITIONS) if isinstance(value, DValue) else None


def _g(x: Any) -> Any:
    return x.global_value if isinstance(x, DSymInt) else x


def _arange(args: tuple, kwargs: dict, op: Any) -> int | None:
    if op is aten.arange.default:
        start, step = 0, 1
    elif op is aten.arange.start:
        start, step = args[0], 1
    else:
        start, _, step = args
    return 0 if _g(start) == 0 and _g(step) == 1 else None


def _unsqueeze(args: tuple, kwargs: dict, op: Any) -> int | None:
    x, dim = args[0], args[1]
    p = positions_of(x)
    if p is None:
        return None
    dim = dim % (len(x.spec.shape) + 1)
    return p + 1 if dim <= p else p


def _slice(args: tuple, kwargs: dict, op: Any) -> int | None:
    x = args[0]
    p = positions_of(x)
    if p is None:
        return None
    rest = list(args[1:])
    dim, start, end, step = rest + [kwargs.get(k, d) for k, d in (("dim", 0), ("start", None), ("end", None), ("step", 1))][len(rest):]
    dim = _g(dim) % len(x.spec.shape)
    if dim != p:  # another dim: every remaining element keeps its value and its position along p
        return p
    full = _g(start) in (0, None) and (end is None or _g(end) >= x.spec.shape[p]) and _g(step) == 1
    return p if full else None


def _expand(args: tuple, kwargs: dict, op: Any) -> int | None:
    x, sizes = args[0], args[1]
    p = positions_of(x)
    return None if p is None else p + len(sizes) - len(x.spec.shape)


def _same(args: tuple, kwargs: dict, op: Any) -> int | None:
    return positions_of(args[0])


def _add_zero(args: tuple, kwargs: dict, op: Any) -> int | None:
    other = args[1] if len(args) > 1 else kwargs.get("other")
    alpha = kwargs.get("alpha", 1)
    if isinstance(other, (int, DSymInt)) and not isinstance(other, bool) and (_g(other) == 0 or _g(alpha) == 0):
        return positions_of(args[0])
    return None


_TRANSFER: dict[Any, Callable[[tuple, dict, Any], int | None]] = {
    aten.arange.default: _arange,
    aten.arange.start: _arange,
    aten.arange.start_step: _arange,
    aten.unsqueeze.default: _unsqueeze,
    aten.slice.Tensor: _slice,
    aten.expand.default: _expand,
    aten.alias.default: _same,
    aten.clone.default: _same,
    aten.lift_fresh_copy.default: _same,
    aten.add.Tensor: _add_zero,
    aten.sub.Tensor: _add_zero,
}


def written_storages(graph: fx.Graph) -> set[fx.Node]:
    """The owners (:func:`pt.storage_owner`) of every tensor some op of ``graph`` writes in place."""
    return pt.written_storages(graph)


def follow(op: Any, args: tuple, kwargs: dict, result: Any, node: fx.Node, written: set[fx.Node]) -> None:
    """Tag ``result`` (the expanded value of traced ``node``, ``op(*args, **kwargs)``)
    with the dim along which it holds its own global positions, when ``op`` keeps or
    makes that fact and no op writes its storage (``written``, :func:`written_storages`)."""
    fn = _TRANSFER.get(op)
    if fn is None or not isinstance(result, DValue) or result.spec.tensor_meta.dtype not in _INDEX_DTYPES:
        return
    if pt.storage_owner(node) in written:
        return
    dim = fn(args, kwargs, op)
    if dim is not None and 0 <= dim < len(result.spec.shape):
        result.extra[POSITIONS] = dim
