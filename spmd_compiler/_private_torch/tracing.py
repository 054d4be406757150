"""Tracing: fake modes and make_fx state, fx node and op schema facts, autograd and
module hooks, and inductor.

Touches ``torch._subclasses.fake_tensor`` (FakeTensorMode, data-dependent exceptions),
``torch.fx.experimental.proxy_tensor.get_proxy_mode``, ``torch.fx.Node._rename``,
``torch.fx.traceback.preserve_node_meta``, ``torch.fx.proxy._register_stack_trace_anchor``,
``torch._functorch._aot_autograd.logging_utils``, ``torch.nn.utils.stateless._reparametrize_module``,
``torch.nn.modules.batchnorm._BatchNorm``, OpOverload's ``_schema`` / ``_op``,
``DTensor._local_tensor``, the optimizer's ``_opt_called`` flag, and
``torch._inductor.compile_fx`` with dynamo/inductor configs and counters. Checked against torch 2.13.0 and 2.14.1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = [
    "reparametrize_module", "static_fake_mode", "example_tensor", "local_tensor", "tracing_graph", "rename_node",
    "preserve_node_meta", "link_backward_to_forward", "record_stack_traces_of", "data_dependent_exceptions",
    "batchnorm_base", "is_view_op", "written_args", "writes_first_arg", "raw_operator", "mark_optimizer_stepped",
    "inductor_compile", "inductor_cache_counts", "inductor_cache_dir",
]


def reparametrize_module(module: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """Context manager: swap ``module``'s parameters and buffers by FQN, ties kept."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=True, strict=False)



def static_fake_mode() -> FakeTensorMode:
    """A fake mode with static shapes, for per-rank local tensors during expansion."""
    return FakeTensorMode(allow_non_fake_inputs=True)



def example_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor with ``t``'s global metadata, for tracing.

    A DTensor becomes an uninitialized tensor of its global shape on its local device
    (its pages are never touched, so no memory is committed); other tensors are detached.
    Parameters keep ``requires_grad``.
    """
    if isinstance(t, DTensor):
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return out.requires_grad_(t.requires_grad) if t.requires_grad else out
    if isinstance(t, torch.nn.Parameter):
        return t
    return t.detach()



def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (no autograd), or ``t`` itself."""
    if isinstance(t, DTensor):
        return t._local_tensor
    return t



def tracing_graph() -> Any:
    """The fx graph make_fx is building right now (None outside a trace)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph



def rename_node(node: "torch.fx.Node", name: str) -> None:
    """Give ``node`` a readable unique name (placeholders keep target == name)."""
    node._rename(name)
    if node.op == "placeholder":
        node.target = node.name



def preserve_node_meta():
    """Context manager: make_fx records ``seq_nr`` (the autograd sequence number of the
    forward op) on every node, and backward nodes get their forward op's number."""
    import torch.fx.traceback as fx_traceback

    return fx_traceback.preserve_node_meta()



def link_backward_to_forward(loss: torch.Tensor) -> None:
    """Before ``loss.backward()`` while tracing: hook every autograd node reachable from
    ``loss`` so the nodes traced while it runs carry its forward op's ``seq_nr`` (and
    stack trace), as AOTAutograd does."""
    if loss.grad_fn is None:
        return
    from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks

    setup_stacktrace_preservation_hooks([loss.grad_fn])



def record_stack_traces_of(fn: Any) -> None:
    """Make make_fx record ``fn``'s frames in ``node.meta["stack_trace"]`` (by default it
    keeps only frames of ``forward`` methods, so the training step's own lines, its loss
    and ``if`` on tensors, would have no user line)."""
    from torch.fx.proxy import _register_stack_trace_anchor

    import inspect

    _register_stack_trace_anchor(inspect.unwrap(fn))



def data_dependent_exceptions() -> tuple[type[BaseException], ...]:
    """What fake tracing raises when the step's Python code or an op's output shape
    depends on tensor values (a branch on a tensor, a boolean-mask index)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (GuardOnDataDependentSymNode, DynamicOutputShapeException, DataDependentOutputException)



def batchnorm_base() -> type:
    """The base class of BatchNorm1d/2d/3d (whose ``forward`` handles ``momentum=None``)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm



