"""Tracing: fake modes and make_fx state, fx node and op schema facts, autograd and
module hooks, and inductor.

Touches ``torch._subclasses.fake_tensor`` (FakeTensorMode, data-dependent exceptions),
``torch.fx.experimental.proxy_tensor.get_proxy_mode`` and ``get_proxy_slot``, ``torch.fx.Node._rename``,
``torch.fx.traceback.preserve_node_meta`` and ``get_current_meta``, torch's global module hooks, ``torch.fx.proxy._register_stack_trace_anchor``,
``torch._functorch._aot_autograd.logging_utils``, ``torch.nn.utils.stateless._reparametrize_module``,
``torch.nn.modules.batchnorm._BatchNorm``, OpOverload's ``_schema`` / ``_op``,
``DTensor._local_tensor``, the optimizer's ``_opt_called`` flag, and
``torch._inductor.compile_fx`` (``compile_fx``, ``compile_fx_inner``) with dynamo/inductor configs
and counters, and for a symbolic compile ``ShapeEnv.create_symbol`` / ``create_symintnode``,
``DimDynamic``, ``var_to_range``, ``replacements``, ``guards`` and ``_config.backed_size_oblivious``.
Checked against torch 2.13.0 and 2.14.1 (the symbolic compile against 2.13.0 only).
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
    "preserve_node_meta", "set_traced_module_stack", "module_call_hooks", "link_backward_to_forward", "record_stack_traces_of", "data_dependent_exceptions",
    "batchnorm_base", "is_view_op", "written_args", "storage_owner", "written_storages", "compiled_original", "writes_first_arg", "raw_operator", "mark_optimizer_stepped",
    "inductor_compile", "inductor_compile_symbolic", "inductor_cache_counts", "inductor_cache_dir",
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



def traced_node_of(t: torch.Tensor) -> Any:
    """The fx node make_fx has recorded for tensor ``t`` right now (None outside a trace
    or for a tensor the trace does not track)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None or not isinstance(t, torch.Tensor):
        return None
    slot = get_proxy_slot(t, mode.tracer, None)
    proxy = getattr(slot, "proxy", None)
    return getattr(proxy, "node", None)


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



def set_traced_module_stack(stack: dict[str, tuple[str, str]] | None) -> None:
    """While make_fx traces under :func:`preserve_node_meta`: every node created from now
    on gets ``meta["nn_module_stack"] = stack`` (fx copies that field of its current node
    meta to each new node); None: no field."""
    import torch.fx.traceback as fx_traceback

    meta = fx_traceback.get_current_meta()
    if stack:
        meta["nn_module_stack"] = dict(stack)
    else:
        meta.pop("nn_module_stack", None)


