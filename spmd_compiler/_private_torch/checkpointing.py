"""Activation checkpointing (``torch.utils.checkpoint``) while a step is traced.

Touches ``torch.utils.checkpoint._CheckpointFrame`` (the non-reentrant checkpoint's
per-call record: ``save_inputs`` right before the region's forward runs,
``forward_completed`` set right after it, and the ``recompute_fn`` that backward runs on
the first unpack of a saved tensor), ``torch.utils.checkpoint.CheckpointFunction`` (the
reentrant checkpoint's autograd Function) and the ``node.meta["recompute"]`` policy that
selective checkpointing (``create_selective_checkpoint_contexts``) writes on the nodes a
tracer records under it, and ``torch.utils.checkpoint._VersionWrapper`` (the selective
cache's entry, whose version check is off while tracing, see :func:`marked_checkpoints`).
Checked against torch 2.13.0 and 2.14.1.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx as fx
import torch.utils.checkpoint as _ckpt

__all__ = ["marked_checkpoints", "selective_policy"]


@contextlib.contextmanager
def marked_checkpoints(mark: Callable[[str, int], None]) -> Iterator[None]:
    """While tracing: call ``mark(what, i)`` where the ``i``-th checkpointed region's
    forward starts (``"checkpoint"``) and ends (``"checkpoint_end"``), and where its
    recomputation in backward starts (``"recompute"``) and ends (``"recompute_end"``).
    All are outside the region's ``context_fn`` contexts, so a selective-checkpoint policy
    never sees them. A reentrant checkpoint (``use_reentrant=True``, which make_fx cannot
    trace: its output has no grad_fn) runs as the non-reentrant one, which computes the
    same gradients.

    Under a tracer, selective checkpointing caches every op's output and hands the cached
    values to the recomputation, refusing one an in-place op changed after it was cached
    (RMSNorm's composite: ``mean(...).add_(eps)``). The in-place op's own output is cached
    too, so the recomputation sees the final value, and the traced recomputation is rebuilt
    from the policy's tags anyway (``trace/checkpointing.py``): the check is off here."""
    ids = itertools.count()
    frame_cls = _ckpt._CheckpointFrame

    class _MarkedFrame(frame_cls):  # type: ignore[misc, valid-type]
        def __init__(self, recompute_fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
            self._spmd_region = region = next(ids)

            def marked(*inputs: Any) -> None:
                mark("recompute", region)
                try:
                    recompute_fn(*inputs)
                finally:  # early stop ends a recomputation with an exception
                    mark("recompute_end", region)

            super().__init__(marked, *args, **kwargs)

        def save_inputs(self, *args: Any) -> None:
            super().save_inputs(*args)
            mark("checkpoint", self._spmd_region)

        @property
        def forward_completed(self) -> bool:
            return self.__dict__.get("_spmd_forward_completed", False)

        @forward_completed.setter
        def forward_completed(self, value: bool) -> None:
            if value and "_spmd_region" in self.__dict__:
                mark("checkpoint_end", self._spmd_region)
            self.__dict__["_spmd_forward_completed"] = value

    reentrant = _ckpt.CheckpointFunction

    class _AsNonReentrant:
        @staticmethod
        def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            return _ckpt.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)

    get_val = _ckpt._VersionWrapper.get_val
    _ckpt._CheckpointFrame = _MarkedFrame  # type: ignore[misc]
    _ckpt.CheckpointFunction = _AsNonReentrant  # type: ignore[misc, assignment]
    _ckpt._VersionWrapper.get_val = lambda self, allow_cache_entry_mutation: get_val(self, True)  # type: ignore[method-assign]
    try:
        yield
    finally:
        _ckpt._CheckpointFrame = frame_cls  # type: ignore[misc]
        _ckpt.CheckpointFunction = reentrant  # type: ignore[misc]
        _ckpt._VersionWrapper.get_val = get_val  # type: ignore[method-assign]


def selective_policy(node: fx.Node) -> str | None:
    """What a selective-checkpoint policy decided for the op that made ``node``:
    ``"save"`` (``MUST_SAVE`` / ``PREFER_SAVE``), ``"recompute"`` (``MUST_RECOMPUTE`` /
    ``PREFER_RECOMPUTE``) or None (no policy). Under a tracer, torch's selective
    checkpointing saves every output and only records the policy on the node (for
    torch.compile's partitioner to act on)."""
    policy = node.meta.get("recompute")
    if not isinstance(policy, _ckpt.CheckpointPolicy):
        return None
    return "save" if policy in (_ckpt.CheckpointPolicy.MUST_SAVE, _ckpt.CheckpointPolicy.PREFER_SAVE) else "recompute"
