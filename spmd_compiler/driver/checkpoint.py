"""Checkpoints with torch.distributed.checkpoint (DCP) that load all or nothing.

``dcp.load`` reads into the tensors it is given, shard by shard: when one shard file is
damaged it raises on every rank, but the tensors read before the failure are already
overwritten (a model truncated at one file was left with 69 of 84 tensors changed, 32 of
them half checkpoint, half old values, and trained on without complaint).
:func:`load_checkpoint` reads into fresh buffers instead and swaps them in only when
everything was read:

1. the checkpoint's metadata is read, and every item's byte range must lie in its file
   (a truncated shard is named before anything is read);
2. every key of the model's and optimizer's state dicts (``get_state_dict``: DTensors with
   the plan's placements) must be in the checkpoint with the global shape and dtype the
   plan gives it;
3. ``dcp.load`` reads into empty tensors laid out like the live ones (so a checkpoint saved
   under another plan or mesh is resharded on the way in; a ``fused_shard`` tensor is stored
   and read in ``Shard`` layout and converted, :mod:`.fused_layout`);
4. only then ``set_state_dict`` copies them into the live model and optimizer.

A failure at 1-3 raises :class:`~spmd_compiler.errors.CheckpointError` naming the
checkpoint, the damaged files (each item of each file is read once more to find them,
on the failure path only) and the fix, with the model and optimizer as they were: the
optimizer state that ``get_state_dict`` creates for a fresh optimizer is removed again.
Every rank reads the same metadata and files and ``dcp.load`` fails on every rank
together, so all ranks raise or all swap. The format is the one
:func:`save_checkpoint` writes: ``{"model": ..., "optim": ...}`` of ``get_state_dict``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from .. import _private_torch as pt
from ..errors import CheckpointError
from ..trace.state import unwrap_compiled
from .fused_layout import empty_stored_layout, has_fused_layout, to_fused_layout, to_shard_layout

__all__ = ["save_checkpoint", "load_checkpoint", "DriverCheckpoints"]

log = logging.getLogger(__name__)


def save_checkpoint(model: torch.nn.Module, optimizer: Any, checkpoint_id: str | os.PathLike) -> None:
    """Save ``model`` and ``optimizer`` (distributed) with DCP, in the layout
    :func:`load_checkpoint` reads; every rank calls it."""
    msd, osd = get_state_dict(model, optimizer) if optimizer is not None else (get_state_dict(model, [])[0], {})
    dcp.save(_tree(to_shard_layout, {"model": msd, "optim": osd}), checkpoint_id=os.fspath(checkpoint_id))


def _tree(fn: Any, value: Any) -> Any:
    """``fn`` applied to every tensor of a nested state dict."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _tree(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tree(fn, v) for v in value)
    return value


def _back(read: Any, like: Any) -> Any:
    """``read`` (tensors in the checkpoint's layout) in ``like``'s layouts."""
    if isinstance(like, torch.Tensor):
        return to_fused_layout(read, like) if has_fused_layout(like) else read
    if isinstance(like, dict):
        return {k: _back(read[k], v) for k, v in like.items()}
    if isinstance(like, (list, tuple)):
        return type(like)(_back(r, v) for r, v in zip(read, like))
    return read


class _Snapshot:
    """What ``get_state_dict`` may change on a live optimizer: a fresh optimizer gets
    zero state (it runs one step with lr 0 and zero gradients) and the gradients are
    cleared; :meth:`restore` puts both back."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.state = dict(optimizer.state) if optimizer is not None else {}
        self.grads = [(p, p.grad) for p in model.parameters()]

    def restore(self) -> None:
        if self.optimizer is not None:
            self.optimizer.state.clear()
            self.optimizer.state.update(self.state)
        for p, g in self.grads:
            p.grad = g


def _check_keys(flat: dict[str, Any], metadata: Any, path: str) -> None:
    stored = metadata.state_dict_metadata
    for key, t in flat.items():
        if not isinstance(t, torch.Tensor):
            continue
        md = stored.get(key)
        shape, dtype = tuple(t.shape), t.dtype  # a DTensor's: the global shape
        if md is None:
            raise CheckpointError(path, f"it has no {key!r} ({dtype}, shape {list(shape)}), which the model or optimizer holds",
                                  fix="load a checkpoint saved from the same model and optimizer (with step.save_checkpoint)")
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != shape or md.properties.dtype != dtype:
            got = f"{md.properties.dtype}, shape {list(md.size)}" if isinstance(md, TensorStorageMetadata) else "a non-tensor value"
            raise CheckpointError(path, f"{key!r} is stored as {got}, expected {dtype}, shape {list(shape)} (the model and plan's)",
                                  fix="load a checkpoint saved from the same model and optimizer (with step.save_checkpoint)")


def _damaged(path: str, metadata: Any, deep: bool) -> list[str]:
    """The files of the checkpoint that miss bytes (``deep``: or hold an item that does not load)."""
    bad: set[str] = set()
    for item in pt.stored_items(metadata):
        if item.file in bad:
            continue
        name = os.path.join(path, item.file)
        if not os.path.exists(name) or os.path.getsize(name) < item.offset + item.length:
            bad.add(item.file)
        elif deep and not pt.item_is_readable(path, item):
            bad.add(item.file)
    return sorted(bad)


def _cause(e: BaseException) -> str:
    """The first line of what failed: for DCP's multi-rank exception, the first failing
    rank's own exception."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items())
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {_cause(inner)}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0].split('. ')[0]}" if text else type(e).__name__


