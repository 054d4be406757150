"""Divide the gradients by a mean's count after their reduction, not before.

A mean cross entropy over a batch-sharded tensor divides by the global target count
``C`` (:mod:`.mean_reductions` reduces it with the local loss sum as one ``[u, c]``
all_reduce, the *pair*). Backward needs ``C`` at once: the seed is scaled by ``1/C``
(``nll_loss_backward``'s ``total_weight``, or the backward of ``u / C``), so the pair
cannot ride in a gradient bucket and a DP step makes one launch more than it has buckets.

Backward is linear in its seed, so a gradient that comes only from this loss is
``G_local / C``, ``G_local`` being the gradient computed with ``C`` replaced by 1. This
pass (1) replaces ``C`` by 1 where it enters the backward (``nll_loss_backward``'s
``total_weight``, mean reduction, no class weights), (2) divides every reduced gradient by
``C`` (by 1 where ``C = 0``: every target ignored, every gradient exactly 0 on one device
too) right after its reduction's wait, before any other use (clipping, the
optimizer), and (3) moves the pair's readers down to their first use, so that
:mod:`.bucketing` lets the pair ride in the first gradient bucket: launches = buckets.
Under FSDP the reductions are reduce_scatters: each rank divides its reduced shard (an
uneven shard's zero padding too: ``0 / C = 0``), and the pair rides in the first
reduce_scatter bucket, each rank's value in its own slot of every row (:mod:`.bucketing`: each
rank receives every rank's value and sums them in rank order, the same bits on every rank).
Exact in real arithmetic (``sum_r G_r / C = sum_r (G_r / C)``); float64 results equal one
device's at 1e-12 (``tests/test_optimize_deferred_divisor.py``, ``_fsdp.py``).

It applies only where a conservative *scale analysis* proves every reduced gradient
proportional to ``1/C``: the value where ``1/C`` enters is *scaled*; an op reading a
scaled value must be in :data:`LINEAR` (keyed by aten op: views, sums, ``mm``/``bmm`` with
one scaled operand, ``add`` of two scaled values, the ``*_backward`` ops linear in
``grad_output``, the functional collectives that sum or gather one scaled value and their
waits...) and its rule must accept the arguments, and a scaled value may reach
nothing else than those ops and the gradient reductions. Otherwise the program is left
as it is, with one DEBUG log naming the reason: an op outside the registry or that mixes
a scaled and an unscaled value (``ce + 0.01 * (w**2).sum()``), a scaled value reaching
the output or an in-place write (gradients kept across calls: ``defer_grad_sync``, grad
accumulation), a gradient reduction that is not scaled or not a plain all_reduce or
reduce_scatter of the pair's group in the optimizer phase (kept gradients), not exactly
one entry of ``C`` (two losses or backward passes; class weights or ``u / C``'s backward,
where ``C = 0`` makes one device's gradients inf/NaN), a backward value computed from the
pair, no or several pairs, pipeline stages, and a scaled value
in float16 (float16 autocast: a weight gradient ``C`` times larger than one device's, summed
over many targets, could pass float16's 65504; bfloat16 and float32 have the range).
The argument holds for any sizes: symbolic (``dynamic=True``) and uneven per-rank programs
(an uneven batch, uneven FSDP shards and their zero padding: ``0 / C = 0``) are rewritten
too. Every rank must decide the same: the pass reads no size that differs per rank, and
compares symbolic sizes by their expressions, never asking the shape environment (which
would add a guard) (:func:`_same_meta`).

The collective rules are what dp x tp needs: a tensor-parallel backward all_reduces
activation gradients over ``tp``, values proportional to ``1/C`` there. ``C`` is the same
on every rank of the mesh, not only of the pair's group: ``nll_loss_backward`` reads it
directly as its ``total_weight``, which the expansion hands it replicated on every mesh
axis (a count partial over ``tp`` too would reach it through a second reduction or a
second pair, which the checks below refuse). So on any group
``sum_r G_r / C = (sum_r G_r) / C``: a ``sum`` all_reduce or reduce_scatter, or a gather,
of exactly one scaled input is scaled (``max``/``min`` are not linear: refused); float64
GPT on a 2 x 2 mesh equals one device at 1e-12 (``tests/test_optimize_deferred_divisor_2d.py``).
The gradient reductions themselves are not ruled by the registry: they are checked apart.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..expand.splice import RANK_SIZES
from ..trace.markers import MARKER
from .bucketing import gradient_reductions
from .graph_utils import is_collective, is_pure, is_wait, move_before, new_node, positions

__all__ = ["defer_mean_divisor_pass", "LINEAR"]

log = logging.getLogger(__name__)

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

Rule = Callable[[fx.Node, Callable[[Any], bool]], bool]


def _first_only(node: fx.Node, scaled: Callable[[Any], bool]) -> bool:
    """Linear in the first argument; no other argument scaled."""
    return scaled(node.args[0]) and not any(scaled(a) for a in node.all_input_nodes if a is not node.args[0])


def _one_of_two(node: fx.Node, scaled: Callable[[Any], bool]) -> bool:
    """Bilinear (``mul``, ``mm``, ``bmm``): exactly one operand scaled, no other argument."""
    a, b = node.args[:2]
    return (scaled(a) != scaled(b)) and not any(scaled(x) for x in node.all_input_nodes if x is not a and x is not b)


def _both_scaled(node: fx.Node, scaled: Callable[[Any], bool]) -> bool:
    """A sum (``add``, ``sub``): both operands scaled, a plain number as ``alpha``."""
    a, b = node.args[:2]
    alpha = node.kwargs.get("alpha", 1)
    return scaled(a) and scaled(b) and isinstance(alpha, (int, float)) and len(node.args) == 2


def _divided(node: fx.Node, scaled: Callable[[Any], bool]) -> bool:
    """``div(scaled, unscaled)`` without rounding mode."""
    return scaled(node.args[0]) and not scaled(node.args[1]) and node.kwargs.get("rounding_mode") is None


def _zero_fill(node: fx.Node, scaled: Callable[[Any], bool]) -> bool:
    """``masked_fill(scaled, mask, 0)``."""
    return _first_only(node, scaled) and node.args[2] == 0


def _zero_pad(node: fx.Node, scaled: Callable[[Any], bool]) -> bool:
    """``constant_pad_nd(scaled, pad, 0)``: an uneven shard's padding before a reduce_scatter."""
    return _first_only(node, scaled) and (node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)) == 0


