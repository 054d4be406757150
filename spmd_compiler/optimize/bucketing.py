"""Bucketing gradient reductions.

Every gradient is reduced (all_reduce for replicated parameters, reduce_scatter for
sharded ones) by its own collective where the optimizer first reads it. Many small
collectives cost a latency each; DDP and FSDP fuse them into flat buckets. This pass
moves each gradient reduction to right after its gradient is computed (backward order),
then fuses consecutive ones with the same group, reduce op and dtype into buckets of
about ``bucket_mb`` MB: flatten, concatenate, one collective, split back into views.
A bucket closes once it reaches the size, so a process group with G bytes of gradients
gets ``ceil(G / bucket size)`` collectives (when single gradients are small next to a
bucket).

As in DDP, the first bucket of each group (the last layers' gradients, which backward
produces first) is small, ``first_bucket_mb`` (1 MB, DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``):
its reduction starts while the rest of backward still runs. A group then gets
``1 + ceil((G - first) / bucket size)`` collectives when G exceeds the first bucket;
``first_bucket_mb=None`` makes every bucket ``bucket_mb``.

Gradients kept across calls (gradient accumulation: no ``zero_grad()`` at the end of
the step) are reduced too, outside the optimizer phase: a call that starts without
gradients returns them reduced (output phase), and a call that starts with them adds
each reduced gradient in place into its ``grad`` input (backward phase). Those
reductions are bucketed the same way: each accumulation ``add_`` first sinks to just
before the next access of its gradient (the optimizer's read, or the end of the step),
so no gradient's reduction is needed before backward ends.

Other all_reduces of the step ride in a bucket when that costs nothing (DDP cannot do
this: its buckets hold gradients only): same group, reduce op, dtype and group size (a
floating ``avg`` rides in a ``sum`` bucket and is divided by the group size after it), the
value exists before the bucket is issued and is not written until then, and nothing reads
it before the bucket's gradients are read (so the bucket is never waited earlier, and a
value the forward or backward needs is never delayed). A floating sum also rides in a
reduce_scatter bucket (FSDP): every rank's row holds n slots, this rank's value in its own
and zeros in the others, so each rank receives every rank's value exactly and sums them in
rank order itself, the same bits on every rank (:func:`_rider_rows`), for n * n times its
bytes in the buffer (a scalar loss: n * n elements instead of one all_reduce launch; the
[loss sum, count] pair of a mean: 2 n * n). The step's
loss is the usual one: a DP or FSDP step then makes one launch per bucket plus, for a mean
over targets (cross entropy), the target count the forward divides by at once (none where
:mod:`.deferred_divisor` moved that division after the buckets: the count rides too, in
an FSDP step in every row of the first reduce_scatter bucket). A rider may be waited with
the first bucket of its group where a later bucket of the group is needed anyway (the
group's collectives complete in issue order), and views or other functions of it alone
do not count as reads.
``fuse_other_all_reduces=False`` turns this off.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..trace.markers import MARKER
from .graph_utils import (
    WAIT,
    alias_root,
    fused_comm,
    hoist,
    is_collective,
    is_inplace,
    is_pure,
    is_view,
    is_wait,
    move_before,
    new_node,
    positions,
    prep_chain,
    written_inputs,
    writes_by_root,
)

__all__ = ["bucket_gradients_pass", "gradient_reductions"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def gradient_reductions(gm: fx.GraphModule) -> list[fx.Node]:
    """Collectives that reduce gradients (sum/avg all_reduce or reduce_scatter): for the
    optimizer (optimizer phase), gradient buckets, and the reductions of gradients kept
    for the next call (:func:`_kept_gradient`)."""
    out = []
    for n in gm.graph.nodes:
        if not is_collective(n):
            continue
        c = n.meta["spmd_comm"]
        if c["kind"] not in ("all_reduce", "reduce_scatter") or n.args[1] not in ("sum", "avg"):
            continue
        if n.meta.get("spmd_phase") == "optimizer" or c.get("op") == "bucket" or _kept_gradient(n) is not None:
            out.append(n)
    return out


def _grad_root(node: fx.Node) -> fx.Node | None:
    """The ``grad`` input an in-place op writes, if it writes one."""
    for x in written_inputs(node):
        root = alias_root(x)
        inp = root.meta.get("spmd_input") if isinstance(root, fx.Node) else None
        if isinstance(root, fx.Node) and root.op == "placeholder" and inp is not None and inp.kind == "grad":
            return root
    return None


def _kept_gradient(n: fx.Node) -> list[fx.Node] | None:
    """If reduction ``n`` reduces a backward-computed gradient only to keep it for the next
    call, the in-place ops that accumulate its result into ``grad`` inputs (empty when the
    result is returned as a new gradient); else None. Its result must go only to the
    step's output or, as the added operand, to in-place writes of ``grad`` inputs."""
    waits = [u for u in n.users if is_wait(u)]
    if len(waits) != 1 or len(n.users) != 1 or not waits[0].users:
        return None
    chain = prep_chain(n)
    src = chain[-1].args[0] if chain else n.args[0]
    if not isinstance(src, fx.Node) or src.meta.get("spmd_phase") != "backward":
        return None
    accumulations = []
    for u in waits[0].users:
        if u.op == "output" and n.meta.get("spmd_phase") == "output":
            continue
        if not is_inplace(u) or _grad_root(u) is None or u.args[0] is waits[0]:
            return None
        accumulations.append(u)
    return accumulations


