"""Rank agreement: every rank must run the same program, or all fail at once.

Each rank fingerprints its per-rank graph (one short digest per node; collectives name
their mesh axis instead of the process group, which differs per rank) and the
fingerprints are exchanged once per compile. If a rank failed to compile, or two ranks
compiled different graphs, every rank raises :class:`~spmd_compiler.RankMismatchError`
naming the first differing node, instead of some ranks waiting in a collective forever.
Graphs of unevenly sharded programs legitimately differ in sizes between ranks, so only
their structure is compared.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..errors import RankMismatchError

__all__ = ["fingerprint", "exchange", "check_agreement", "compare_fingerprints", "comm_device"]

log = logging.getLogger(__name__)


def _canon(x: Any, index: dict[fx.Node, int], groups: dict[str, str], with_sizes: bool) -> Any:
    if isinstance(x, fx.Node):
        return f"%{index[x]}"
    if isinstance(x, (list, tuple)):
        return [_canon(v, index, groups, with_sizes) for v in x]
    if isinstance(x, dict):
        return {k: _canon(v, index, groups, with_sizes) for k, v in sorted(x.items())}
    if isinstance(x, str) and x in groups:
        return f"<group {groups[x]}>"
    if isinstance(x, (int, float)) and not isinstance(x, bool) and not with_sizes:
        return "<num>"
    return repr(x)


def _keeps_sizes(node: fx.Node, with_sizes: bool) -> bool:
    """Whether ``node``'s numbers enter its fingerprint: always for a collective (its
    group size and split sizes must agree even where shards are uneven)."""
    return with_sizes or (isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "_c10d_functional")


def _node_text(gm: fx.GraphModule, i: int, group_axes: dict[str, str], with_sizes: bool) -> str:
    """The whole canonical text of node ``i`` (what its fingerprint digests)."""
    index = {n: k for k, n in enumerate(gm.graph.nodes)}
    node = list(gm.graph.nodes)[i]
    sizes = _keeps_sizes(node, with_sizes)
    return f"%{node.name} = {_canon(node.args, index, group_axes, sizes)} {_canon(node.kwargs, index, group_axes, sizes)}"


def fingerprint(gm: fx.GraphModule, group_axes: dict[str, str], *, with_sizes: bool = True) -> list[tuple[str, str]]:
    """``[(node text, digest)]`` for every node, independent of rank-specific group names."""
    index: dict[fx.Node, int] = {}
    out = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        if isinstance(node.target, torch._ops.OpOverload):
            target = str(node.target)
        # a collective's sizes (group_size, split sizes) must agree even where shards are uneven
        sizes = _keeps_sizes(node, with_sizes)
        text = f"{node.op} {target} {_canon(node.args, index, group_axes, sizes)} {_canon(node.kwargs, index, group_axes, sizes)}"
        shown = text if len(text) <= 160 else text[:157] + "..."
        out.append((f"%{node.name} = {shown}", hashlib.sha1(text.encode()).hexdigest()[:12]))
    return out


def comm_device(group: Any = None) -> torch.device:
    """The device a tensor for a collective on ``group`` must live on: the current CUDA
    device under NCCL, the CPU otherwise (gloo, fake)."""
    backend = str(dist.get_backend(group)) if dist.is_initialized() else "gloo"
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange(payload: Any, group: Any = None) -> list[Any]:
    """All-gather a picklable object from every rank (identity on one process).

    Written here rather than calling ``dist.all_gather_object``, which decodes through
    numpy (not a dependency of torch's wheel, nor of ours): the pickles are padded to the
    longest, gathered as one uint8 tensor on the group's device, and read back with
    ``ctypes.string_at``.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
        return [payload]
    world = dist.get_world_size(group)
    device = comm_device(group)
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    out = []
    for t, n in zip(gathered, lengths):
        host = t.cpu().contiguous()
        out.append(pickle.loads(ctypes.string_at(host.data_ptr(), n)))
    return out


def check_agreement(gm: fx.GraphModule | None, group_axes: dict[str, str], *, with_sizes: bool, error: BaseException | None) -> None:
    """Exchange fingerprints (or this rank's compile error) and raise on any mismatch.

    Every rank must call this once per compile, whether its own compile failed or not.
    """
    mine = ("error", f"{type(error).__name__}: {error}") if error is not None else ("ok", fingerprint(gm, group_axes, with_sizes=with_sizes))
    everyone = exchange(mine)
    rank = dist.get_rank() if dist.is_initialized() else 0
    failed = [(r, p[1]) for r, p in enumerate(everyone) if p[0] == "error"]
    if error is not None:
        raise error
    if failed:
        r, msg = failed[0]
        first_line = msg.splitlines()[0] if msg else msg
        raise RankMismatchError(
            f"rank {r} failed to compile the step ({first_line}); every rank stops here instead of waiting "
            f"for it in a collective. See rank {r}'s log for the full error."
        )
    try:
        compare_fingerprints([p[1] for p in everyone], rank)
    except RankMismatchError as e:
        node = getattr(e, "node_index", None)
        if node is None or gm is None:
            raise
        # the short texts agree (the difference is past their cut): every rank is here, exchange the whole node
        texts = exchange(_node_text(gm, node, group_axes, with_sizes))
        differing = [r for r, t in enumerate(texts) if t != texts[0]]
        raise RankMismatchError(
            f"{e}\n  node {node} in full: rank 0 has {texts[0]}\n  rank {differing[0] if differing else '?'} has "
            f"{texts[differing[0]] if differing else '?'}"
        ) from None
    log.debug("rank agreement: %d ranks compiled the same %d-node graph", len(everyone), len(everyone[0][1]))


def compare_fingerprints(everyone: list[list[tuple[str, str]]], rank: int = 0) -> None:
    """Raise RankMismatchError naming the first node where a rank's graph differs from rank 0's."""
    ref = everyone[0]
    for r, fp in enumerate(everyone):
        if fp == ref:
            continue
        for i, (a, b) in enumerate(zip(ref, fp)):
            if a[1] != b[1]:
                if a[0] == b[0]:  # same short text: check_agreement adds the whole node
                    err = RankMismatchError(
                        f"rank {r} compiled a different graph than rank 0 (this is rank {rank}); first difference at "
                        f"node {i} ({a[0]}), past the part shown. fix: make the model, plan, batch shapes and Python "
                        f"scalars the step uses identical on every rank (uneven batch sizes are fine only along the sharded dim)."
                    )
                    err.node_index = i  # type: ignore[attr-defined]
                    raise err
                raise RankMismatchError(
                    f"rank {r} compiled a different graph than rank 0 (this is rank {rank}); first difference at "
                    f"node {i}: rank 0 has {a[0]}, rank {r} has {b[0]}. fix: make the model, plan and batch shapes "
                    f"identical on every rank (uneven batch sizes are fine only along the sharded dim)."
                )
        raise RankMismatchError(f"rank {r} compiled a graph with {len(fp)} nodes, rank 0 one with {len(ref)} nodes")
