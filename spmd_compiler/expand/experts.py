"""Expert parallelism by placement: token rows travel to the ranks of their experts.

A plan that splits the stacked expert weights ``(experts, ...)`` along dim 0 over a mesh
axis on which the tokens are split too (its own ``ep`` axis, or the data axis as
torchtitan and DeepSpeed fold expert parallelism into data parallelism) gives each rank
``experts / n`` experts. Each rank routes its own tokens (:mod:`.orders`); where those
rows (sorted by expert, so the rows for each rank's experts are contiguous) meet the
experts' grouped matmul with split weights, they are sent to the ranks that hold their
experts (:func:`dispatch`), and the experts' results come back where anything else reads
them (:func:`combine`): two exchanges forward, two backward, every row once each way.

One :class:`Exchange` per sort and mesh axis holds what both directions need: how many
rows go to each rank (from the counts ``offs`` holds, swapped with one small
``all_to_all``), and where each received row goes in the experts' order. The rows
themselves move in ``spmd_compiler::all_to_all_rows`` (counts as tensors, a fixed number
of rows: ``n`` times the rank's own, the most a rank can receive, so no token is ever
dropped and every shape stays static; the rows past the received ones are zeros, which
no expert computes on, since their groups end where the counts do). With
``Plan(expert_capacity=...)`` the bound is smaller, and one all_reduce(max) of the
received counts tells every rank of the axis whether some rank would receive more: all of
them then stop at the same exchange (``ExpertCapacityError``), none waits for another.

The rank-local orders: a dispatched value's rows are ``Order(..., dispatched=axis)``;
pointwise ops, views, ``split``/``cat`` and the grouped matmuls keep them; anything else
reading one gets it combined first. A value is dispatched or combined once (memoized per
per-rank node), so a backward reusing forward rows reuses their exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import math

import torch
import torch.fx as fx

from .. import _private_torch as pt
from .builder import OutTensor, SubgraphBuilder
from .collectives import _collective
from .orders import ROWS, Order, Rows, rows_of
from .splice import splice_recipe
from .tree import leaves, tree_map
from .values import DValue

__all__ = ["Exchange", "route", "dispatch", "combine", "expert_weights"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# ops that keep dispatched rows dispatched (besides pointwise ops and views)
_KEEP = {aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default, aten.clone.default, aten._to_copy.default,
         aten.detach.default, aten.alias.default, aten.contiguous.default}
_VIEWS = {aten.transpose.int, aten.t.default, aten.permute.default, aten.view.default, aten._unsafe_view.default,
          aten.reshape.default, aten.expand.default}


@dataclass
class Exchange:
    """How one sort's rows travel over one mesh axis (nodes of the per-rank graph)."""

    axis: int
    order: Order
    rows: int           # this rank's routed rows (the sort's local length)
    bound: int          # rows a rank can receive: n * rows
    send: fx.Node       # (n,) rows to each rank
    recv: fx.Node       # (n,) rows from each rank
    dest: fx.Node       # (bound,) where each received row goes in the experts' order
    offs: DValue        # the local experts' cumulative counts over the received rows
    most: fx.Node | None = None  # () the most rows any rank of the axis receives (a capacity's bound only)


def _order(v: Any) -> Order | None:
    r = rows_of(v) if isinstance(v, DValue) else None
    return r.order if r is not None and r.order is not None and not r.order.canonical else None


def _splice(ex: Any, b: SubgraphBuilder, inputs: list[fx.Node], result: Any, origin: fx.Node | None, name: str) -> Any:
    recipe = b.finish(result)
    return splice_recipe(ex.graph, recipe, ex.coords, inputs, origin, [name])[0]


def _spec_like(ex: Any, v: DValue, rows_dim: int, local_rows: int, dtype: Any = None) -> Any:
    """``v``'s spec with ``local_rows`` rows per rank along ``rows_dim``."""
    scale = v.spec.shape[rows_dim] // v.local.shape[rows_dim] if v.local.shape[rows_dim] else 1
    shape = list(v.spec.shape)
    shape[rows_dim] = local_rows * scale
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return pt.make_spec(ex.mctx.mesh, list(v.spec.placements), tuple(shape), tuple(reversed(stride)), dtype or v.spec.tensor_meta.dtype)


