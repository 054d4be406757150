"""The per-step rank-agreement check, folded into a collective the step already makes.

The step guard (:mod:`.guard`) costs one extra round trip per step: a one-element
``all_reduce(MAX)`` of "my call signature differs from the agreed one". Most programs
start their communication with a collective over every rank anyway (a DP forward's loss
or target count all_reduce, the first gradient bucket, an FSDP parameter gather, the
all_gather of an uneven batch's row counts), and every rank that runs the agreed program
runs that same collective. So the check can ride on it:

* the *fold point* (:func:`find_fold`) is the program's first effect in execution order
  when it is an ``all_reduce`` (sum, avg or max) or an ``all_gather_into_tensor`` over
  every rank, on a CPU tensor of a float or integer dtype;
* the *guarded variant* (:func:`fold_guard_pass`) sends that collective's payload
  flattened with one or two more elements carrying the *program id* (the program's slot
  in the driver's cache, 1 to ``cache_size``, the same on every rank:
  :meth:`FoldPoint.encode`), waits for it before the program's next collective, write
  or random op (moving the wait up if the schedule put it later), checks the extra
  elements (:func:`resync_if_flagged`: they read :meth:`FoldPoint.expected` exactly when
  every rank sent this program's id; otherwise every rank raises :class:`.guard.Resync`
  there together, nothing having changed), and hands the original elements on to the
  collective's users (a gather: each rank's row without its id, one copy of the
  gathered result);
* a rank whose signature matches no program it may run cannot run the agreed one (its
  shapes differ), so it joins only that collective, with zeros and id 0
  (:meth:`FoldPoint.join`), and raises Resync.

Since the extra elements say *which* program a rank runs, not only "the agreed one or
not", a rank whose signature matches another cached program whose folded collective is
the same (kind, op, group, payload shape and dtype: :attr:`FoldPoint.spec`) runs that
program directly (:meth:`StepDriver._switch_target`): the ranks meet in a collective of
the same shape either way, and go on only if every rank ran the same program. This is
what gradient accumulation does every window (no gradient at the call, gradients in,
stepping: three programs whose first collective is the loss's reduction), so switching
costs no exchange of signatures.

On a mesh of several axes (dp x tp) no collective spans every rank; there the check
rides on the first collective of *each* axis group instead (:class:`FoldChain`): a rank
whose signature matches nothing sends id 0 in each of them, and a rank that reads a
mismatch in one sends id 0 in the later ones before Resync. If no rank reads a mismatch
in its last fold, each fold's group sent one id, and those groups connect the mesh, so
every rank ran the same program; if some group mismatched, every rank of the mesh
mismatches by its last fold (from a rank that did not, its later-axis groups lead back
through earlier-axis groups that all agreed, covering the mesh). Until the last fold's
check the program may only run collectives of axes folded already (their whole group
read the same ids, so it runs or skips them together): a write, or a collective of
another group, before it keeps the standalone check.

The steady step then makes exactly the collectives of the program, one or two elements
longer per rank (per axis on a mesh of several). Only for gloo: on NCCL reading the flag would
synchronize the host with the GPU stream, so there the standalone check on a gloo side
group stays (:class:`.guard.StepGuard`), as it does for pipelines, for the fake backend,
for programs whose first effect is a write or a collective over part of the mesh (where
no chain of folds fits), and for programs that draw random numbers: their standalone
exchange also carries a fingerprint of every rank's generators (:mod:`.rng`,
docs/randomness.md), which a float payload could not carry exactly.

The fold of an axis on which a batch tensor is Replicate (tp) also carries a digest of
those tensors after the program id (:attr:`FoldPoint.digest`, one more element or pair,
computed each step by a ``digest_elements`` node on the batch placeholders): ranks
that must pass the same rows but did not resync, and every rank raises the ValueError
(:mod:`.batch_digest`; the driver attaches it, :func:`.batch_digest.with_digest`).

This module finds the fold (:func:`find_fold`) and rewrites the program for it
(:func:`fold_guard_pass`); what runs at step time, :class:`FoldPoint`,
:class:`FoldChain` and :func:`resync_if_flagged`, lives in :mod:`.fold_check` (and is
importable from here too).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import torch
import torch.fx as fx

from ..optimize.graph_utils import WAIT, fake_call, new_node
from ..expand.rules.random import is_random
from .batch_digest import digest_elements
from .fold_check import _OPS, FoldChain, FoldPoint, resync_if_flagged
from .guard import _is_effect, first_effect

__all__ = ["FoldChain", "FoldPoint", "find_fold", "fold_guard_pass", "resync_if_flagged"]

log = logging.getLogger(__name__)

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
_KINDS = {c10d.all_reduce.default: "all_reduce", c10d.all_gather_into_tensor.default: "all_gather"}


def _exact(dtype: torch.dtype, op: str, world_size: int, ids: int) -> bool:
    """Whether the extra elements of a fold over ``world_size`` ranks stay exact in
    ``dtype`` for program ids up to ``ids`` (a sum adds up ids squared)."""
    top = world_size * ids * ids if op in ("sum", "avg") else ids
    if dtype.is_floating_point:
        return top <= 2 ** (round(-math.log2(torch.finfo(dtype).eps)))  # exact integers below 2**(mantissa bits + 1), halved for avg
    return top <= torch.iinfo(dtype).max


def _why_not(node: fx.Node, world_size: int, ids: int = 1) -> str | None:
    """Why the collective ``node`` cannot carry the check (None: it can)."""
    kind = _KINDS.get(node.target)
    if kind is None:
        return f"the first effect {node.name} is {node.target}, not an all_reduce or all_gather_into_tensor"
    size = node.meta.get("spmd_comm", {}).get("group_size")
    if size != world_size:  # a flag must reach every rank, not one mesh axis's group
        return f"{node.name} spans {size} ranks of {world_size}"
    payload = node.args[0]
    val = payload.meta.get("val") if isinstance(payload, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
        return f"{node.name}'s payload is not a CPU tensor"
    if not all(isinstance(s, int) for s in val.shape):
        return f"{node.name}'s payload has a symbolic shape"
    if val.dtype == torch.bool or val.dtype.is_complex:
        return f"{node.name}'s payload is {val.dtype}"
    if kind == "all_reduce" and (node.args[1] not in _OPS or (node.args[1] == "avg" and not val.dtype.is_floating_point)):
        return f"{node.name} reduces with {node.args[1]} ({val.dtype})"
    if kind == "all_gather" and (node.args[1] != world_size or val.dim() == 0):
        return f"{node.name} gathers {node.args[1]} parts of a {val.dim()}-d payload"
    if len(node.users) != 1 or next(iter(node.users)).target is not WAIT:
        return f"{node.name} is not waited exactly once"
    if not _exact(val.dtype, node.args[1] if kind == "all_reduce" else "", world_size, ids):
        return f"{node.name}'s payload ({val.dtype}) cannot carry program ids up to {ids} over {world_size} ranks exactly"
    return None


def find_fold(gm: fx.GraphModule, *, world_size: int, axes: Sequence[tuple[str, int]] = (), ids: int = 1) -> FoldPoint | FoldChain | None:
    """The collective of ``gm`` the step check can ride on, or None (the reason is
    logged at DEBUG): its first effect, an all_reduce or all_gather_into_tensor over all
    ``world_size`` ranks. Given the mesh's ``axes`` (each axis's group name on this rank
    and its size), a program whose collectives each span one axis gets a
    :class:`FoldChain` instead: the first collective of each axis of more than one rank,
    when every effect until the last of them is a collective (or wait) on an axis
    already folded. A program that draws random numbers keeps the standalone check,
    which also agrees the ranks' generators (:mod:`.rng`). ``ids``: the largest program
    id the fold must carry exactly (:meth:`FoldPoint.encode`)."""
    if any(is_random(n) for n in gm.graph.nodes):
        log.debug("no folded step check: the program draws random numbers")
        return None
    n = first_effect(gm)
    if n is None:
        log.debug("no folded step check: the program makes no collective")
        return None
    why = _why_not(n, world_size, ids)
    if why is None:
        return _point(n, world_size, ids)
    if sum(1 for _, size in axes if size > 1) > 1:
        return _chain(gm, axes, world_size, ids)
    log.debug("no folded step check: %s", why)
    return None


def _point(n: fx.Node, size: int, ids: int) -> FoldPoint:
    val, wait = n.args[0].meta["val"], next(iter(n.users))
    kind = _KINDS[n.target]
    return FoldPoint(n.name, wait.name, kind, n.args[1] if kind == "all_reduce" else "", n.args[-1], size,
                     tuple(val.shape), tuple(wait.meta["val"].shape), val.dtype, ids)


def _chain(gm: fx.GraphModule, axes: Sequence[tuple[str, int]], world_size: int, ids: int) -> FoldChain | None:
    """One fold per mesh axis of more than one rank (:class:`FoldChain`), or None."""
    sizes = dict(axes)
    if len(sizes) != len(axes) or math.prod(sizes.values()) != world_size:
        log.debug("no folded step check: mesh axes %s do not cover a world of %d", list(axes), world_size)
        return None
    todo = {name for name, size in axes if size > 1}
    points: list[FoldPoint] = []
    for n in gm.graph.nodes:
        if not todo:
            return FoldChain(tuple(points))
        if not _is_effect(n) or n.target is WAIT:
            continue  # a wait: of a collective issued on an axis folded already
        group = n.args[-1] if getattr(n.target, "namespace", None) == "_c10d_functional" else None
        if group not in sizes:
            log.debug("no folded step check: %s runs before a collective of every mesh axis", n.name)
            return None
        if group in todo:
            why = _why_not(n, sizes[group], ids)
            if why is not None:
                log.debug("no folded step check: the first collective of axis group %s cannot carry it: %s", group, why)
                return None
            todo.discard(group)
            points.append(_point(n, sizes[group], ids))
        # else: an axis folded already (its group read the same flags), or a group of one rank
    if todo:
        log.debug("no folded step check: no collective on the mesh axis groups %s", sorted(todo))
        return None
    return FoldChain(tuple(points))


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with a copy of ``gm``'s graph (node meta shared, shallowly copied)."""
    g = fx.Graph()
    out, old = g.graph_copy(gm.graph, {}, return_output_node=True)
    new_out = g.output(out, type_expr=old.type)
    new_out.meta = dict(old.meta)
    return fx.GraphModule(gm, g)


