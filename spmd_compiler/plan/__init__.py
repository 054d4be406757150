"""Plans: where each parameter, buffer, optimizer state and batch input lives on the mesh.

A plan maps FQN patterns to placements (one per mesh axis, torch's ``Shard``,
``Replicate``, ``Partial``) or to a ``torch.distributed.tensor.parallel`` style keyed by
module FQN. Optimizer state follows its parameter. Batch inputs are each rank's local
shard, as in DDP, and default to ``Shard(0)`` on the first mesh axis.

Examples (1-D mesh)::

    Plan(params={"l1.*": [Shard(0)], "l2.weight": [Shard(1)]}, default_input=[Replicate()])  # Megatron MLP
    Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",))  # FSDP: stored sharded, gathered for compute
    Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",), reshard_after_forward=False)  # gathered once, kept for backward
"""

from .placements import PlacementsLike, ResolvedPlan, fused_shard, normalize_placements
from .resolve import (
    _batch_placements,
    _check_dims,
    _fit_wildcard,
    _fsdp_buffer,
    _has_dim,
    _is_style,
    _near,
    _resolve,
    _style_axis,
    _style_params,
)
from .context import ContextParallel, CPLayout, head_tail_index
from .precision import MixedPrecisionPolicy
from .spec import Plan

__all__ = ["Plan", "ContextParallel", "CPLayout", "MixedPrecisionPolicy", "ResolvedPlan", "fused_shard", "head_tail_index", "normalize_placements"]

# the helpers below lived in this module before it became a package; still importable
_MOVED = (PlacementsLike, _batch_placements, _check_dims, _fit_wildcard, _fsdp_buffer, _has_dim, _is_style, _near,
          _resolve, _style_axis, _style_params)