def _where(node: fx.Node, scaled: Callable[[Any], bool]) -> bool:
    """``where(cond, a, b)``: each branch scaled or the number 0, the condition not scaled."""
    cond, a, b = node.args[:3]
    return not scaled(cond) and all(scaled(x) or (not isinstance(x, fx.Node) and x == 0) for x in (a, b))


def _all_listed(node: fx.Node, scaled: Callable[[Any], bool]) -> bool:
    """``cat``/``stack``: every tensor scaled."""
    return all(scaled(x) for x in node.args[0])


def _addmm(node: fx.Node, scaled: Callable[[Any], bool]) -> bool:
    """``addmm(bias, a, b)``: the bias and exactly one factor scaled, numbers as beta/alpha."""
    bias, a, b = node.args[:3]
    return (scaled(bias) and scaled(a) != scaled(b)
            and all(isinstance(node.kwargs.get(k, 1), (int, float)) for k in ("beta", "alpha")))


def _summed(node: fx.Node, scaled: Callable[[Any], bool]) -> bool:
    """A functional ``all_reduce``/``reduce_scatter_tensor`` of the scaled value with
    ``sum``: ``C`` is the same on every rank of the mesh (the replicated global count the
    expansion hands ``nll_loss_backward``), so ``sum_r G_r / C = (sum_r G_r) / C``."""
    return _first_only(node, scaled) and node.args[1] == "sum"