def _exchange(ex: Any, order: Order, axis: int, offs: DValue, rows: int, experts: int, origin: fx.Node) -> Exchange:
    key = (order, axis)
    cache = ex.__dict__.setdefault("_ep_exchanges", {})
    if key in cache:
        return cache[key]
    n = ex.mctx.shape[axis]
    local_experts = experts // n
    capacity = getattr(ex, "expert_capacity", None)
    bound = n * rows if capacity is None else max(1, min(n * rows, math.ceil(capacity * rows)))
    b = SubgraphBuilder(ex.mctx, ex.fake_mode)
    o = b.input(offs.local, "offs")
    o64 = b.call(aten._to_copy.default, o, dtype=torch.int64)
    prev = b.call(aten.constant_pad_nd.default, b.call(aten.slice.Tensor, o64, 0, 0, -1), [1, 0], 0)
    counts = b.call(aten.sub.Tensor, o64, prev)  # (experts,) this rank's rows per expert
    send = b.call(aten.sum.dim_IntList, b.call(aten.view.default, counts, [n, local_experts]), [1])
    why = f"expert parallelism: each rank's routed rows per expert to the experts' ranks on '{ex.mctx.axis_names[axis]}'"
    got = _collective(b, c10d.all_to_all_single.default, "all_to_all", counts, axis, ([local_experts] * n, [local_experts] * n), why)
    grid = b.call(aten.view.default, got, [n, local_experts])  # [source, local expert]
    recv = b.call(aten.sum.dim_IntList, grid, [1])
    per_expert = b.call(aten.sum.dim_IntList, grid, [0])
    offs_d = b.call(aten.cumsum.default, per_expert, 0, dtype=torch.int32)
    # where each received row (source-major, then expert) goes in the experts' order
    seg_ends = b.call(aten.cumsum.default, got, 0)
    seg_starts = b.call(aten.sub.Tensor, seg_ends, got)
    p = b.call(aten.arange.default, bound, dtype=torch.int64, device=offs.local.device)
    seg = b.call(aten.searchsorted.Tensor, seg_ends, p, right=True)
    last = n * local_experts - 1
    segc = b.call(aten.clamp.default, seg, None, last)
    expert = b.call(aten.remainder.Scalar, segc, local_experts)
    within = b.call(aten.sub.Tensor, p, b.call(aten.index.Tensor, seg_starts, [segc]))
    expert_start = b.call(aten.sub.Tensor, b.call(aten.cumsum.default, per_expert, 0), per_expert)
    before = b.call(aten.sub.Tensor, b.call(aten.cumsum.default, grid, 0), grid)  # rows of earlier sources, per expert
    src_off = b.call(aten.view.default, b.call(aten.clone.default, before, memory_format=torch.contiguous_format), [n * local_experts])
    dest_valid = b.call(aten.add.Tensor, b.call(aten.add.Tensor, b.call(aten.index.Tensor, expert_start, [expert]),
                                                b.call(aten.index.Tensor, src_off, [segc])), within)
    valid = b.call(aten.le.Scalar, seg, last)
    dest = b.call(aten.where.self, valid, dest_valid, p)
    offs_spec = pt.make_spec(ex.mctx.mesh, list(offs.spec.placements), (local_experts,), (1,), torch.int32)
    result = [OutTensor(b.slot(send), _plain(ex, send)), OutTensor(b.slot(recv), _plain(ex, recv)), OutTensor(b.slot(dest), _plain(ex, dest)),
              OutTensor(b.slot(offs_d), offs_spec, None, Rows(restricted=order.axes, origins=rows_of(offs).origins))]
    if bound < n * rows:  # a capacity: every rank learns the most any rank receives, so all stop together if it is exceeded
        most = _collective(b, c10d.all_reduce.default, "all_reduce", b.call(aten.sum.default, recv), axis, ("max",),
                           f"expert parallelism: the most rows a rank's experts receive on '{ex.mctx.axis_names[axis]}' "
                           f"(Plan(expert_capacity={capacity}) checked on every rank)")
        result.append(OutTensor(b.slot(most), _plain(ex, most)))
    values = _splice(ex, b, [offs.node], result, origin, offs.node.name)
    plan = Exchange(axis, order, rows, bound, values[0].node, values[1].node, values[2].node, values[3],
                    values[4].node if len(values) > 4 else None)
    cache[key] = plan
    return plan


def _plain(ex: Any, node: fx.Node) -> Any:
    """A spec for a rank's own bookkeeping tensor (counts, positions): its local shape."""
    val = node.meta["val"]
    return pt.make_spec(ex.mctx.mesh, [pt.Replicate()] * ex.mctx.ndim, tuple(val.shape), tuple(val.stride()), val.dtype)