def load_checkpoint(model: torch.nn.Module, optimizer: Any, checkpoint_id: str | os.PathLike) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into the distributed ``model``
    and ``optimizer``, all or nothing (see module doc); every rank calls it."""
    path = os.fspath(checkpoint_id)
    try:
        metadata = pt.read_checkpoint_metadata(path)
    except Exception as e:
        raise CheckpointError(path, f"its metadata ({os.path.join(path, '.metadata')}) cannot be read ({type(e).__name__}: {e})",
                              [".metadata"]) from e
    damaged = _damaged(path, metadata, deep=False)
    if damaged:
        raise CheckpointError(path, "shard files are shorter than the metadata says (truncated while writing or copying)", damaged)
    snapshot = _Snapshot(model, optimizer)
    try:
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer)
        else:
            msd, osd = get_state_dict(model, [])[0], {}
        live = {"model": msd, "optim": osd}
        fresh = _tree(empty_stored_layout, live)  # fused_shard tensors are stored in Shard layout (driver/fused_layout.py)
        _check_keys(pt.flatten_state(fresh), metadata, path)
        dcp.load(fresh, checkpoint_id=path)
        fresh = _back(fresh, live)
    except CheckpointError:
        snapshot.restore()
        raise
    except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException: it crosses ranks
        snapshot.restore()
        damaged = _damaged(path, metadata, deep=True)
        raise CheckpointError(path, f"reading it failed ({_cause(e)})", damaged) from e
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=fresh["model"],
                   optim_state_dict=fresh["optim"] if optimizer is not None else {})
    log.info("loaded checkpoint %s: %d tensors", path, sum(isinstance(v, (torch.Tensor, DTensor)) for v in pt.flatten_state(fresh).values()))


class DriverCheckpoints:
    """``step.save_checkpoint`` / ``step.load_checkpoint`` of a compiled step (a mixin of
    :class:`~spmd_compiler.driver.StepDriver`, which provides ``distribute``)."""

    def distribute(self, model: torch.nn.Module, optimizer: Any = None) -> None:  # provided by StepDriver
        raise NotImplementedError

    def save_checkpoint(self, model: torch.nn.Module, optimizer: Any, checkpoint_id: str | os.PathLike) -> None:
        """Save ``model``/``optimizer`` with torch.distributed.checkpoint, sharded as the
        plan says (every rank calls it; the model is distributed first if it is not yet)."""
        self.distribute(model, optimizer)
        save_checkpoint(unwrap_compiled(model), optimizer, checkpoint_id)

    def load_checkpoint(self, model: torch.nn.Module, optimizer: Any, checkpoint_id: str | os.PathLike) -> None:
        """Load a checkpoint of :meth:`save_checkpoint` all or nothing: read into fresh
        buffers laid out as the plan says (a checkpoint saved under another plan or mesh
        is resharded), checked, then swapped in. A damaged checkpoint raises
        :class:`~spmd_compiler.errors.CheckpointError` naming the files, with the model and
        optimizer unchanged. Every rank calls it, after building the model and optimizer
        and before the first step (or between steps)::

            step = spmd_compiler.compile(train_step, mesh=(world,), plan=plan)
            step.load_checkpoint(model, opt, "ckpt/step_1000")
        """
        self.distribute(model, optimizer)
        load_checkpoint(unwrap_compiled(model), optimizer, checkpoint_id)
