"""One all_reduce for a mean's count and its value.

A mean over a batch-sharded tensor whose element count depends on the data (cross
entropy with ``ignore_index``, :mod:`spmd_compiler.expand.rules.losses`) reduces twice:
the count (``C = all_reduce_sum(c)``: the backward's gradient scale ``1/C`` needs it)
and then the value, ``y = all_reduce_sum(g(u / C))`` with ``u`` this rank's sum and
``g`` a chain of scalings (``/ window`` of gradient accumulation, a negation, views).
The second reads the first's result, so bucketing cannot merge them. The value could ride
in a gradient bucket (:mod:`.bucketing`), but where no bucket is issued (calls that
accumulate under ``Plan(defer_grad_sync=True)``, evaluation steps) it is a launch of its own.

This pass sends both in one all_reduce: ``pair = all_reduce_sum(cat([u, c]))``, then
``C = pair[1]`` and ``y = g(pair[0] / C)``. Exact in real arithmetic, since ``C`` is the
same on every rank and ``g`` is linear: ``sum_r g(u_r / C) = g(sum_r u_r / C)``. The
float rounding differs: one division of the summed numerator instead of a sum of
per-rank quotients, which is the single device's order (its loss is ``sum / count``), so
float64 results stay equal to one device's at 1e-12 (``tests/test_optimize_mean_reductions.py``).

Where every gradient is provably proportional to ``1/C`` (plain DP),
:mod:`.deferred_divisor` then moves the backward's division by ``C`` after the gradient
reductions, and the pair rides in the first gradient bucket.

It runs before :mod:`.bucketing`, in every program, also where the value would ride in a
gradient bucket: the launches are the same there (the pair instead of the count), and
every program of a gradient accumulation window (calls that accumulate, the call that
steps) then starts with the same collective, the pair, which the per-step check rides on
(:mod:`spmd_compiler.driver.fold`): a switch between them exchanges nothing (with the
pair only where no bucket is issued, the stepping call's first collective, the count
alone, differs, and each window paid 2 standalone checks). The cost: the pair is issued
where both operands exist, after the local loss sum at the end of the forward, and the
backward's scale waits for it there, where the count alone was issued at the start of
the step and overlapped the forward (one small all_reduce's latency per step). Skipped,
leaving the program as it was, when: the reduce ops, groups, group sizes or dtypes differ
(or are not floating), ``u`` depends on ``C``, a reader of ``C`` runs before ``u``
exists, either operand is ever written in place, sizes are symbolic or per rank (uneven
shards), or the program is split into pipeline stages.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ..expand.splice import RANK_SIZES
from ..trace.markers import MARKER
from .graph_utils import WAIT, alias_root, fused_comm, is_collective, is_wait, new_node, positions, written_roots

__all__ = ["fuse_mean_reductions_pass"]

log = logging.getLogger(__name__)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# ops g may be made of: linear in their first argument when the rest are Python numbers
_SCALINGS = {aten.div.Tensor, aten.mul.Tensor, aten.div.Scalar, aten.mul.Scalar, operator.truediv, operator.mul}
_UNARY = {aten.neg.default, aten.view.default, aten.reshape.default, aten.clone.default, aten.contiguous.default,
          aten.alias.default, aten.detach.default}


def _only_wait(n: fx.Node) -> fx.Node | None:
    waits = [u for u in n.users if is_wait(u)]
    return waits[0] if len(waits) == 1 and len(n.users) == 1 else None


def _plain_sum(n: fx.Node) -> bool:
    """A standalone (not bucketed) all_reduce sum with a static-size payload."""
    if not (is_collective(n) and n.target is c10d.all_reduce.default and n.args[1] == "sum"):
        return False
    comm = n.meta.get("spmd_comm", {})
    val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    return (comm.get("op") not in ("bucket", "mean_pair") and RANK_SIZES not in n.meta and isinstance(val, torch.Tensor)
            and all(isinstance(d, int) for d in val.shape))


def _scaling_chain(v: Any) -> tuple[list[fx.Node], fx.Node] | None:
    """``v = g(d)`` with ``d = div(u, C_wait)``: the chain ``g`` (nearest ``d`` first) and
    ``d``; None unless every step of ``g`` is linear (scaling by a Python number, a view)."""
    chain: list[fx.Node] = []
    while isinstance(v, fx.Node) and v.op == "call_function" and RANK_SIZES not in v.meta:
        if v.target is aten.div.Tensor and isinstance(v.args[1], fx.Node) and is_wait(v.args[1]):
            return list(reversed(chain)), v
        if not (v.args and isinstance(v.args[0], fx.Node) and v.all_input_nodes == [v.args[0]] and not v.kwargs):
            return None  # reads another node (a symbolic size, a tensor): not a scaling by a constant
        if not (v.target in _UNARY or (v.target in _SCALINGS and len(v.args) == 2 and isinstance(v.args[1], (int, float)))):
            return None
        chain.append(v)
        v = v.args[0]
    return None


def _depends_on(x: fx.Node, target: fx.Node, pos: dict[fx.Node, float]) -> bool:
    """Whether ``x`` is computed from ``target`` (only nodes after ``target`` can be)."""
    stack, seen = [x], set()
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if n in seen or pos[n] < pos[target]:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _match(y: fx.Node, pos: dict[fx.Node, float], written: set[fx.Node]) -> tuple | None:
    """``(y_wait, chain, d, u, count collective, count wait)`` for a value all_reduce ``y``
    of the pattern, or None (the reason logged at DEBUG)."""
    y_wait = _only_wait(y)
    found = _scaling_chain(y.args[0])
    if y_wait is None or found is None:
        return None
    chain, d = found
    u, c_wait = d.args
    c = c_wait.args[0]
    if not (isinstance(u, fx.Node) and isinstance(c, fx.Node) and _plain_sum(c) and _only_wait(c) is c_wait):
        return None
    why = None
    cu, cc = y.meta["spmd_comm"], c.meta["spmd_comm"]
    uv, cv = u.meta.get("val"), c.args[0].meta.get("val")
    if c.args[-1] != y.args[-1] or cu.get("group_size") != cc.get("group_size"):
        why = "they reduce over different groups"
    elif (not isinstance(uv, torch.Tensor) or not all(isinstance(s, int) for s in uv.shape)
          or RANK_SIZES in u.meta or RANK_SIZES in c.args[0].meta):
        why = f"{u.name}'s size is symbolic or differs per rank"
    elif not (uv.dtype == cv.dtype == y_wait.meta["val"].dtype) or not uv.dtype.is_floating_point:
        why = f"the value ({uv.dtype}), its reduced form ({y_wait.meta['val'].dtype}) and the count ({cv.dtype}) differ in dtype"
    elif alias_root(u) in written or alias_root(c.args[0]) in written:
        why = "an operand is written in place"
    elif _depends_on(u, c_wait, pos):
        why = f"{u.name} is computed from the count"
    else:
        anchor = max(u, c.args[0], key=lambda n: pos[n])
        early = [r.name for r in c_wait.users if pos[r] <= pos[anchor]]
        if early:
            why = f"{early} read the count before {u.name} exists"
    if why is not None:
        log.debug("%s and %s not fused: %s", c.name, y.name, why)
        return None
    return y_wait, chain, d, u, c, c_wait


def _fuse(gm: fx.GraphModule, y: fx.Node, match: tuple, pos: dict[fx.Node, float]) -> None:
    y_wait, chain, d, u, c, c_wait = match
    g = gm.graph
    c_local = c.args[0]
    anchor = max(u, c_local, key=lambda n: pos[n])
    phase = u.meta.get("spmd_phase")
    meta = {"spmd_phase": phase, "spmd_origin": {"node": f"{c.name} + {y.name}", "op": "fuse_mean_reductions", "source": None}}
    nu, nc = int(u.meta["val"].numel()), int(c_local.meta["val"].numel())
    comm = fused_comm([y, c], reason="a mean's value and its count in one all_reduce", label="pair", what="all_reduces")
    comm["op"] = "mean_pair"
    comm["history"].append("the value is reduced before its division by the count (the single device's order)")
    nodes: list[fx.Node] = []
    lo, hi = pos[anchor], pos.get(anchor.next, pos[anchor] + 1.0)

    def add(target: Any, args: tuple, extra: dict | None = None) -> fx.Node:
        with g.inserting_after(nodes[-1] if nodes else anchor):
            node = new_node(g, target, args, None, {**meta, **(extra or {})})
        nodes.append(node)
        pos[node] = lo + (hi - lo) * (1.0 - 0.5 ** len(nodes))  # between the anchor and its old next node
        return node

    keep = ("spmd_phase",)
    buf = add(aten.cat.default, ([add(aten.reshape.default, (u, [-1])), add(aten.reshape.default, (c_local, [-1]))],))
    coll = add(c10d.all_reduce.default, (buf, "sum", y.args[-1]), {"spmd_comm": comm})
    done = add(WAIT, (coll,), {"spmd_wait": True})
    total = add(aten.view.default, (add(aten.slice.Tensor, (done, 0, 0, nu)), list(u.meta["val"].shape)))
    count = add(aten.view.default, (add(aten.slice.Tensor, (done, 0, nu, nu + nc)), list(c_wait.meta["val"].shape)))
    value = add(d.target, (total, count), {k: d.meta[k] for k in keep if k in d.meta})
    for step in chain:
        value = add(step.target, (value, *step.args[1:]), {k: step.meta[k] for k in keep if k in step.meta})
    assert value.meta["val"].shape == y_wait.meta["val"].shape and value.meta["val"].dtype == y_wait.meta["val"].dtype, value
    y_wait.replace_all_uses_with(value)
    c_wait.replace_all_uses_with(count)
    for n in (y_wait, y, c_wait, c):
        g.erase_node(n)
    log.debug("fused the count all_reduce and the value all_reduce into %s", coll.name)


def fuse_mean_reductions_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Merge ``C = all_reduce_sum(c)`` and ``y = all_reduce_sum(g(u / C))`` (``g`` a
    scaling) into one all_reduce of ``[u, c]`` (see the module docstring)."""
    if any(n.target is MARKER for n in gm.graph.nodes):
        return gm  # pipeline stages: a collective does not move across a stage boundary
    pos = positions(gm)
    written = written_roots(gm)
    for y in [n for n in gm.graph.nodes if _plain_sum(n)]:
        if y.graph is not gm.graph or getattr(y, "_erased", False):
            continue
        match = _match(y, pos, written)
        if match is not None:
            _fuse(gm, y, match, pos)
    gm.graph.eliminate_dead_code()
    return gm
