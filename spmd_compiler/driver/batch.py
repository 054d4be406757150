"""The batch and state side of the driver: placements of batch tensors, the global
example batch behind each rank's shard, and the signature that picks a compiled program.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..expand.chunks import chunk_sizes
from ..plan import Plan
from ..trace.tracer import CONSTANT_LEAF_TYPES, GraphInput, flatten_batch

__all__ = ["batch_placements", "sharded_batch_dims", "global_batch", "signature", "why_recompile"]


def batch_placements(plan: Plan, paths: list[str], leaves: list[Any], ndim: int) -> list[tuple | None]:
    """Placements of every batch leaf (None for constants), resolved without a trace."""
    inputs = [
        GraphInput("batch", path, tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, index=i, device=leaf.device)
        for i, (path, leaf) in enumerate(zip(paths, leaves))
        if isinstance(leaf, torch.Tensor)
    ]
    resolved = iter(plan.batch_placements(inputs, ndim))
    return [next(resolved)[0] if isinstance(leaf, torch.Tensor) else None for leaf in leaves]


def sharded_batch_dims(plan: Plan, args: tuple, kwargs: dict, ndim: int, *, dynamic: bool = False) -> dict[int, tuple[int, ...]]:
    """Per batch leaf, the dims traced as symbols: without ``dynamic``, the dims the plan
    shards (an unsharded dim has the same size on every rank, and symbols slow the trace).

    ``dynamic`` (``dynamic=True``'s symbolic sizes): dim 0, the batch size, only, of a
    leaf the plan shards (along dim 0, data parallel; or along another dim only,
    ``Shard(1)``, a sequence-sharded batch: dim 0 unsharded, the same on every rank), or
    of every leaf when no leaf is split along dim 0 (``Replicate()``, tensor parallel;
    beside a split batch, a replicated leaf is an extra input, class weights or a mask,
    whose size need not vary). A sharded dim other than 0 (the sequence) stays static:
    each rank's piece of it is a static size, so views that merge it behind the batch
    keep a strided layout with a static period (``pt.symbolic_split``); a new sequence
    length compiles again (docs/dynamic_shapes.md)."""
    leaves, _, paths = flatten_batch(args, kwargs)
    placements = batch_placements(plan, paths, leaves, ndim)
    out = {}
    for i, pl in enumerate(placements):
        if pl is None:
            continue
        dims = {p.dim for p in pl if isinstance(p, pt.Shard)}
        if dynamic:
            dims = {0} if leaves[i].dim() > 0 and (dims or not _batch_split(placements)) else set()
        out[i] = tuple(sorted(dims))
    return out


def _batch_split(placements: list[tuple | None]) -> bool:
    """Some batch leaf is split along dim 0 (data parallel)."""
    return any(pl is not None and any(isinstance(p, pt.Shard) and p.dim == 0 for p in pl) for pl in placements)


def global_batch(batch: tuple, kwargs: dict, mesh: Any, plan: Plan, exchange: Any) -> tuple[tuple, dict]:
    """Global example tensors for this rank's local batch (each rank passes its shard).

    ``exchange(payload)`` gathers a payload from every rank (collective); the sharded
    dims' global sizes are the sums of the ranks' local sizes along the mesh axes that
    shard them. Unsharded dims must agree between ranks (ValueError naming the rank).
    """
    leaves, spec, paths = flatten_batch(batch, kwargs)
    ndim = mesh.ndim
    placements = batch_placements(plan, paths, leaves, ndim)
    coord = tuple(mesh.get_coordinate())
    local = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves]
    everyone = exchange((coord, local))
    out = []
    for i, (leaf, pl) in enumerate(zip(leaves, placements)):
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        shape = list(leaf.shape)
        for d in range(len(shape)):
            axes = [a for a, p in enumerate(pl) if isinstance(p, pt.Shard) and p.dim == d]
            if not axes:
                continue
            if len(everyone) == 1:  # fake group or one process: assume even shards
                for a in axes:
                    shape[d] *= mesh.shape[a]
                continue
            peers = [(c, shapes[i][d]) for c, shapes in everyone if all(c[a] == coord[a] for a in range(ndim) if a not in axes)]
            shape[d] = sum(n for _, n in peers)
            _check_chunk_layout(paths[i], d, shape[d], axes, mesh, peers)
        for c, shapes in everyone:
            other = shapes[i]
            for d in range(len(shape)):
                sharded = any(isinstance(p, pt.Shard) and p.dim == d for p in pl)
                if not sharded and other[d] != leaf.shape[d]:
                    raise ValueError(
                        f"{paths[i]} has size {leaf.shape[d]} in dim {d} here but {other[d]} on the rank at mesh "
                        f"coordinate {c}; only the sharded dims of batch tensors may differ between ranks"
                    )
        out.append(torch.empty(shape, dtype=leaf.dtype, device=leaf.device).requires_grad_(leaf.requires_grad))
    args, kw = pytree.tree_unflatten(out, spec)
    return args, kw


def _check_chunk_layout(path: str, dim: int, total: int, axes: list[int], mesh: Any, peers: list[tuple[tuple, int]]) -> None:
    """Each rank's rows must be the shard the program gives its coordinate: torch.chunk's
    layout (every rank ceil(total/n) rows, the last ones fewer), as ``x.chunk(world)[rank]``
    and DTensor cut them. Every rank sees the same sizes, so all raise together."""
    if len(axes) != 1:
        return
    n = mesh.shape[axes[0]]
    want = dict(enumerate(chunk_sizes(total, n)))
    got = {c[axes[0]]: size for c, size in peers}
    if any(got[j] != want[j] for j in got):
        have = ", ".join(f"coordinate {j}: {got[j]}" for j in sorted(got))
        expect = ", ".join(f"{want[j]}" for j in sorted(want))
        raise ValueError(
            f"{path}: the ranks hold {have} rows of dim {dim} (global {total}), but a global size of {total} is "
            f"split as [{expect}] over mesh axis {axes[0]} (torch.chunk's layout); the program would read rows that "
            f"are not there. fix: split each batch with x.chunk(world)[rank] / tensor_split, drop the last partial "
            f"batch (DataLoader(drop_last=True)), or pad it to a multiple of {n}"
        )


def signature(state: Any, batch: tuple, kwargs: dict, *, free_dims: dict[int, tuple[int, ...]] | None = None) -> tuple:
    """What selects a compiled program: the batch's structure, shapes, dtypes, devices
    and constants, the structure of the model and optimizer state, and which parameters
    hold a gradient (``.grad`` not None: accumulated by an earlier call).

    ``free_dims`` (``{batch leaf index: dims}``, from :func:`sharded_batch_dims`) leaves
    those sizes out (``None``): a ``dynamic=True`` program serves them all, as long as
    its size guards hold (checked separately)."""
    leaves, spec, paths = flatten_batch(batch, kwargs)
    sig = []
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        if isinstance(leaf, torch.Tensor):
            free = (free_dims or {}).get(i, ())
            shape = tuple(None if d in free else n for d, n in enumerate(leaf.shape))
            sig.append((path, shape, leaf.dtype, leaf.device.type, leaf.requires_grad))
        else:
            sig.append((path, type(leaf).__name__, leaf if isinstance(leaf, CONSTANT_LEAF_TYPES) else id(leaf)))
    grads = tuple(n for n, p in state.params.items() if p.grad is not None)
    return (str(spec), tuple(sig), *state.signature(), grads, state.guard_outcomes(), state.modes, call_context())


_AUTOCAST_DEVICES = ("cpu", "cuda")


def call_context() -> tuple:
    """The global modes a step is traced under and that change what it computes: grad mode
    (``torch.no_grad()`` around the call) and autocast (``torch.autocast`` around the call,
    per device type: enabled and dtype). Part of the call signature, so a call under
    another context gets a program traced under it."""
    return torch.is_grad_enabled(), tuple(
        (d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))


def _context_text(ctx: tuple) -> str:
    grad, autocast = ctx
    amp = ", ".join(f"autocast {d} {str(t).removeprefix('torch.')}" for d, t in autocast) or "no autocast"
    return f"grad {'enabled' if grad else 'disabled'}, {amp}"


def why_recompile(old: tuple | None, key: tuple) -> str:
    """The reason a call with signature ``key`` compiles again after ``old``."""
    if old is None:
        return "first call"
    if old[3] != key[3]:  # before the optimizer state: unfreezing a parameter also creates its state
        return _params_changed(old[3], key[3])
    if old[2] != key[2]:
        return "optimizer state changed (created by the previous step)" if len(key[2]) > len(old[2]) else "optimizer state changed"
    if old[1] != key[1]:
        for a, b in zip(old[1], key[1]):
            if a != b:
                what = ["shape", "dtype", "device", "requires_grad"] if len(a) == 5 else ["type", "value"]
                diffs = [f"{w} {x} -> {y}" for w, x, y in zip(what, a[1:], b[1:]) if x != y]
                return f"{b[0]}: " + ", ".join(diffs)
    if old[5] != key[5]:
        if not key[5]:
            return "no parameter holds a gradient any more (.grad is None)"
        return f"gradients are set on {len(key[5])} parameter(s) (was {len(old[5])}): accumulated by the previous call"
    if old[4] != key[4]:
        for a, b in zip(old[4], key[4]):
            if a != b:
                return f"optimizer hyperparameter param_groups[{b[0]}][{b[1]!r}] changed: {a[2]} -> {b[2]}"
        return "optimizer param groups changed"
    if old[8:] != key[8:]:
        return f"the call's context changed: {_context_text(old[8])} -> {_context_text(key[8])}"
    if old[7:] != key[7:]:
        return (f"module modes changed (model.train() / model.eval()): {len(key[7])} module(s) in eval mode, "
                f"{len(old[7])} before")
    if old[5:] != key[5:]:
        return "a branch the optimizer takes on its own numbers (step count, momentum) went the other way"
    return "batch structure changed"


def _params_changed(old: tuple, new: tuple) -> str:
    """Why the model's parameter records (name, shape, dtype, requires_grad) differ."""
    before = {rec[0]: rec for rec in old}
    frozen = [n for n, *_, rg in new if n in before and before[n][3] and not rg]
    unfrozen = [n for n, *_, rg in new if n in before and not before[n][3] and rg]
    if (frozen or unfrozen) and [r[:3] for r in old] == [r[:3] for r in new]:
        parts = [f"{what} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                 for what, names in (("frozen (requires_grad False):", frozen), ("unfrozen (requires_grad True):", unfrozen)) if names]
        return "model parameters " + "; ".join(parts)
    return "model parameters changed"
