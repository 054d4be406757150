"""Rank agreement: every rank must run the same program, or all fail at once.

Each rank fingerprints its per-rank graph (one short digest per node; collectives name
their mesh axis instead of the process group, which differs per rank) and the
fingerprints are exchanged once per compile. If a rank failed to compile, or two ranks
compiled different graphs, every rank raises :class:`~spmd_compiler.RankMismatchError`
naming the ranks that differ from the others and the first differing node, instead of
some ranks waiting in a collective forever.
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

__all__ = ["fingerprint", "exchange", "check_agreement", "compare_fingerprints", "rank_groups", "comm_device"]

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
        if node.op == "placeholder":  # an input's dtype (and shape) as this rank was called with it
            text += _input_text(node, with_sizes)
        shown = text if len(text) <= 160 else text[:157] + "..."
        out.append((f"%{node.name} = {shown}", hashlib.sha1(text.encode()).hexdigest()[:12]))
    return out


def _input_text(node: fx.Node, with_sizes: bool) -> str:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return ""
    return f" dtype={val.dtype}" + (f" shape={tuple(val.shape)}" if with_sizes else "")


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
            f"{_ranks([r for r, _ in failed])} failed to compile the step (rank {r}: {first_line}); every rank stops here "
            f"instead of waiting for it in a collective. See rank {r}'s log for the full error."
        )
    try:
        compare_fingerprints([p[1] for p in everyone], rank)
    except RankMismatchError as e:
        node = getattr(e, "node_index", None)
        if node is None or gm is None:
            raise
        # the short texts agree (the difference is past their cut): every rank is here, exchange the whole node
        texts = exchange(_node_text(gm, node, group_axes, with_sizes))
        raise RankMismatchError(f"{e}\n  node {node} in full: {_holds(e.rank_groups, texts)}") from None
    log.debug("rank agreement: %d ranks compiled the same %d-node graph", len(everyone), len(everyone[0][1]))


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0, 1, 2``."""
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def _holds(groups: list[list[int]], texts: list[str]) -> str:
    """``ranks 0, 1, 2 have A, rank 3 has B``: what each group of ranks holds."""
    return ", ".join(f"{_ranks(g)} {'have' if len(g) > 1 else 'has'} {texts[g[0]]}" for g in groups)


def rank_groups(everyone: list[Any]) -> list[list[int]]:
    """The ranks grouped by equal values, the largest group first (the reference the
    others differ from; on a tie, the group of the lowest rank), then by lowest rank."""
    groups: list[list[int]] = []
    for r, v in enumerate(everyone):
        g = next((g for g in groups if everyone[g[0]] == v), None)
        if g is None:
            groups.append([r])
        else:
            g.append(r)
    return sorted(groups, key=lambda g: (-len(g), g[0]))


def compare_fingerprints(everyone: list[list[tuple[str, str]]], rank: int = 0) -> None:
    """Raise RankMismatchError when the ranks' graphs differ, naming the ranks that differ
    from the most common graph (the others; on a tie, e.g. 2 ranks, every group of ranks
    alike), the first differing node and what each group of ranks has there. ``rank`` is this process's rank (named in the message)."""
    groups = rank_groups(everyone)
    if len(groups) == 1:
        return
    ref = everyone[groups[0][0]]
    first = []
    for g in groups[1:]:
        fp = everyone[g[0]]
        first.append(next((i for i, (a, b) in enumerate(zip(ref, fp)) if a[1] != b[1]), min(len(ref), len(fp))))
    node = min(first)
    odd = sorted(r for g in groups[1:] for r in g)
    if len(groups[0]) == len(groups[1]):  # a tie: no rank is the odd one out
        head = (f"the ranks compiled {len(groups)} different graphs, none held by most ranks: "
                f"{' / '.join(_ranks(g) for g in groups)} (this is rank {rank}); first difference at node {node}")
    else:
        head = (f"{_ranks(odd)} compiled {'a different graph' if len(groups) == 2 else 'different graphs'} than "
                f"{_ranks(groups[0])} (this is rank {rank}); first difference at node {node}")
    texts = [fp[node][0] if node < len(fp) else f"no node {node} (a graph of {len(fp)} nodes)" for fp in everyone]
    shown = [everyone[g[0]][node][0] for g in groups if node < len(everyone[g[0]])]
    if len(shown) == len(groups) and len(set(shown)) == 1:  # same short text: check_agreement adds the whole node
        err = RankMismatchError(
            f"{head} ({shown[0]}), past the part shown. fix: make the model, plan, batch shapes and dtypes and Python "
            f"scalars the step uses identical on every rank (uneven batch sizes are fine only along the sharded dim)."
        )
        err.node_index = node  # type: ignore[attr-defined]
        err.rank_groups = groups  # type: ignore[attr-defined]
        raise err
    here = [groups[0]] + [g for g, i in zip(groups[1:], first) if i == node]
    later = "".join(f"; {_ranks(g)} first differ{'s' * (len(g) == 1)} at node {i}" for g, i in zip(groups[1:], first) if i != node)
    raise RankMismatchError(
        f"{head}: {_holds(here, texts)}{later}. fix: make the model, plan, batch shapes and dtypes "
        f"identical on every rank (uneven batch sizes are fine only along the sharded dim)."
    )