# views, casts, sums and scalings: linear in their one tensor argument
_UNARY_LINEAR = [
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
    aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
    aten.clone.default, aten.contiguous.default, aten.detach.default, aten.alias.default, aten._to_copy.default,
    aten.neg.default, aten.sum.default, aten.sum.dim_IntList, aten.mean.dim, aten.mul.Scalar, aten.div.Scalar,
]
# aten *_backward ops, linear in their first argument (grad_output) given the saved forward values
_BACKWARDS = [
    aten._log_softmax_backward_data.default, aten._softmax_backward_data.default, aten.gelu_backward.default,
    aten.native_layer_norm_backward.default, aten.embedding_dense_backward.default, aten.threshold_backward.default,
    aten.native_dropout_backward.default, aten.silu_backward.default, aten.tanh_backward.default,
    aten.sigmoid_backward.default,
]
LINEAR: dict[Any, Rule] = {
    **{op: _first_only for op in _UNARY_LINEAR + _BACKWARDS},
    operator.getitem: _first_only,  # an output of a multi-output op above (native_layer_norm_backward)
    aten.mul.Tensor: _one_of_two, aten.mm.default: _one_of_two, aten.bmm.default: _one_of_two,
    aten.add.Tensor: _both_scaled, aten.sub.Tensor: _both_scaled,
    aten.div.Tensor: _divided, aten.masked_fill.Scalar: _zero_fill, aten.where.self: _where,
    aten.constant_pad_nd.default: _zero_pad, aten.movedim.int: _first_only,  # a reduce_scatter's padding and layout
    aten.cat.default: _all_listed, aten.stack.default: _all_listed, aten.addmm.default: _addmm,
    # functional collectives other than the gradient reductions (checked apart, see _plan):
    # a tensor-parallel backward's activation all_reduce, a gather; rows of one value, or its sum
    _c10d.all_reduce.default: _summed, _c10d.reduce_scatter_tensor.default: _summed,
    _c10d.all_gather_into_tensor.default: _first_only, _c10d.wait_tensor.default: _first_only,
}
"""Ops that propagate the scale ``1/C`` (aten op -> rule: given the node and which values
are scaled, whether the result is scaled). An op reading a scaled value outside this
registry, or whose rule says no, makes the pass refuse."""

_SHAPE_ONLY = {aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default}  # read no value
_NLL_BACKWARD = {aten.nll_loss_backward.default, aten.nll_loss2d_backward.default}
# a gradient's reduction: all_reduce (replicated parameters) or reduce_scatter (FSDP: the
# reduced shard, padding included, is the sum's shard, so dividing it is dividing the sum)
_REDUCTIONS = ("all_reduce", "reduce_scatter")


class _Refuse(Exception):
    pass


def _pair(gm: fx.GraphModule) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node]:
    """``(pair collective, its wait, the reduced count C, the local count c)``."""
    pairs = [n for n in gm.graph.nodes if is_collective(n) and n.meta["spmd_comm"].get("op") == "mean_pair"]
    if len(pairs) != 1:
        raise _Refuse(f"{len(pairs)} mean pairs (one loss's count and value) in the program, expected 1")
    (pair,) = pairs
    waits = list(pair.users)
    buf = pair.args[0]
    if len(waits) != 1 or not is_wait(waits[0]) or buf.target is not aten.cat.default or len(buf.args[0]) != 2:
        raise _Refuse(f"{pair.name} is not the pair fuse_mean_reductions makes")
    wait = waits[0]
    u_flat, c_flat = buf.args[0]
    nu = int(u_flat.meta["val"].numel())
    counts = [s for s in wait.users if s.target is aten.slice.Tensor and tuple(s.args[1:]) == (0, nu, nu + int(c_flat.meta["val"].numel()))]
    if len(counts) != 1 or len(counts[0].users) != 1:
        raise _Refuse(f"{pair.name}'s count slot is not read as one value")
    (count,) = counts[0].users
    c_local = c_flat.args[0]
    if count.target is not aten.view.default or count.meta["val"].shape != c_local.meta["val"].shape:
        raise _Refuse(f"{pair.name}'s count slot is not read as one value")
    return pair, wait, count, c_local