def fold_guard_pass(gm: fx.GraphModule, *, point: FoldPoint | FoldChain, program: int = 1) -> fx.GraphModule:
    """A copy of ``gm`` whose ``point`` collective (each collective of a
    :class:`FoldChain`) carries the step check with the id ``program`` (1 to
    ``point.ids``; see the module docstring); ``gm`` itself is left as it is. Same
    collectives, same results."""
    points = point.points if isinstance(point, FoldChain) else (point,)
    if not 1 <= program <= points[0].ids:
        raise ValueError(f"fold_guard_pass(program={program}): expected an id from 1 to {points[0].ids} (0 is a rank that joins only)")
    new = _copy(gm)
    for i, p in enumerate(points):
        _fold_into(new.graph, p, points[i + 1:], program)
    new.graph.lint()
    new.recompile()
    log.debug("step check folded into %s", point.where())
    return new


def _digest_node(g: fx.Graph, point: FoldPoint, by_name: dict[str, fx.Node]) -> fx.Node:
    """The node computing this rank's batch digest elements for ``point`` (.batch_digest),
    placed right after the placeholders it reads: it runs in Python, and there it runs
    before the program starts (under inductor a host node first, not a cut in the middle
    of the first compiled segment)."""
    tensors = [by_name[name] for _, name in point.digest]
    last = [n for n in g.nodes if n.op == "placeholder"][-1]
    with g.inserting_after(last):
        node = g.call_function(digest_elements, (tensors, point.kind, point.op, point.bits, point.dtype))
    node.meta["val"] = fake_call(aten.new_empty.default, (by_name[point.collective].args[0], [point.id_extra]), {"dtype": point.dtype})
    return node


