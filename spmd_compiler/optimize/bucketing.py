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
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from .graph_utils import WAIT, fused_comm, hoist, is_collective, is_wait, new_node, positions, writes_by_root

__all__ = ["bucket_gradients_pass", "gradient_reductions"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def gradient_reductions(gm: fx.GraphModule) -> list[fx.Node]:
    """Collectives that reduce gradients for the optimizer (sum/avg, optimizer phase)."""
    out = []
    for n in gm.graph.nodes:
        if not is_collective(n):
            continue
        c = n.meta["spmd_comm"]
        if c["kind"] not in ("all_reduce", "reduce_scatter") or n.meta.get("spmd_phase") != "optimizer":
            continue
        if n.args[1] not in ("sum", "avg"):
            continue
        out.append(n)
    return out


def _wait_of(n: fx.Node) -> fx.Node:
    waits = [u for u in n.users if is_wait(u)]
    assert len(waits) == 1, n
    return waits[0]


def _fuse(gm: fx.GraphModule, bucket: list[fx.Node], pos: dict[fx.Node, float]) -> None:
    g = gm.graph
    kind = bucket[0].meta["spmd_comm"]["kind"]
    last = max(bucket, key=lambda n: pos[n])
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
        flats = [add(aten.reshape.default, (x, [n, -1])) for x in inputs]
        sizes = [int(f.meta["val"].shape[1]) for f in flats]
    cat = add(aten.cat.default, (flats, 0 if kind == "all_reduce" else 1))
    buf = cat if kind == "all_reduce" else add(aten.reshape.default, (cat, [-1]))
    comm = fused_comm(bucket, reason=f"bucket of {len(bucket)} gradient {kind}s", label="bucket", what=f"{kind}s")
    if kind == "all_reduce":
        coll = add(c10d.all_reduce.default, (buf, op, group), meta={"spmd_comm": comm})
    else:
        coll = add(c10d.reduce_scatter_tensor.default, (buf, op, n, group), meta={"spmd_comm": comm})
    wait = add(WAIT, (coll,), meta={"spmd_wait": True})
    parts = add(aten.split_with_sizes.default, (wait, sizes))
    for i, member in enumerate(bucket):
        piece = add(operator.getitem, (parts, i))
        old_wait = _wait_of(member)
        view = add(aten.reshape.default, (piece, list(old_wait.meta["val"].shape)))
        old_wait.replace_all_uses_with(view)
        g.erase_node(old_wait)
        g.erase_node(member)


def bucket_gradients_pass(gm: fx.GraphModule, *, bucket_mb: float = 25.0, first_bucket_mb: float | None = 1.0) -> fx.GraphModule:
    """Fuse gradient reductions into buckets of about ``bucket_mb`` MB (1 MB = 2**20 bytes);
    the first bucket of each process group holds about ``first_bucket_mb`` MB."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    if first_bucket_mb is not None and first_bucket_mb <= 0:
        raise ValueError(f"first_bucket_mb must be positive or None, got {first_bucket_mb}")
    cap = bucket_mb * 2**20
    first_cap = cap if first_bucket_mb is None else min(cap, first_bucket_mb * 2**20)
    reductions = gradient_reductions(gm)
    pos = positions(gm)
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

    for members in groups.values():
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
        for b in buckets:
            if len(b) > 1:
                _fuse(gm, b, pos)
    gm.graph.eliminate_dead_code()
    return gm
