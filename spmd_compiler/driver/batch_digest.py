"""Ranks that must pass the same batch values do: a per-step digest in the step check.

A batch tensor that the plan leaves ``Replicate`` on a mesh axis (tensor parallel: the
tp axis, or every axis of a pure-TP mesh) is read as one tensor by that axis's ranks:
each of them must pass the *same* rows. The step check (:mod:`.guard`, :mod:`.fold`)
agrees on the call signature (shapes, dtypes), not on values; a trainer whose sampler is
seeded by the global rank instead of the data-parallel one would train silently wrong
(each tp rank computing its shard of the layers on other rows). So every step also
compares a digest of those tensors between the axis's ranks:

* :func:`leaf_digest`: a 61-bit digest of one tensor: the int64 sum of its values (of
  its bit patterns for floats: viewed as int16/int32/int64, so ``-0.0``, NaN payloads
  and every bit count), the sum weighted by row position (a permutation of rows
  changes it) and the shape, mixed modulo the prime ``2**61 - 1``; :func:`combine` of
  the leaves in order. One pass over each tensor: about 8 us a small tensor (16 us for
  a GPT's 8 x 64 int64 ids and targets), mostly torch's per-op overhead.
* the folded check (:mod:`.fold`) carries ``d = digest mod 2**bits`` in the first
  collective of each axis on which some batch tensor is Replicate (a FoldPoint's
  ``digest``): a sum carries ``(d, d*d)``, and the ranks' values are all equal exactly
  when ``n * sum(d*d) == sum(d)**2`` (Cauchy-Schwarz, equality iff all equal), which
  every rank reads from the same result; a max carries ``(d, 2**bits - 1 - d)``, all
  equal iff the two maxima add up to ``2**bits - 1``; a gather carries ``d`` in each
  rank's row. ``bits`` (:func:`digest_bits`) keeps every partial sum exact in the
  payload's dtype: a float32 sum over n ranks needs ``n * 4**bits <= 2**24``: 11 bits
  at 2 to 4 ranks, 10 at 8, 8 at up to 256; float64 or int64: 24. Two different batches
  have the same ``d`` with probability ``2**-bits`` (1/2048 for float32 at 2 ranks): one
  step may miss a difference with that probability, a persistent one is caught on the
  next steps.
* the standalone check (:class:`.guard.StepGuard`, an ``all_reduce(MAX)`` over every
  rank) carries the full digest ``h`` of each axis group in that group's slot pair,
  ``(h, -h)`` (``-2**62`` in the other groups' slots): a group's ranks agree iff
  ``max(h) + max(-h) == 0``. A miss needs a 61-bit collision.
* a difference read in either check makes every rank resync (nothing has run: the check
  precedes the program's first effect); the exchange of call signatures then carries
  each rank's per-tensor digests (:func:`rank_digests`), and every rank raises the same
  ValueError (:func:`values_error`) naming the axis, the tensor and the fix. The first
  call (which compiles) is checked by that exchange too.

Only CPU tensors are digested: a CUDA batch would make the host wait for the GPU every
step, so it is not checked (nor is any batch of a pipeline, whose stages read different
parts of it). ``check_ranks=False`` turns the check off with the compile's agreement.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import _private_torch as pt
from ..trace.tracer import flatten_batch
from .batch import batch_placements

__all__ = ["leaf_digest", "combine", "digest_bits", "digest_elements", "digest_agrees", "with_digest", "value_slots",
           "batch_digests", "values_error"]

log = logging.getLogger(__name__)

_P = 2**61 - 1  # a Mersenne prime: the digests' modulus
_A, _B = 0x9E3779B97F4A7C15 % _P, 0xC2B2AE3D27D4EB4F % _P
NONE = -(2**62)  # the standalone check's slots of other groups (below any -h)
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def leaf_digest(t: torch.Tensor) -> int:
    """A digest in ``[0, 2**61 - 1)`` of ``t``'s values, shape-aware (see the module
    docstring). Equal tensors have equal digests (a DTensor: its local tensor's)."""
    t = pt.local_tensor(t)
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    elif t.dtype.is_floating_point:
        t = t.view(_INT[t.element_size()])
    rows = t.reshape(t.shape[0] if t.dim() else 1, -1).sum(1, dtype=torch.int64)
    total = int(rows.sum())
    weighted = int((rows * torch.arange(1, rows.numel() + 1, dtype=torch.int64)).sum())
    shape = 0
    for n in t.shape:
        shape = (shape * 1000003 + n + 1) % _P
    return ((total % _P) * _A + (weighted % _P) * _B + shape) % _P


def combine(tensors: Sequence[torch.Tensor]) -> int:
    """One digest of several tensors, in order."""
    h = 0
    for t in tensors:
        h = (h * _A + leaf_digest(t) + 1) % _P
    return h


def digest_bits(dtype: torch.dtype, kind: str, op: str, n: int) -> int:
    """The digest bits a fold's payload of ``dtype`` carries exactly over ``n`` ranks
    (0: too few to be worth it, below 4, e.g. bfloat16 payloads)."""
    if dtype.is_floating_point:
        exact = round(-math.log2(torch.finfo(dtype).eps)) + 1  # integers up to 2**exact are exact
        if op == "avg":
            exact -= 1  # the mean is read back as round(n * mean)
    elif dtype == torch.bool or dtype.is_complex:
        return 0
    else:
        exact = torch.iinfo(dtype).bits - 1
    if kind == "all_reduce" and op in ("sum", "avg"):
        bits = (exact - math.ceil(math.log2(n))) // 2  # n * (2**bits - 1)**2 < 2**exact
    else:
        bits = exact - 1
    bits = min(bits, 24)
    return bits if bits >= 4 else 0


def encode(d: int, kind: str, op: str, bits: int) -> list[int]:
    """The elements one rank sends for its digest ``d`` (already below ``2**bits``)."""
    if kind == "all_gather":
        return [d]
    if op == "max":
        return [d, (1 << bits) - 1 - d]
    return [d, d * d]


def width(kind: str) -> int:
    return 1 if kind == "all_gather" else 2


def digest_elements(tensors: list, kind: str, op: str, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's digest elements for a folded collective (a node of the guarded
    program, run before the collective; called in Python by a rank that joins the
    collective, :meth:`.fold_check.FoldPoint.raise_flag`)."""
    try:
        d = combine(tensors) % (1 << bits)
    except Exception:  # never stop one rank alone before a collective: the others would wait for it
        log.warning("the batch digest failed on this rank's batch; its ranks resync every step", exc_info=True)
        d = 0
    return torch.tensor(encode(d, kind, op, bits), dtype=dtype)


def digest_agrees(rows: list[list[float]], kind: str, op: str, n: int, bits: int) -> bool:
    """Whether the folded collective's digest elements (one row, or one per rank for a
    gather) say every rank sent the same digest (see the module docstring)."""
    if kind == "all_gather":
        return all(r == rows[0] for r in rows)
    a, b = rows[0]
    if op == "max":
        return a + b == (1 << bits) - 1
    if op == "avg":
        a, b = round(a * n), round(b * n)
    return n * b == a * a


def with_digest(point: Any, step: Any) -> Any:
    """``point`` (a FoldPoint or a FoldChain of ``step``'s program) with each folded
    collective carrying the digest of the CPU batch tensors that are Replicate on its
    mesh axis (where there are some and its payload carries enough bits)."""
    if point is None:
        return None
    if hasattr(point, "points"):
        return type(point)(tuple(with_digest(p, step) for p in point.points))
    mctx = step.mctx
    if point.group not in mctx.group_names:
        return point
    axis = list(mctx.group_names).index(point.group)
    holders = [n.name for n in step.gm.graph.find_nodes(op="placeholder")][len(mctx.shape):]
    if len(holders) != len(step.traced.inputs):
        return point  # inputs other than the traced ones (size symbols): no fold anyway
    digest = tuple((inp.index, name) for inp, spec, name in zip(step.traced.inputs, step.input_specs, holders)
                   if inp.kind == "batch" and (inp.device or torch.get_default_device()).type == "cpu"
                   and isinstance(spec.placements[axis], pt.Replicate))
    bits = digest_bits(point.dtype, point.kind, point.op, point.world_size)
    if not digest or not bits:
        return point
    return dataclasses.replace(point, digest=digest, bits=bits)


# ------------------------------------------------------------------ the standalone check and the exchange


def replicated(placements: Sequence[Sequence[Any] | None], leaves: Sequence[Any], shape: Sequence[int]) -> dict[int, list[int]]:
    """Per mesh axis of more than one rank, the indices of the CPU batch tensors that are
    Replicate on it (axes with none left out)."""
    out: dict[int, list[int]] = {}
    for i, (pl, leaf) in enumerate(zip(placements, leaves)):
        if pl is None or not isinstance(leaf, torch.Tensor) or leaf.device.type != "cpu":
            continue
        for a, p in enumerate(pl):
            if shape[a] > 1 and isinstance(p, pt.Replicate):
                out.setdefault(a, []).append(i)
    return out


def step_axes(step: Any, shape: Sequence[int]) -> dict[int, list[int]]:
    """Per mesh axis of more than one rank, the batch leaves ``step``'s program reads as
    CPU tensors Replicate on it: from the program alone, so every rank running it sends
    as many slots (:func:`value_slots`)."""
    out: dict[int, list[int]] = {}
    for inp, spec in zip(step.traced.inputs, step.input_specs):
        if inp.kind != "batch" or (inp.device or torch.get_default_device()).type != "cpu":
            continue
        for a, p in enumerate(spec.placements):
            if shape[a] > 1 and isinstance(p, pt.Replicate):
                out.setdefault(a, []).append(inp.index)
    return out


def _group_index(coord: Sequence[int], shape: Sequence[int], axis: int) -> int:
    """The index of the ``axis`` group that holds ``coord`` (row-major over the other axes)."""
    idx = 0
    for a, (c, s) in enumerate(zip(coord, shape)):
        if a != axis:
            idx = idx * s + c
    return idx


def standalone_slots(axes: dict[int, list[int]], leaves: Sequence[Any], coord: Sequence[int], shape: Sequence[int]) -> list[int]:
    """This rank's slots of the standalone check's MAX: per checked axis, a pair per
    group of that axis, ``(h, -h)`` in its own group's, :data:`NONE` elsewhere."""
    out: list[int] = []
    for a in sorted(axes):
        groups = math.prod(shape) // shape[a]
        pairs = [NONE] * (2 * groups)
        h = combine([leaves[i] for i in axes[a]])
        g = _group_index(coord, shape, a)
        pairs[2 * g], pairs[2 * g + 1] = h, -h
        out += pairs
    return out


def slots_agree(values: Sequence[int]) -> bool:
    """Whether the MAX of every rank's :func:`standalone_slots` says each group agreed."""
    return all(values[i] + values[i + 1] == 0 for i in range(0, len(values), 2))


def rank_digests(axes: dict[int, list[int]], leaves: Sequence[Any], paths: Sequence[str], coord: Sequence[int]) -> Any:
    """What a rank sends in the exchange of call signatures: its coordinate and, per
    checked axis, each replicated tensor's (path, shape, digest)."""
    return tuple(coord), {a: [(paths[i], tuple(leaves[i].shape), leaf_digest(leaves[i])) for i in idx] for a, idx in axes.items()}


def value_slots(mesh: Any, step: Any, leaves: Sequence[Any], changed: bool = False) -> list[int] | None:
    """This rank's :func:`standalone_slots` for the agreed ``step``'s program (None:
    nothing to compare). Every rank sends as many (the count comes from the program): a
    rank whose signature ``changed`` (it raises the flag, every rank resyncs) or whose
    batch cannot be digested sends :data:`NONE` in all of them, which count for nothing."""
    shape = tuple(mesh.shape)
    axes = step_axes(step, shape)
    if not axes:
        return None
    ok = not changed and all(i < len(leaves) and isinstance(leaves[i], torch.Tensor) and leaves[i].device.type == "cpu"
                             for idx in axes.values() for i in idx)
    try:
        if ok:
            return standalone_slots(axes, leaves, tuple(mesh.get_coordinate()), shape)
    except Exception:  # never stop one rank alone before a collective: the others would wait for it
        log.warning("the batch digest failed on this rank's batch; its values are not checked", exc_info=True)
    return [NONE] * sum(2 * math.prod(shape) // shape[a] for a in axes)


def batch_digests(mesh: Any, plan: Any, batch: tuple, kwargs: dict) -> Any:
    """This rank's :func:`rank_digests` of its call's batch, for the exchange of call
    signatures (placements from the plan, no trace needed; None: nothing to compare)."""
    try:
        leaves, _, paths = flatten_batch(batch, kwargs)
        shape = tuple(mesh.shape)
        axes = replicated(batch_placements(plan, paths, leaves, mesh.ndim), leaves, shape)
        return rank_digests(axes, leaves, paths, tuple(mesh.get_coordinate())) if axes else None
    except Exception:  # never stop one rank alone before the exchange (a bad plan fails in the compile, on every rank)
        log.warning("the batch digest failed on this rank's batch; its values are not checked", exc_info=True)
        return None


def values_error(everyone: Sequence[Any], mesh: Any) -> ValueError | None:
    """The error every rank raises when ranks of an axis group passed different values
    for a batch tensor that is Replicate on that axis (None: they agree). ``everyone``:
    each rank's :func:`rank_digests` (None where it sent none), the same list on every
    rank, so every rank raises the same error. Tensors of different shapes are left to
    the check of shapes (:func:`.batch.global_batch`), whose error says so."""
    everyone = [e for e in everyone if e is not None]
    if not everyone:
        return None
    axis_names = mesh if isinstance(mesh, (list, tuple)) else mesh.mesh_dim_names or [f"axis{a}" for a in range(mesh.ndim)]
    for coord, per_axis in everyone:
        for a, items in sorted(per_axis.items()):
            for other, theirs in everyone:
                if other <= coord or any(o != c for k, (o, c) in enumerate(zip(other, coord)) if k != a):
                    continue  # each pair of one axis group once
                diff = [p for (p, s, h), (q, t, g) in zip(items, theirs.get(a, [])) if p == q and s == t and h != g]
                if diff:
                    return _error(axis_names, a, coord, other, diff)
    return None


def _error(axis_names: Sequence[str], axis: int, coord: tuple, other: tuple, paths: list[str]) -> ValueError:
    name = axis_names[axis]
    data = [n for k, n in enumerate(axis_names) if k != axis]
    what = ", ".join(paths)
    if data:
        by = " and ".join(f"mesh[{n!r}].get_local_rank()" for n in data)
        fix = (f"give every rank of a {name} group the same rows: shard and seed the data loader by the "
               f"{'/'.join(data)} coordinate ({by}), not by the global rank")
    else:
        fix = "pass the same batch on every rank (seed every rank's data loader alike; not by the rank)"
    return ValueError(
        f"the ranks at mesh coordinates {coord} and {other} passed different values for {what}: the plan makes "
        f"{'it' if len(paths) == 1 else 'them'} Replicate on mesh axis {name!r}, so every rank of that axis must pass "
        f"identical values (shapes agreed, values did not; the step would train silently wrong). fix: {fix}"
    )