def _sink(gm: fx.GraphModule, node: fx.Node, pos: dict[fx.Node, float]) -> None:
    """Move in-place accumulation ``node`` down to just before the next node that reads or
    writes the storage it writes (or a pipeline marker, or the output): what it adds is
    then needed only there."""
    root = _grad_root(node)
    stop = node.next
    while stop.op != "output" and stop.target is not MARKER and not any(alias_root(a) is root for a in stop.all_input_nodes):
        stop = stop.next
    if stop is not node.next:
        move_before(node, stop, pos)
        node.meta["spmd_schedule"] = "accumulation into a kept gradient, sunk to its next use so the reduction can join a bucket"


def _wait_of(n: fx.Node) -> fx.Node:
    waits = [u for u in n.users if is_wait(u)]
    assert len(waits) == 1, n
    return waits[0]


def _fuse(gm: fx.GraphModule, bucket: list[fx.Node], pos: dict[fx.Node, float], riders: tuple[fx.Node, ...] = ()) -> None:
    """Replace ``bucket``'s reductions (and the all_reduces ``riders`` that ride in it,
    :func:`_riders`) by one collective right after the last gradient reduction."""
    g = gm.graph
    grads = len(bucket)
    bucket = [*bucket, *riders]
    kind = bucket[0].meta["spmd_comm"]["kind"]
    last = max(bucket[:grads], key=lambda n: pos[n])
    first_comm = bucket[0].meta["spmd_comm"]
    group = bucket[0].args[-1]
    op = bucket[0].args[1]
    n = first_comm["group_size"]
    anchor = last
    created: list[fx.Node] = []

    def add(target: Any, args: tuple, kwargs: dict | None = None, meta: dict | None = None) -> fx.Node:
        nonlocal anchor
        nxt = anchor.next
        with g.inserting_after(anchor):
            node = new_node(g, target, args, kwargs, meta)
        pos[node] = (pos[anchor] + pos.get(nxt, pos[anchor] + 1.0)) / 2.0
        node.meta["spmd_phase"] = last.meta.get("spmd_phase")
        node.meta["spmd_origin"] = {"node": f"bucket of {len(bucket)}", "op": "bucket_gradients", "source": None}
        anchor = node
        created.append(node)
        return node

    inputs = [b.args[0] for b in bucket]
    if kind == "all_reduce":
        flats = [add(aten.reshape.default, (x, [-1])) for x in inputs]
        sizes = [int(f.meta["val"].numel()) for f in flats]
    else:  # reduce_scatter along dim 0: rank j's share of every gradient goes in row j
        flats = [add(aten.reshape.default, (x, [n, -1])) for x in inputs[:grads]]
        coord = _coordinate(gm, first_comm)
        for x in inputs[grads:]:  # a rider in every row, this rank's value in its own slot (_rider_rows)
            flats.append(add(aten.expand.default, (add(aten.reshape.default, (_rider_rows(add, x, coord, n), [1, -1])), [n, -1])))
        sizes = [int(f.meta["val"].shape[1]) for f in flats]
    cat = add(aten.cat.default, (flats, 0 if kind == "all_reduce" else 1))
    buf = cat if kind == "all_reduce" else add(aten.reshape.default, (cat, [-1]))
    reason = f"bucket of {grads} gradient {kind}s"
    if riders:
        why = "; ".join(str(r.meta["spmd_comm"].get("reason", r.name)).split(":")[0] for r in riders)
        reason += f" and {len(riders)} all_reduce{'s' if len(riders) > 1 else ''} riding along ({why})"
    comm = fused_comm(bucket, reason=reason, label="bucket", what=f"{kind}s")
    for entry in comm["bucket"][grads:]:
        entry["rider"] = True  # not a gradient: a value that rides in the bucket
        if kind == "reduce_scatter":  # n slots in each of the n rows: n * n x its bytes in the buffer
            own, wire = entry["bytes"], 2 * (n - 1) * entry["bytes"] // n
            entry["bytes"] = n * n * own
            comm["bytes"] += (n * n - 1) * own
            comm["wire_bytes"] += (n - 1) * n * own - wire
    if kind == "all_reduce":
        coll = add(c10d.all_reduce.default, (buf, op, group), meta={"spmd_comm": comm})
    else:
        coll = add(c10d.reduce_scatter_tensor.default, (buf, op, n, group), meta={"spmd_comm": comm})
    wait = add(WAIT, (coll,), meta={"spmd_wait": True})
    parts = add(aten.split_with_sizes.default, (wait, sizes))
    for i, member in enumerate(bucket):
        piece = add(operator.getitem, (parts, i))
        if i >= grads and kind == "reduce_scatter":  # every rank's value, summed here in rank order
            piece = add(aten.sum.dim_IntList, (add(aten.reshape.default, (piece, [n, -1])), [0]))
        old_wait = _wait_of(member)
        view = add(aten.reshape.default, (piece, list(old_wait.meta["val"].shape)))
        if member.args[1] == "avg" and op == "sum":  # a mean riding in a sum bucket: sum, then divide
            view = add(aten.div.Tensor, (view, n))
        old_wait.replace_all_uses_with(view)
        g.erase_node(old_wait)
        g.erase_node(member)