def _check_not_pipelined(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        if n.target is MARKER:
            raise _Refuse("the program is split into pipeline stages")


def _plan(gm: fx.GraphModule) -> dict[str, Any]:
    """What to rewrite, or :class:`_Refuse` with the reason (see the module docstring)."""
    _check_not_pipelined(gm)
    pair, wait, count, c_local = _pair(gm)
    reductions = _after_other_reductions(gradient_reductions(gm))
    if not reductions:
        raise _Refuse("the program reduces no gradient")
    for r in reductions:
        c = r.meta["spmd_comm"]
        if c["kind"] not in _REDUCTIONS or c.get("op") == "bucket" or r.meta.get("spmd_phase") != "optimizer":
            raise _Refuse(f"gradient reduction {r.name} is not a standalone all_reduce or reduce_scatter of the optimizer phase ({c['kind']}, "
                          f"phase {r.meta.get('spmd_phase')})")
        if r.args[-1] != pair.args[-1] or c.get("group_size") != pair.meta["spmd_comm"].get("group_size"):
            raise _Refuse(f"gradient reduction {r.name} reduces over another group than {pair.name}")
        if len(r.users) != 1 or not is_wait(next(iter(r.users))):
            raise _Refuse(f"gradient reduction {r.name} has no single wait")
    reduced = set(reductions)
    reduced_waits = {next(iter(r.users)) for r in reductions}
    # nll_loss_backward without class weights, mean reduction: where every target is
    # ignored (C = 0) its gradient is exactly 0 for any total_weight, so dividing by 1 there
    # keeps it. (With class weights, or the backward of u / C, C = 0 gives inf/NaN on one
    # device that no division after the reduction reproduces exactly: refused.)
    entries = [u for u in count.users if u.target in _NLL_BACKWARD and len(u.args) == 7 and u.args[3] is None and u.args[4] == 1
               and u.args[6] is count and count not in u.args[:6]]
    if len(entries) != 1:
        raise _Refuse(f"{len(entries)} places where the count enters the backward ({[e.name for e in entries]}), expected 1")
    (entry,) = entries
    descends: set[fx.Node] = {wait}  # computed from the pair in the rewritten program
    scaled: set[fx.Node] = set()
    rewires: dict[fx.Node, fx.Node] = {}

    def is_scaled(x: Any) -> bool:
        return isinstance(x, fx.Node) and x in scaled

    def add_scaled(n: fx.Node) -> None:
        vals = n.meta.get("val")
        if any(isinstance(v, torch.Tensor) and v.dtype == torch.float16 for v in (vals if isinstance(vals, (list, tuple)) else [vals])):
            # C times larger than on one device: a weight gradient summed over many targets
            # can pass float16's 65504 (fp16 autocast); bfloat16 and float32 have the range
            raise _Refuse(f"{n.name} would hold a float16 value count times larger than on one device (overflow risk)")
        scaled.add(n)

    for n in gm.graph.nodes:
        if n is wait or n.op in ("placeholder", "get_attr"):
            continue
        inputs = [a for a in n.all_input_nodes if not (n is entry and a is count)]
        if n.target in _SHAPE_ONLY and n.args[0] in descends:
            x = n.args[0]
            src = _shape_source(x, descends | scaled)
            if src is None:
                raise _Refuse(f"{n.name} takes its shape from {x.name}, which is computed from the pair")
            rewires[n] = src
            inputs = [src]
        if any(a in descends for a in inputs):
            descends.add(n)
        if n.op == "output":
            if any(is_scaled(a) for a in inputs):
                raise _Refuse("a value proportional to 1/count reaches the step's output (gradients kept for the next call?)")
            continue
        if n is entry:
            if any(is_scaled(a) for a in inputs):
                raise _Refuse(f"{n.name} reads a scaled value")
            add_scaled(n)
        elif n in reduced:
            if not is_scaled(n.args[0]):
                raise _Refuse(f"gradient reduction {n.name} reduces a value not proportional to 1/count (another loss?)")
            if n in descends:
                raise _Refuse(f"gradient reduction {n.name} reduces a value computed from the pair")
        elif n in reduced_waits or n.target in _SHAPE_ONLY or not any(is_scaled(a) for a in inputs):
            pass
        else:
            rule = LINEAR.get(n.target)
            if rule is None:
                raise _Refuse(f"{n.name} ({n.target}) reads a value proportional to 1/count and is not known to be linear in it")
            if not rule(n, is_scaled):
                raise _Refuse(f"{n.name} ({n.target}) mixes a value proportional to 1/count with one that is not")
            add_scaled(n)
    return {"pair": pair, "wait": wait, "count": count, "c_local": c_local, "entry": entry, "rewires": rewires,
            "reductions": reductions}


def _after_other_reductions(reductions: list[fx.Node]) -> list[fx.Node]:
    """``reductions`` without those that reduce a value computed from another one's result
    (FSDP's ``clip_grad_norm_``: the shards' squared norms, summed in the optimizer phase):
    not a gradient; what it reads is the divided gradients, the original program's values."""
    waits = [u for r in reductions for u in r.users if is_wait(u)]
    after: set[fx.Node] = set()
    stack = list(waits)
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in after:
                after.add(u)
                stack.append(u)
    return [r for r in reductions if r not in after]


def _shape_source(x: fx.Node, avoid: set[fx.Node]) -> fx.Node | None:
    """A node outside ``avoid`` that ``x`` is computed from, of ``x``'s shape, dtype and
    device (what ``ones_like(x)`` reads of ``x``), nearest first."""
    stack, seen = [x], set()
    while stack:
        n = stack.pop(0)
        for a in n.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if a not in avoid and _same_meta(a, x):
                return a
            if a in avoid:
                stack.append(a)
    return None


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    if RANK_SIZES in a.meta or RANK_SIZES in b.meta:  # its size differs per rank: ranks would decide differently
        return False
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and _same_sizes(va.shape, vb.shape)
            and va.dtype == vb.dtype and va.device == vb.device)