def module_call_hooks(pre: Callable[..., Any], post: Callable[..., Any]) -> Any:
    """Install ``pre(module, args)`` / ``post(module, args, output)`` around every
    ``nn.Module`` call (torch's global module hooks; ``post`` runs even when forward
    raises); returns a callable that removes both."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True)]
    return lambda: [h.remove() for h in handles]



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



def compiled_original(module: Any) -> Any:
    """The module ``torch.compile(module)`` wrapped (dynamo's ``OptimizedModule`` keeps it
    as ``_orig_mod``), or None for a module torch.compile did not wrap."""
    if type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):
        return module._orig_mod
    return None


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



def storage_owner(node: Any) -> Any:
    """The fx node that owns ``node``'s storage: through every op whose result is a view
    of its first argument (``unsqueeze``, ``slice``, ``expand``, ``alias``...: a single
    return with a non-writing alias annotation in the op's schema)."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.args:
        returns = node.target._schema.returns
        alias = returns[0].alias_info if len(returns) == 1 else None
        if alias is None or alias.is_write or not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return node


def written_storages(graph: Any) -> set:
    """The owners (:func:`storage_owner`) of every tensor some op of the fx ``graph``
    writes in place (directly or through a view)."""
    out = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        for pos, name in written_args(n.target):
            arg = n.args[pos] if pos < len(n.args) else n.kwargs.get(name)
            for a in arg if isinstance(arg, (list, tuple)) else [arg]:
                if isinstance(a, torch.fx.Node):
                    out.add(storage_owner(a))
    return out



def writes_first_arg(op: Any) -> bool:
    """Whether ``op`` writes its first, positional argument in place and returns it
    (``add_``, ``copy_``, ``lerp_``): the in-place ops whose result aliases ``args[0]``."""
    written = written_args(op)
    return bool(written and written[0][0] == 0 and not op._schema.arguments[0].kwarg_only)



def raw_operator(target: Any) -> Any:
    """What calling ``target`` runs: an OpOverload's dispatcher handle (its ``__call__``
    forwards to it), any other callable itself."""
    from .rows_exchange import ALL_TO_ALL_ROWS, exchange_rows

    if target is ALL_TO_ALL_ROWS:  # our own op: its Python body, not torch.library's dispatch
        return exchange_rows
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
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    return _compile_fx(gm, fakes, vectorize=vectorize, overlap=overlap, cpp_wrapper=cpp_wrapper)


def _compile_fx(gm: "torch.fx.GraphModule", fakes: list[Any], *, vectorize: bool, overlap: bool, cpp_wrapper: bool,
                symbolic: bool = False) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch.fx.experimental import _config as shapes_config

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, fake in zip(placeholders, fakes):  # cpp_wrapper reads its inputs here: all of one fake mode
        if isinstance(fake, (torch.Tensor, torch.SymInt)):
            n.meta["val"] = fake
    patch: dict[str, Any] = {"size_asserts": False}
    if not vectorize:
        patch["cpp.simdlen"] = 1  # no ISA is 1 bit wide: scalar kernels
    def wrapped_inner(*args: Any, **kwargs: Any) -> Any:
        with torch._inductor.config.patch(cpp_wrapper=True):
            return compile_fx_inner(*args, **{**kwargs, "cpp_wrapper": True})

    inner: Callable[..., Any] = compile_fx_inner
    if cpp_wrapper and not symbolic:
        patch["cpp_wrapper"] = True
    elif cpp_wrapper:
        # compile_fx's cpp_wrapper entry replaces int inputs by None (symbolic ones too: "not
        # supported"); switched on for the inner compile only, the symbolic ints stay inputs
        inner = wrapped_inner
    if overlap:
        patch.update(_OVERLAP_CONFIG)
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch._inductor.config.patch(patch), \
            shapes_config.patch(backed_size_oblivious=symbolic), torch.no_grad():
        return compile_fx(gm, fakes, inner_compile=inner)


def inductor_compile_symbolic(gm: "torch.fx.GraphModule", example_inputs: Sequence[Any], templates: Sequence[Any], *,
                              vectorize: bool = True, overlap: bool = False,
                              cpp_wrapper: bool = False) -> tuple[Callable[..., Any], list[Any]]:
    """``gm`` compiled by inductor once for every value of some size symbols (``dynamic=True``),
    as :func:`inductor_compile` otherwise. ``templates`` says, per input: None (static, as
    :func:`inductor_compile`), a sympy symbol (an int input: that size, as a symbol), an int
    (an int input the graph no longer reads: the caller put it in its uses), or
    ``(shape, stride)`` (a tensor whose sizes and strides are those int/sympy expressions of
    the symbols). The symbols get fresh symbols of a ShapeEnv, with the example inputs'
    values as hints, and no 0/1 specialization; inductor then reasons size-obliviously.

    Returns ``(fn, guards)``: ``guards`` are the conditions on the symbols (sympy, in the
    templates' symbols) that inductor's decisions relied on (a size it made a constant, a
    branch on a hint): ``fn`` computes the right thing only for sizes that satisfy them all.
    Size asserts are off: the caller checks the inputs against the templates."""
    import sympy
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    shape_env = ShapeEnv(duck_shape=False, specialize_zero_one=False)
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
    fresh: dict[Any, Any] = {}  # template symbol -> its ShapeEnv symbol
    hints: dict[Any, Any] = {}  # ShapeEnv symbol -> example value
    fakes: list[Any] = list(example_inputs)
    for i, (x, t) in enumerate(zip(example_inputs, templates)):
        if isinstance(t, sympy.Symbol) and not isinstance(x, torch.Tensor):
            source = ConstantSource(f"spmd_size_{i}")
            sym = shape_env.create_symbol(int(x), source, dynamic_dim=DimDynamic.DYNAMIC)
            if isinstance(sym, sympy.Symbol):
                fresh[t], hints[sym] = sym, sympy.Integer(int(x))
            fakes[i] = shape_env.create_symintnode(sym, hint=int(x), source=source)

    for i, t in enumerate(templates):
        if isinstance(t, int) and not isinstance(example_inputs[i], torch.Tensor):
            fakes[i] = t  # a constant the caller put in the graph's uses

    def symint(expr: Any) -> Any:
        e = sympy.sympify(expr).xreplace(fresh)
        if not e.free_symbols:
            return int(e)
        return shape_env.create_symintnode(e, hint=int(e.xreplace(hints)))

    for i, (x, t) in enumerate(zip(example_inputs, templates)):
        if not isinstance(x, torch.Tensor):
            continue
        if t is None:
            fakes[i] = mode.from_tensor(x, static_shapes=True)
        else:
            with mode:
                fakes[i] = torch.empty_strided([symint(e) for e in t[0]], [symint(e) for e in t[1]], dtype=x.dtype,
                                               device=x.device)
    fn = _compile_fx(gm, fakes, vectorize=vectorize, overlap=overlap, cpp_wrapper=cpp_wrapper, symbolic=True)
    back = {v: k for k, v in fresh.items()}
    guards = [g.expr for g in shape_env.guards]
    guards += [sympy.Eq(s, r) for s, r in shape_env.replacements.items() if s in back and s != r]
    for s in back:
        vr = shape_env.var_to_range.get(s)
        if vr is not None and isinstance(vr.lower, sympy.Integer) and vr.lower > 0:  # torch's int_oo is no Integer
            guards.append(s >= int(vr.lower))
        if vr is not None and isinstance(vr.upper, sympy.Integer):
            guards.append(s <= int(vr.upper))
    return fn, [sympy.sympify(g).xreplace(back) for g in guards]


def inductor_cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX graph cache in this process so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def inductor_cache_dir() -> str:
    """The folder inductor writes its generated code under (``$TORCHINDUCTOR_CACHE_DIR``
    or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()