def _coordinate(gm: fx.GraphModule, comm: dict[str, Any]) -> fx.Node | None:
    """The placeholder of this rank's coordinate on ``comm``'s mesh axis (its index in the
    group); None in a pipeline stage's piece that does not take it (no rider then)."""
    coords = [n for n in gm.graph.find_nodes(op="placeholder") if n.meta.get("spmd_coord") == comm.get("axis_name")]
    assert len(coords) <= 1, (comm.get("axis_name"), coords)
    return coords[0] if coords else None


def _rider_rows(add: Callable[..., fx.Node], x: fx.Node, coord: fx.Node, n: int) -> fx.Node:
    """``[n, k]``: row ``coord`` is ``x`` (k values), the other rows 0. In every row of a
    reduce_scatter buffer, each rank's value sits in its own slot: rank ``j`` receives, in
    its row, each rank's value exactly (a sum of one value and zeros), and sums them itself
    in rank order. Every rank's result is then the same bits; summed by the collective, each
    row would be reduced in another order (NCCL's ring ends each row's sum at its own rank)
    and a replicated value, the loss, could differ in its last bit from rank to rank. A
    copy into zeros, not a product with a one-hot mask: an inf or NaN stays in its slot."""
    row = add(aten.reshape.default, (x, [1, -1]))
    zeros = add(aten.new_zeros.default, (row, [n, int(row.meta["val"].shape[1])]))
    return add(aten.slice_scatter.default, (zeros, row, 0, coord, add(operator.add, (coord, 1))))


def _riders(
    gm: fx.GraphModule, planned: dict[tuple, list[list[fx.Node]]], reductions: set[fx.Node], pos: dict[fx.Node, float],
    first_use: Any,
) -> dict[int, list[fx.Node]]:
    """Other all_reduces that can ride in a gradient bucket (by ``id`` of the bucket):
    same kind, group, reduce op, dtype and group size; the value exists before the
    bucket's collective is issued (right after its last gradient reduction) and is not
    written in between; and no user reads it before any of the bucket's gradients is
    used (so fusing never makes the bucket be waited earlier, and never delays a value
    that forward or backward needs: a forward all_reduce that backward reads is used
    before the optimizer reads the gradients). Each rides in the earliest bucket that
    takes it. The step's loss (output phase, read only by the output) is the usual rider.
    "Before the bucket's gradients": before the first use of a gradient of this bucket or
    of a later bucket of its group (waiting for this one then costs nothing: a group's
    collectives complete in issue order), views and other pure functions of the rider
    alone not counting as uses (but none before the bucket is issued)."""
    if any(n.target is MARKER for n in gm.graph.nodes):
        return {}  # pipeline stages: a value does not move across a stage boundary
    writes: dict[Any, list[float]] = defaultdict(list)  # every write, any written argument
    for w in gm.graph.nodes:
        for x in written_inputs(w):
            writes[alias_root(x)].append(pos[w])
    # a group's collectives complete in issue order: waiting for bucket b where a later
    # bucket of its group is needed anyway costs nothing
    needed: dict[int, float] = {}
    for buckets in planned.values():
        later = float(len(pos))
        for b in reversed(buckets):
            later = min(later, *(first_use(m) for m in b))
            needed[id(b)] = later
    out: dict[int, list[fx.Node]] = {}
    for n in list(gm.graph.nodes):
        if not is_collective(n) or n in reductions or n.meta["spmd_comm"]["kind"] != "all_reduce" or n.meta.get("spmd_comm", {}).get("op") == "bucket":
            continue
        waits = [u for u in n.users if is_wait(u)]
        src = n.args[0]
        if len(n.users) != 1 or len(waits) != 1 or not waits[0].users or not isinstance(src, fx.Node):
            continue
        c = n.meta["spmd_comm"]
        val = src.meta.get("val")
        if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
            continue  # a bucket's split sizes are static
        floating = val.dtype.is_floating_point
        op = "sum" if n.args[1] == "avg" and floating else n.args[1]  # a mean is a sum divided by the group size
        key = (c["kind"], n.args[-1], op, c["dtype"], c["group_size"])
        candidates = [*planned.get(key, ())]
        if op == "sum" and floating and _coordinate(gm, c) is not None:  # a sum can also ride in a reduce_scatter
            candidates += planned.get(("reduce_scatter", *key[1:]), ())    # bucket (FSDP), in every row (_rider_rows)
        touch, use = _reads(waits[0], pos)
        written = writes.get(alias_root(src), ())
        for b in candidates:
            issue = max(pos[m] for m in b)
            lo, hi = sorted((pos[n], issue))
            if pos[src] >= issue or touch <= issue or any(lo < w < hi for w in written):
                continue
            if use < needed[id(b)]:
                continue
            out.setdefault(id(b), []).append(n)
            break
    return out


