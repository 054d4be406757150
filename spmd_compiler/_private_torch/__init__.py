"""The one door to private torch APIs.

Everything spmd-compiler needs from torch internals is imported in this package and
wrapped in a small function with a stable signature, so a torch upgrade is one
package's work. Nothing else in spmd-compiler imports a ``torch.*._private`` name,
``torch.distributed.tensor._*`` module or ``torch._subclasses`` internals directly;
callers use ``from .. import _private_torch as pt`` and ``pt.X`` (every name below).

Submodules, by the torch internals they touch (each says which, and the torch versions
it was checked against, 2.13.0 and 2.14.1):

* :mod:`.dtensor`: DTensor specs and placements, sharding propagation and strategy
  selection, redistribution planning, DTensor's caches;
* :mod:`.dtensor_symbolic`: DTensor on symbolic sizes (dynamic=True): its size questions
  patched to ask no guard, the symbolic block-count placement;
* :mod:`.shapes`: ShapeEnv / SymInt / sympy helpers for symbolic sizes (dynamic=True)
  and real-value propagation;
* :mod:`.tracing`: fake modes, make_fx and fx node state, op schema facts, autograd
  hooks, inductor;
* :mod:`.devices`: tracing on ``meta`` for a target device (the Python meta kernels that
  hide an op's autograd, foreach clipping, SDPA's kernel: :mod:`.sdpa`);
* :mod:`.stack_traces`: make_fx's user stack traces from the live frames, symbolic
  powers without their runtime assert (trace time at scale);
* :mod:`.grouped_mm`: ``torch._grouped_mm`` (MoE experts) on CPU fake tensors, and the fix
  for the CUDA shape check's refusal;
* :mod:`.rows_exchange`: ``spmd_compiler::all_to_all_rows``, rows of data-dependent counts to
  every rank of a group (expert parallelism);
* :mod:`.optim`: a torch optimizer's lazy state created before its first step;
* :mod:`.distributed`: process group names, timeouts and store, pipelining schedules;
* :mod:`.dcp`: torch.distributed.checkpoint's stored items and key flattening;
* :mod:`.checkpointing`: activation checkpointing's regions and recomputation, marked while
  tracing, and selective checkpointing's per-node policy.

Submodules import one another only downwards (:mod:`.dtensor` uses :mod:`.dtensor_symbolic`,
both use :mod:`.shapes`);
module state (caches, registries, thread-locals) is defined once, in one submodule.
"""

from __future__ import annotations

from .dtensor import (
    DTensorSpec, TensorMeta, OpSchema, OutputSharding, MaskPartial, NormPartial, StridedShard, Partial,
    Placement, Replicate, Shard, Placements, TransformStep, StrategyCandidate, make_spec, propagate_sharding,
    transform_steps, local_shape_and_offset, custom_handled_ops, random_ops, register_symbolic_mode,
    clear_dtensor_caches, localized_shape_arg, symbolic_split, split_period,
)
from .shapes import (
    FakeTensor, FakeTensorMode, symbolic_fake_mode, to_symbolic_fake, size_hint, fake_mode_of, sym_expr, is_symbolic, sym_free_symbols,
    symbol_of, unbacked_symbols, shape_env_of, shape_env_guards, num_guards, symbol_range, example_values,
    replaced_symbols, is_pinned, new_size_symint, size_oblivious, true_unless_proven_false,
    false_unless_proven_true, definitely_contiguous, branch_atom, sympy_as_python, set_real_value, propagating_real_values,
    real_value_branches, is_real_value_log, fake_call,
)
from .tracing import (
    reparametrize_module, static_fake_mode, example_tensor, local_tensor, tracing_graph, traced_node_of, rename_node,
    preserve_node_meta, set_traced_module_stack, module_call_hooks, link_backward_to_forward, record_stack_traces_of, data_dependent_exceptions,
    batchnorm_base, is_view_op, written_args, writes_first_arg, raw_operator, mark_optimizer_stepped,
    inductor_compile, inductor_compile_symbolic, inductor_cache_counts, inductor_cache_dir,
    storage_owner, written_storages, compiled_original,
)
from .checkpointing import marked_checkpoints, selective_policy
from .dcp import StoredItem, flatten_state, item_is_readable, read_checkpoint_metadata, stored_items
from .devices import composite_autograd_on_meta, foreach_on_meta, meta_trace_for, sdpa_for_device, shadowed_composites
from .sdpa import sdpa_choice
from .grouped_mm import GROUPED_MM, explain_grouped_mm_error, grouped_mm_out_shape
from .rows_exchange import ALL_TO_ALL_ROWS, rows_exchange_inputs
from .optim import create_lazy_state
from .stack_traces import fast_stack_traces, unchecked_symbolic_pow
from .distributed import (
    world_info, group_name, set_group_timeout, default_store, pipeline_order, collectives_launched, drop_mesh_groups,
)

__all__ = [
    "create_lazy_state", "GROUPED_MM", "explain_grouped_mm_error", "grouped_mm_out_shape", "ALL_TO_ALL_ROWS", "rows_exchange_inputs",
    "fast_stack_traces", "unchecked_symbolic_pow",
    "composite_autograd_on_meta", "shadowed_composites", "foreach_on_meta", "sdpa_for_device", "meta_trace_for", "sdpa_choice",
    "DTensorSpec", "TensorMeta", "OpSchema", "OutputSharding", "MaskPartial", "NormPartial", "StridedShard", "symbolic_split", "split_period",
    "FakeTensor", "FakeTensorMode", "TransformStep", "StrategyCandidate", "make_spec", "propagate_sharding",
    "transform_steps", "local_shape_and_offset", "reparametrize_module", "symbolic_fake_mode",
    "to_symbolic_fake", "static_fake_mode", "size_hint", "example_tensor", "local_tensor",
    "custom_handled_ops", "random_ops", "tracing_graph", "traced_node_of", "group_name", "is_view_op", "written_args",
    "writes_first_arg", "Partial", "Placement", "Replicate", "Shard", "Placements", "world_info",
    "rename_node", "compiled_original", "preserve_node_meta", "set_traced_module_stack", "module_call_hooks", "fake_call", "link_backward_to_forward", "pipeline_order",
    "mark_optimizer_stepped", "clear_dtensor_caches", "localized_shape_arg", "raw_operator", "set_group_timeout", "default_store",
    "shape_env_of", "num_guards", "example_values", "replaced_symbols", "false_unless_proven_true", "definitely_contiguous",
    "true_unless_proven_false", "size_oblivious", "new_size_symint", "is_pinned", "register_symbolic_mode",
    "fake_mode_of", "sym_expr", "shape_env_guards", "symbol_range", "is_symbolic", "sym_free_symbols",
    "symbol_of", "unbacked_symbols", "branch_atom", "sympy_as_python", "set_real_value",
    "propagating_real_values", "real_value_branches", "is_real_value_log", "record_stack_traces_of",
    "data_dependent_exceptions", "batchnorm_base", "collectives_launched", "drop_mesh_groups", "inductor_compile", "inductor_compile_symbolic", "inductor_cache_counts", "inductor_cache_dir",
    "storage_owner", "written_storages", "marked_checkpoints", "selective_policy",
    "StoredItem", "flatten_state", "item_is_readable", "read_checkpoint_metadata", "stored_items",
]
