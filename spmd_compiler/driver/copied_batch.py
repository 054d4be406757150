"""Every rank passed the global batch: caught in the exchange of call signatures.

A batch tensor that the plan shards along a mesh axis (``Shard(0)`` on the data-parallel
axis, ``Shard(1)`` on a context-parallel one) is read as one global tensor made of the
ranks' pieces: each rank must pass *its own* shard. A trainer that hands every rank the
whole batch trains without an error: the program reads the ``n`` equal copies as a global
batch ``n`` times as large, every rank does the work of the whole batch, and nothing is
parallel. It shows in the values: the pieces of a real shard differ, the copies do not.

So the exchange of call signatures (the first call, and every call after a resync; with
``check_ranks``, on CPU tensors, as :mod:`.batch_digest`) also carries, per mesh axis of
more than one rank and per batch tensor sharded on it, the tensor's path, shape, sharded
dim, digest (:func:`.batch_digest.leaf_digest`) and whether its own slices along that dim
differ (:func:`distinct_slices`). :func:`global_batch_error` reads every rank's (the same
list on every rank, so every rank raises the same ValueError): the ranks of an axis group
that all passed equal values, with at least two different slices along the sharded dim,
passed copies, not shards. A tensor whose slices are all equal (an all-ones mask,
position ids broadcast over the batch) has equal shards on every rank by itself: never
reported. Two real shards are equal only if the data repeat across ranks, which is a
mistake too. ``compile(..., check_ranks=False)`` turns the check off.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from .. import _private_torch as pt
from ..trace.tracer import flatten_batch
from .batch import batch_placements
from .batch_digest import _INT, leaf_digest

__all__ = ["distinct_slices", "shard_digests", "global_batch_error"]

log = logging.getLogger(__name__)


def distinct_slices(t: torch.Tensor, dim: int) -> bool:
    """Whether ``t`` has two slices along ``dim`` that differ (bit for bit)."""
    t = pt.local_tensor(t)
    if t.dim() == 0 or t.shape[dim] < 2 or t.numel() == 0:
        return False
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    elif t.dtype.is_floating_point:
        t = t.view(_INT[t.element_size()])
    rows = t.movedim(dim, 0).reshape(t.shape[dim], -1)
    return bool((rows != rows[:1]).any())


def shard_digests(mesh: Any, plan: Any, batch: tuple, kwargs: dict) -> Any:
    """This rank's ``(coord, {axis: [(path, shape, dim, digest, distinct)]})`` for the
    CPU batch tensors sharded on mesh axes of more than one rank (None: none; never
    raises, so no rank stops alone before the exchange)."""
    try:
        leaves, _, paths = flatten_batch(batch, kwargs)
        shape = tuple(mesh.shape)
        out: dict[int, list[tuple]] = {}
        for i, pl in enumerate(batch_placements(plan, paths, leaves, mesh.ndim)):
            leaf = leaves[i]
            if pl is None or not isinstance(leaf, torch.Tensor) or leaf.device.type != "cpu":
                continue
            for a, p in enumerate(pl):
                if shape[a] > 1 and isinstance(p, pt.Shard) and p.dim < leaf.dim():
                    out.setdefault(a, []).append(
                        (paths[i], tuple(leaf.shape), p.dim, leaf_digest(leaf), distinct_slices(leaf, p.dim)))
        return (tuple(mesh.get_coordinate()), out) if out else None
    except Exception:  # never stop one rank alone before the exchange (a bad plan fails in the compile, on every rank)
        log.warning("the shard digest failed on this rank's batch; it is not checked for a global batch", exc_info=True)
        return None


def global_batch_error(everyone: Sequence[Any], mesh: Any) -> ValueError | None:
    """The error every rank raises when every rank of some axis group passed the same
    values for a batch tensor the plan shards on that axis (and whose own slices along
    the sharded dim differ), or None. ``everyone``: each rank's :func:`shard_digests`
    (None where it sent none), the same list on every rank."""
    sent = [e for e in everyone if e is not None]
    if not sent:
        return None
    sizes = tuple(mesh.shape)
    names = list(mesh.mesh_dim_names or [f"axis{a}" for a in range(len(sizes))])
    groups: dict[tuple, list[tuple]] = defaultdict(list)  # (axis, the other coordinates) -> [(coord, items)]
    for coord, per_axis in sent:
        for a, items in per_axis.items():
            groups[(a, coord[:a] + coord[a + 1:])].append((coord, {item[0]: item for item in items}))
    for (a, _), members in sorted(groups.items()):
        if len(members) < sizes[a]:
            continue  # a rank sent nothing (its digest failed): not judged
        members.sort()
        copies = [item for path, item in members[0][1].items()
                  if item[4] and all(m.get(path) == item for _, m in members[1:])]
        if copies:
            return _error(names[a], sizes[a], [c for c, _ in members], copies)
    return None


def _error(axis: str, n: int, coords: list[tuple], copies: list[tuple]) -> ValueError:
    paths = ", ".join(item[0] for item in copies)
    shapes = ", ".join(f"{path} {shape}" for path, shape, *_ in copies)
    _, shape, dim, *_ = copies[0]
    them = "it" if len(copies) == 1 else "them"
    return ValueError(
        f"every rank of mesh axis {axis!r} (mesh coordinates {', '.join(map(str, coords))}) passed the same values for "
        f"{paths} (shapes on each rank: {shapes}): the plan shards {them} on {axis!r} (Shard({dim}) of {copies[0][0]}), "
        f"so each rank must pass its own shard, not the global batch. As passed, the step reads {n} copies as one batch "
        f"of {shape[dim] * n} along dim {dim}: every rank does the work of the whole batch and nothing runs in parallel. "
        f"fix: pass each rank its own shard: x.chunk({n}, dim={dim})[mesh[{axis!r}].get_local_rank()] (or a "
        f"DistributedSampler with num_replicas={n}, rank=mesh[{axis!r}].get_local_rank()); or, if every rank should see "
        f"the same rows, plan the input Replicate() on {axis!r} (Plan(inputs={{{copies[0][0]!r}: ...}}) or default_input). "
        f"(This check runs with compile(..., check_ranks=True), the default; check_ranks=False skips it.)"
    )