def _reads(wait: fx.Node, pos: dict[fx.Node, float]) -> tuple[float, float]:
    """The first read of ``wait``'s result and the first read of its value by something
    else than a function of it alone (a view of it, a pure op whose only input it is:
    those can run at that read as well)."""
    touch = min((pos[u] for u in wait.users), default=float(len(pos)))
    use, stack, seen = float(len(pos)), list(wait.users), {wait}
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if (is_view(u) or is_pure(u)) and len(u.all_input_nodes) == 1 and u.all_input_nodes[0] in seen:
            stack.extend(u.users)
        else:
            use = min(use, pos[u])
    return touch, use


def bucket_gradients_pass(
    gm: fx.GraphModule, *, bucket_mb: float = 25.0, first_bucket_mb: float | None = 1.0, fuse_other_all_reduces: bool = True,
) -> fx.GraphModule:
    """Fuse gradient reductions into buckets of about ``bucket_mb`` MB (1 MB = 2**20 bytes);
    the first bucket of each process group holds about ``first_bucket_mb`` MB. With
    ``fuse_other_all_reduces``, compatible all_reduces whose result is needed only after
    a bucket's gradients (the step's loss) ride in that bucket (:func:`_riders`)."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    if first_bucket_mb is not None and first_bucket_mb <= 0:
        raise ValueError(f"first_bucket_mb must be positive or None, got {first_bucket_mb}")
    cap = bucket_mb * 2**20
    first_cap = cap if first_bucket_mb is None else min(cap, first_bucket_mb * 2**20)
    reductions = gradient_reductions(gm)
    pos = positions(gm)
    for n in reductions:  # accumulations into kept gradients wait until their gradient is next read
        for u in _kept_gradient(n) or ():
            _sink(gm, u, pos)
    writes = writes_by_root(gm)
    for n in reductions:  # issue each reduction as soon as its gradient exists
        hoist(gm, n, pos, writes=writes)
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for n in sorted(reductions, key=lambda n: pos[n]):
        c = n.meta["spmd_comm"]
        groups[(c["kind"], n.args[-1], n.args[1], c["dtype"], c["group_size"])].append(n)
    def first_use(n: fx.Node) -> int:
        users = list(_wait_of(n).users)
        return min(pos[u] for u in users) if users else len(pos)

    planned: dict[tuple, list[list[fx.Node]]] = {}
    for key, members in groups.items():
        bucket: list[fx.Node] = []
        size = 0
        deadline = len(pos)  # the bucket's collective must run before any member is used
        buckets = []
        for n in members:
            if bucket and pos[n] > deadline:
                buckets.append(bucket)
                bucket, size, deadline = [], 0, len(pos)
            bucket.append(n)
            size += n.meta["spmd_comm"]["bytes"]
            deadline = min(deadline, first_use(n))
            if size >= (cap if buckets else first_cap):
                buckets.append(bucket)
                bucket, size, deadline = [], 0, len(pos)
        if bucket:
            buckets.append(bucket)
        planned[key] = buckets
    riders = _riders(gm, planned, set(reductions), pos, first_use) if fuse_other_all_reduces else {}
    for buckets in planned.values():
        for b in buckets:
            extra = tuple(riders.get(id(b), ()))
            if len(b) + len(extra) > 1:
                _fuse(gm, b, pos, extra)
    gm.graph.eliminate_dead_code()
    return gm