def _same_sizes(a: Any, b: Any) -> bool:
    """Equal sizes, a symbolic one equal by its expression (no guard on the shape environment)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif isinstance(x, int) or isinstance(y, int) or pt.sym_expr(x) != pt.sym_expr(y):
            return False
    return True


def _rewrite(gm: fx.GraphModule, plan: dict[str, Any]) -> None:
    g = gm.graph
    count, c_local, wait = plan["count"], plan["c_local"], plan["wait"]
    origin = {"node": plan["pair"].name, "op": "defer_mean_divisor", "source": None}
    with g.inserting_after(c_local):
        one = new_node(g, aten.ones_like.default, (c_local,), None, {"spmd_phase": c_local.meta.get("spmd_phase"), "spmd_origin": origin})
    plan["entry"].replace_input_with(count, one)
    for node, src in plan["rewires"].items():
        node.replace_input_with(node.args[0], src)
    # C (a count of targets: an integer), or 1 where every target is ignored (the gradients are 0 then)
    with g.inserting_after(count):
        divisor = new_node(g, aten.clamp_min.default, (count, 1), None, {"spmd_phase": count.meta.get("spmd_phase"), "spmd_origin": origin})
    divisions = set()
    for r in plan["reductions"]:
        r_wait = next(iter(r.users))
        with g.inserting_after(r_wait):
            d = new_node(g, aten.div.Tensor, (r_wait, divisor), None, {"spmd_phase": r_wait.meta.get("spmd_phase"), "spmd_origin": origin})
        if RANK_SIZES in r_wait.meta:  # an uneven shard's reduce_scatter (padding and all: 0 / C = 0)
            d.meta[RANK_SIZES] = True
        r_wait.replace_all_uses_with(d, delete_user_cb=lambda u: u is not d)
        divisions.add(d)
    g.eliminate_dead_code()
    # the pair's readers move down to their first use, so the pair can ride in a gradient bucket
    pos = positions(gm)
    later: set[fx.Node] = {wait}  # computed from the pair, not through a division (the optimizer stays where it is)
    for n in g.nodes:
        if n is not wait and n not in divisions and any(a in later for a in n.all_input_nodes):
            later.add(n)
    for n in reversed(list(g.nodes)):
        if n in later and n is not wait and is_pure(n) and n.users:
            first = min(n.users, key=lambda u: pos[u])
            if pos[first] > pos[n] and first.prev is not n:
                move_before(n, first, pos)
    comm = plan["pair"].meta["spmd_comm"]
    comm.setdefault("history", []).append("the backward computes gradients for count 1; each reduced gradient is divided by the count "
                                          "after its wait (defer_mean_divisor), so the pair can ride in a gradient bucket")


def defer_mean_divisor_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Compute the backward with a mean's count replaced by 1 and divide the reduced
    gradients by the count, so the count can ride in a gradient bucket; only where every
    reduced gradient is proven proportional to 1/count (see the module docstring)."""
    try:
        plan = _plan(gm)
    except _Refuse as e:
        log.debug("defer_mean_divisor: program left as it is: %s", e)
        return gm
    _rewrite(gm, plan)
    log.debug("defer_mean_divisor: %d gradient reductions divided by %s after their wait", len(plan["reductions"]), plan["count"].name)
    return gm