def _row_dim(v: DValue, axes: tuple[int, ...]) -> int:
    return v.spec.placements[axes[0]].dim


def dispatch(ex: Any, v: DValue, plan: Exchange, origin: fx.Node | None) -> DValue:
    """``v`` (rows in ``plan``'s sorted order) on the ranks of its rows' experts."""
    memo = ex.__dict__.setdefault("_ep_dispatched", {})
    if (v.node, plan.axis) in memo:
        return memo[(v.node, plan.axis)]
    d = _row_dim(v, plan.order.axes)
    b = SubgraphBuilder(ex.mctx, ex.fake_mode)
    x = b.input(v.local, v.node.name)
    send, recv, dest = (b.input(n.meta["val"], name) for n, name in ((plan.send, "send"), (plan.recv, "recv"), (plan.dest, "dest")))
    if d:
        x = b.call(aten.movedim.int, x, d, 0)
    x = b.call(aten.contiguous.default, x)
    most = b.input(plan.most.meta["val"], "most") if plan.most is not None else None
    y = _rows_exchange(b, x, send, recv, plan.bound, plan.axis, "expert parallelism: routed rows to their experts' ranks", ex, most)
    y = b.call(aten.index_copy.default, b.call(aten.zeros_like.default, y), 0, dest, y)
    if d:
        y = b.call(aten.movedim.int, y, 0, d)
    spec = _spec_like(ex, v, d, plan.bound)
    rows = Rows(order=Order(plan.order.axes, plan.order.key, plan.axis), origins=rows_of(v).origins)
    inputs = [v.node, plan.send, plan.recv, plan.dest] + ([plan.most] if plan.most is not None else [])
    out = _splice(ex, b, inputs, OutTensor(b.slot(y), spec, None, rows), origin, v.node.name)
    memo[(v.node, plan.axis)] = out
    return out


def combine(ex: Any, v: DValue, origin: fx.Node | None) -> DValue:
    """``v`` (dispatched rows) back on the ranks and in the order its rows were sorted in."""
    memo = ex.__dict__.setdefault("_ep_combined", {})
    if v.node in memo:
        return memo[v.node]
    order = _order(v)
    plan = ex._ep_exchanges[(Order(order.axes, order.key), order.dispatched)]
    d = _row_dim(v, order.axes)
    b = SubgraphBuilder(ex.mctx, ex.fake_mode)
    x = b.input(v.local, v.node.name)
    send, recv, dest = (b.input(n.meta["val"], name) for n, name in ((plan.send, "send"), (plan.recv, "recv"), (plan.dest, "dest")))
    if d:
        x = b.call(aten.movedim.int, x, d, 0)
    x = b.call(aten.index_select.default, x, 0, dest)  # back to source-major
    y = _rows_exchange(b, x, recv, send, plan.rows, plan.axis, "expert parallelism: the experts' results back to their tokens' ranks", ex)
    if d:
        y = b.call(aten.movedim.int, y, 0, d)
    spec = _spec_like(ex, v, d, plan.rows)
    rows = Rows(order=Order(order.axes, order.key), origins=rows_of(v).origins)
    out = _splice(ex, b, [v.node, plan.send, plan.recv, plan.dest], OutTensor(b.slot(y), spec, None, rows), origin, v.node.name)
    memo[v.node] = out
    return out


def _rows_exchange(b: SubgraphBuilder, x: fx.Node, send: fx.Node, recv: fx.Node, out_rows: int, axis: int, why: str, ex: Any,
                   most: fx.Node | None = None) -> fx.Node:
    val = x.meta["val"]
    row_bytes = val[0].numel() * val.element_size() if val.shape[0] else 0
    n = ex.mctx.shape[axis]
    meta = {"spmd_comm": {
        "kind": "all_to_all", "axis": axis, "axis_name": ex.mctx.axis_names[axis], "group_size": n, "reason": why,
        # data-dependent: the bytes of the rows this rank sends are at most its own rows (all of them elsewhere)
        "bytes": int(val.shape[0]) * row_bytes, "wire_bytes": int(val.shape[0]) * row_bytes, "bytes_bound": True,
        "dtype": str(val.dtype).replace("torch.", ""),
    }}
    extra = {"most": most} if most is not None else {}  # a keyword: the group stays the last argument, as in c10d's ops
    return b.call(pt.ALL_TO_ALL_ROWS, x, send, recv, out_rows, ex.mctx.group_names[axis], meta=meta, **extra)