def _fold_into(g: fx.Graph, point: FoldPoint, rest: tuple[FoldPoint, ...], program: int) -> None:
    nodes = list(g.nodes)
    by_name = {n.name: n for n in nodes}
    coll, wait = by_name[point.collective], by_name[point.wait]
    pos = {n: i for i, n in enumerate(nodes)}
    nxt = next((n for n in nodes[pos[coll] + 1:] if n.target is not WAIT and _is_effect(n)), None)
    anchor = wait.next if nxt is None or pos[wait] < pos[nxt] else nxt  # the check runs before the next effect
    payload = coll.args[0]
    width = point.numel + point.extra
    with g.inserting_before(coll):
        flat = new_node(g, aten.reshape.default, (payload, [-1]))
        ids = [new_node(g, aten.full.default, ([1], v), {"dtype": point.dtype, "device": torch.device("cpu")}) for v in point.encode(program)]
        if point.digest:  # this rank's batch digest (.batch_digest), computed on the placeholders each step
            ids.append(_digest_node(g, point, by_name))
        packed = new_node(g, aten.cat.default, ([flat, *ids],))
        folded = new_node(g, coll.target, (packed, *coll.args[1:]))
    folded.meta.update({k: v for k, v in coll.meta.items() if k not in ("val", "tensor_meta")})
    comm = coll.meta.get("spmd_comm")
    if comm is not None:
        folded.meta["spmd_comm"] = {**comm, "history": [*comm.get("history", []), f"carries the per-step check ({point.extra} element(s) more: the program id)"]}
    # collectives issued before the check and waited after it (a chain's earlier axes)
    before = nodes[: pos[anchor]]
    pending = tuple(n for n in before if n is not coll and getattr(n.target, "namespace", None) == "_c10d_functional"
                    and n.target is not WAIT and not any(u.target is WAIT and u in pos and pos[u] < pos[anchor] for u in n.users))
    with g.inserting_before(anchor):
        done = new_node(g, WAIT, (folded,))
        extra = (tuple(dataclasses.astuple(p) for p in rest), pending) if rest or pending else ()
        digest = {"digest": point.digest_check()} if point.digest else {}
        g.call_function(resync_if_flagged, (done, width, point.expected(program), *extra), digest)
        if point.kind == "all_reduce":
            part = new_node(g, aten.slice.Tensor, (done, 0, 0, point.numel))
            value = new_node(g, aten.view.default, (part, list(point.out_shape)))
        else:  # one row per rank: drop each row's id, then the gathered layout
            rows = new_node(g, aten.view.default, (done, [point.world_size, width]))
            part = new_node(g, aten.slice.Tensor, (rows, 1, 0, point.numel))
            value = new_node(g, aten.reshape.default, (part, list(point.out_shape)))
    wait.replace_all_uses_with(value)
    g.erase_node(wait)
    g.erase_node(coll)
