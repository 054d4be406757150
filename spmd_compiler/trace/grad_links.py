"""Which parameter each traced gradient belongs to: ``node.meta["spmd_grad_of"]``.

A rule that reads a gradient before the optimizer does (``clip_grad_norm_``'s norms) may
need the layout of its parameter: under FSDP the gradient should be reduced to the
parameter's shard (a reduce_scatter), not all-reduced whole. While the step is traced, a
post-accumulate-grad hook on every parameter tags the fx node that ``p.grad`` is once
backward has accumulated into it (with gradients kept across calls, the node after the
accumulation), with the parameter's name. Tags are hints: a node without one is treated
as any other value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .. import _private_torch as pt

__all__ = ["GRAD_OF", "gradient_links"]

GRAD_OF = "spmd_grad_of"


@contextlib.contextmanager
def gradient_links(params: dict[str, torch.Tensor]) -> Iterator[None]:
    """Tag ``p.grad``'s traced node with ``GRAD_OF = name`` each time backward accumulates
    into parameter ``name`` (``params``: name -> the traced parameter tensor)."""

    def tag(name: str):
        def hook(p: torch.Tensor) -> None:
            node = pt.traced_node_of(p.grad)
            if node is not None:
                node.meta[GRAD_OF] = name
        return hook

    handles = [p.register_post_accumulate_grad_hook(tag(n)) for n, p in params.items() if p.requires_grad]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