def _dispatched_input(ex: Any, tnode: Any, plan: Exchange, origin: fx.Node) -> DValue:
    """The dispatched form of traced value ``tnode``: a view of a sorted value is the same
    view of its dispatched rows (one exchange for ``h`` and ``h.t()``)."""
    from .recipes import expand_node

    v = ex.env[tnode]
    if isinstance(tnode, fx.Node) and tnode.op == "call_function" and tnode.target in _VIEWS:
        base = tnode.args[0]
        if isinstance(base, fx.Node) and _order(ex.env.get(base)) == plan.order:
            moved = _dispatched_input(ex, base, plan, origin)
            args, kwargs = tree_map(lambda a: moved if a is base else (ex.env[a] if isinstance(a, fx.Node) else a), (tnode.args, tnode.kwargs))
            return expand_node(ex, tnode, tnode.target, args, kwargs)
    return dispatch(ex, v, plan, origin)


def route(ex: Any, node: fx.Node, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of traced ``node`` with rows moved for expert parallelism: dispatched
    where the experts' grouped matmul meets split expert weights (or dispatched rows), and
    dispatched rows combined where anything else reads them together with other rows."""
    values = [a for a in leaves((args, kwargs)) if isinstance(a, DValue)]
    if not any(_order(v) is not None for v in values):
        return args, kwargs
    if op is pt.GROUPED_MM:
        return _grouped_mm_args(ex, node, args, kwargs)
    dispatched = [v for v in values if _order(v) is not None and _order(v).dispatched is not None]
    if not dispatched:
        return args, kwargs
    others = [v for v in values if _order(v) is None or _order(v).dispatched is None]
    token_axes = _order(dispatched[0]).axes
    mixed = any(any(v.spec.placements[a].is_shard() for a in token_axes) for v in others)
    keeps = torch.Tag.pointwise in getattr(op, "tags", ()) or op in _KEEP or op in _VIEWS
    if keeps and not mixed:
        return args, kwargs
    return tree_map(lambda a: combine(ex, a, node) if isinstance(a, DValue) and a in dispatched else a, (args, kwargs))


def _grouped_mm_args(ex: Any, node: fx.Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    a, w, offs = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("offs")
    if not isinstance(offs, DValue) or not isinstance(w, DValue) or rows_of(offs) is None:
        return args, kwargs
    if len(w.spec.shape) == 3:  # forward: rows x stacked experts
        order = _order(a)
        if order is None:
            return args, kwargs
        if order.dispatched is not None:  # rows already at their experts (h after the first matmul)
            plan = ex._ep_exchanges[(Order(order.axes, order.key), order.dispatched)]
            return (a, w, plan.offs, *args[3:]), kwargs
        axes = [e for e in order.axes if w.spec.placements[e] == pt.Shard(0)]
        if len(axes) != 1 or w.spec.shape[0] % ex.mctx.shape[axes[0]]:
            return args, kwargs
        plan = _exchange(ex, order, axes[0], offs, a.local.shape[0], w.spec.shape[0], node)
        return (_dispatched_input(ex, node.args[0], plan, node), w, plan.offs, *args[3:]), kwargs
    orders = [_order(a), _order(w)]  # weight gradient: (m, rows) x (rows, n)
    dispatched = [o for o in orders if o is not None and o.dispatched is not None]
    if not dispatched:
        return args, kwargs
    plan = ex._ep_exchanges[(Order(dispatched[0].axes, dispatched[0].key), dispatched[0].dispatched)]
    new = [a, w]
    for i, o in enumerate(orders):
        if o is not None and o.dispatched is None:
            new[i] = _dispatched_input(ex, node.args[i], plan, node)
    return (new[0], new[1], plan.offs, *args[3:]), kwargs


_PASS_THROUGH = _VIEWS | {aten._to_copy.default, aten.clone.default, aten.detach.default, aten.alias.default, aten.contiguous.default}


def expert_weights(graph: fx.Graph) -> set[fx.Node]:
    """The placeholders the experts' grouped matmuls read as stacked expert weights (their
    3-D ``mat_b``, through views and dtype casts)."""
    out = set()
    for n in graph.find_nodes(op="call_function", target=pt.GROUPED_MM):
        w = n.args[1] if len(n.args) > 1 else n.kwargs.get("mat_b")
        if not isinstance(w, fx.Node) or len(getattr(w.meta.get("val"), "shape", ())) != 3:
            continue
        while w.op == "call_function" and w.target in _PASS_THROUGH and isinstance(w.args[0], fx.Node):
            w = w.args[0]
        if w.op == "placeholder":
            out.add(w)
    return out