def is_view_op(op: Any) -> bool:
    schema = getattr(op, "_schema", None)
    return bool(schema is not None and schema._is_view_op())



@functools.lru_cache(maxsize=None)
def written_args(op: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of every argument ``op``'s schema marks as written in place
    (``Tensor(a!) self``, ``Tensor(a!)[] exp_avgs``, ``Tensor(a!) out``); empty for
    anything that is not an OpOverload."""
    if not isinstance(op, torch._ops.OpOverload):
        return ()
    return tuple(
        (i, a.name) for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )



def writes_first_arg(op: Any) -> bool:
    """Whether ``op`` writes its first, positional argument in place and returns it
    (``add_``, ``copy_``, ``lerp_``): the in-place ops whose result aliases ``args[0]``."""
    written = written_args(op)
    return bool(written and written[0][0] == 0 and not op._schema.arguments[0].kwarg_only)



def raw_operator(target: Any) -> Any:
    """What calling ``target`` runs: an OpOverload's dispatcher handle (its ``__call__``
    forwards to it), any other callable itself."""
    if isinstance(target, torch._ops.OpOverload):
        return target._op
    return target



def mark_optimizer_stepped(optimizer: Any) -> None:
    """Tell LR schedulers that ``optimizer.step()`` ran (the compiled graph ran it): they
    check this private flag and warn about a scheduler step before the optimizer's."""
    if optimizer is not None:
        optimizer._opt_called = True



# Inductor's scheduler, left to itself, undoes the schedule pass's overlap: its peak-memory
# reordering moves the weight-gradient matmuls ahead of a backward all_reduce's launch, and
# each wait_tensor lands right after its launch. Without that pass and with its "sink_waits"
# (no runtime estimates, so every rank orders its program the same way), the graph's order
# stays and each wait moves down to its first consumer.
_OVERLAP_CONFIG = {
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits"],
}


def inductor_compile(gm: "torch.fx.GraphModule", example_inputs: Sequence[Any], *, vectorize: bool = True,
                     overlap: bool = False, cpp_wrapper: bool = False) -> Callable[..., Any]:
    """``gm`` compiled by inductor (through AOTAutograd, which functionalizes its in-place
    ops and writes mutated inputs back), specialized to the shapes of ``example_inputs``
    (real tensors and ints; nothing is run). The result is called with the inputs unboxed.

    The example inputs are fakeified in a fake mode with a ShapeEnv and static shapes, so
    an ``.item()`` left in the graph becomes an unbacked symbol rather than an error.
    Compiled graphs go through inductor's FX graph cache (on disk, shared across processes).
    ``vectorize=False`` makes the C++ backend emit scalar loops (no SIMD ISA), a way
    around its vectorizer's failures. ``overlap=True`` keeps the graph's collective/compute
    overlap in the generated code (``_OVERLAP_CONFIG``): launches where the graph has
    them, each wait just before its first consumer. ``cpp_wrapper=True``: the code that calls
    the kernels, extern matmuls and collectives is C++ too (inductor's ``cpp_wrapper``), not a
    Python function: about 1 ms less Python per call of a TP GPT step on CPU, at a longer first
    compile. Inductor's size and stride asserts on the inputs are off: callers compile once per
    input shape and stride (runtime/inductor.py keys on them).
    """
    from torch._inductor.compile_fx import compile_fx

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, fake in zip(placeholders, fakes):  # cpp_wrapper reads its inputs here: all of one fake mode
        if isinstance(fake, torch.Tensor):
            n.meta["val"] = fake
    patch: dict[str, Any] = {"size_asserts": False}
    if not vectorize:
        patch["cpp.simdlen"] = 1  # no ISA is 1 bit wide: scalar kernels
    if cpp_wrapper:
        patch["cpp_wrapper"] = True
    if overlap:
        patch.update(_OVERLAP_CONFIG)
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch._inductor.config.patch(patch), torch.no_grad():
        return compile_fx(gm, fakes)



def inductor_cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX graph cache in this process so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def inductor_cache_dir() -> str:
    """The folder inductor writes its generated code under (``$TORCHINDUCTOR_CACHE_DIR``
    or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()
