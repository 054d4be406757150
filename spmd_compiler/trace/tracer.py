"""Trace a training step ``step_fn(model, optimizer, *batch)`` into one fx graph.

The step runs once under ``make_fx`` in symbolic mode: forward, loss, ``backward()``,
``optimizer.step()`` and ``zero_grad()`` all land in a single aten-level graph whose
inputs are the parameters, buffers, optimizer state and batch tensors (each placeholder
named after what it holds) and whose outputs are the step's return value followed by the
updated state. Sizes stay symbolic so that expansion can tell which size came from which
tensor dim (see :class:`spmd_compiler.expand.DSymInt`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from .checkpointing import recompute_selected
from .decompositions import decomposition_table
from .host_values import HostSnapshot, as_data_dependent_error, check_data_dependent_shapes, user_outputs, with_batch_sizes_named
from .grad_links import gradient_links
from .modules import module_stacks
from .markers import phase_markers, recompute_markers, refuse_scheduler_steps, split_point_hooks, tag_phases
from .rewrites import contiguous_copies_written, symbolic_size_rewrites, traceable_scalars
from .rng import RngLedger, replay_recomputed_draws, rng_replay
from .state import collect_state, hparam_tensor, swapped_state
from .traced import CONSTANT_LEAF_TYPES, GraphInput, GraphOutput, TracedStep, flatten_batch
from .value_guards import attach_values, host_scalar_values, is_host_scalar_input, value_guards_of

__all__ = ["GraphInput", "GraphOutput", "TracedStep", "trace", "CONSTANT_LEAF_TYPES"]

log = logging.getLogger(__name__)

_DROP_TARGETS = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def _safe_name(text: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", text).strip("_")


@contextlib.contextmanager
def _mixed_precision(model: torch.nn.Module, policy: Any) -> Iterator[None]:
    """Mixed precision, as FSDP2 does it: while a module's forward runs (the recomputation
    of a checkpointed one included), its own parameters are their casts to ``param_dtype``;
    outside it they are the parameters themselves, so code after ``backward()``
    (``clip_grad_norm_(model.parameters())``) sees them and their gradients. The root's
    floating inputs are cast too."""
    if policy is None or policy.param_dtype is None:
        yield
        return
    saved: dict[int, list[dict[str, Any]]] = {}

    def before(module: torch.nn.Module, args: tuple) -> None:
        own = dict(module._parameters)
        saved.setdefault(id(module), []).append(own)
        module._parameters.update(policy.cast({n: p for n, p in own.items() if p is not None}))

    def after(module: torch.nn.Module, args: tuple, output: Any) -> None:
        stack = saved.get(id(module))
        if stack:
            module._parameters.update(stack.pop())

    owners = [m for m in model.modules() if any(p is not None for p in m._parameters.values())]
    handles = [model.register_forward_pre_hook(policy.cast_inputs, with_kwargs=True)]
    for m in owners:
        handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in owners:
            for own in reversed(saved.get(id(m), [])):
                m._parameters.update(own)


def trace(
    step_fn: Callable[..., Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *batch: Any,
    symbolic: str = "batch",
    split_points: dict[str, Any] | None = None,
    symbolic_dims: dict[int, tuple[int, ...]] | None = None,
    fused_optimizer: bool = True,
    dynamic: bool = False,
    device_type: str | None = None,
    mixed_precision: Any = None,
    **batch_kwargs: Any,
) -> TracedStep:
    """Trace ``step_fn(model, optimizer, *batch, **batch_kwargs)`` into a :class:`TracedStep`.

    ``step_fn`` is an ordinary single-device training step (forward, loss,
    ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``). Nothing is
    computed: the model, optimizer and batch are only read for shapes and structure, and
    are left as they were. Optimizer state that does not exist yet (Adam before its
    first step) is created inside the graph and returned as outputs.

    ``symbolic`` chooses which sizes are traced as symbols (and so become
    :class:`~spmd_compiler.expand.DSymInt` during expansion): ``"batch"`` (default) the
    batch tensors' dims, ``"all"`` parameter and state dims too (2-3x slower to trace;
    lets factory ops sized by a sharded parameter dim be built sharded), ``"none"`` no
    symbols (fastest; sizes are constants, so factory ops are never built sharded).

    ``symbolic_dims`` (``{batch leaf index: dims}``) narrows ``"batch"`` to those dims
    of those leaves (:func:`spmd_compiler.compile` passes the dims the plan shards, and
    under ``dynamic=True`` dim 0 only, see ``driver.batch.sharded_batch_dims``; the
    others have equal global and local sizes, and every symbol makes the trace slower).

    ``split_points`` (``{module FQN: SplitPoint}``) inserts pipeline stage boundaries
    at the beginning or end of those modules' forward, like ``pipe_split()`` calls.

    ``fused_optimizer=False`` traces a ``fused=True`` optimizer with its per-parameter
    update (pipelines do: each stage updates its own parameters, and a fused kernel over
    all of them would span stages).

    ``dynamic=True`` keeps a batch size of 0 or 1 symbolic as well (torch otherwise makes
    it a constant and assumes the others are at least 2), so a program compiled with
    ``compile(dynamic=True)`` can serve it; a branch on such a size is a guard.

    ``device_type`` ("cpu", "cuda") is the device the program is for, when the model
    and batch are on ``meta``: SDPA is traced as the fused kernel that device runs
    (``_private_torch/sdpa.py``; None: the math decomposition ``meta`` itself takes). On
    ``meta``, composite ops keep their autograd and foreach gradient clipping works as on
    a real device, whatever ``device_type``.

    ``mixed_precision`` (a :class:`~spmd_compiler.MixedPrecisionPolicy`): while the model's
    forward runs, every floating parameter is its cast to ``param_dtype`` (cast when the
    forward starts) and its floating inputs are cast; the optimizer, and any code outside
    the forward, see the parameters themselves.

    Example::

        traced = spmd_compiler.trace(train_step, model, opt, x, y)
        traced.gm.print_readable()
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
    state = collect_state(model, optimizer)
    if mixed_precision is not None:
        mixed_precision.check(state.params)
    leaves, batch_spec, paths = flatten_batch(batch, batch_kwargs)

    inputs: list[GraphInput] = []
    real: list[torch.Tensor] = []

    def add(kind: str, name: str, t: torch.Tensor, key: str | None = None, index: int | None = None) -> None:
        t = pt.example_tensor(t)
        inputs.append(
            GraphInput(kind, name, tuple(t.shape), tuple(t.stride()), t.dtype, key, index, bool(t.requires_grad), t.device)
        )
        real.append(t)

    for n, p in state.params.items():
        add("param", n, p)
    for n, b in state.buffers.items():
        add("buffer", n, b)
    optim_tensor_keys = state.tensor_optim_keys()
    for n, k in optim_tensor_keys:
        add("optim", n, state.optim[(n, k)], key=k)
    grads_in = [n for n, p in state.params.items() if p.grad is not None]  # accumulated by earlier calls
    for n in grads_in:
        add("grad", n, state.params[n].grad)
    lifted = state.lifted_hparams()
    for g, k in lifted:
        add("hparam", f"param_groups[{g}]", hparam_tensor(state.hparams[(g, k)]), key=k)
    batch_constants: dict[int, Any] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            add("batch", paths[i], leaf, index=i)
        else:
            batch_constants[i] = leaf

    if symbolic not in ("batch", "all", "none"):
        raise ValueError(f"symbolic must be 'batch', 'all' or 'none', got {symbolic!r}")
    mode = pt.symbolic_fake_mode(specialize_zero_one=not dynamic)
    fakes = []
    for inp, t in zip(inputs, real):
        dims: bool | tuple[int, ...] = symbolic == "all" or (symbolic == "batch" and inp.kind == "batch")
        if symbolic == "batch" and inp.kind == "batch" and symbolic_dims is not None:
            dims = tuple(symbolic_dims.get(inp.index, ()))
        with pt.size_oblivious(dynamic):
            fake = pt.to_symbolic_fake(mode, t, inp.label, dynamic=dims)
        if t.requires_grad and inp.kind == "param":
            fake.requires_grad_(True)
        fakes.append(fake)
    if dynamic:
        _same_batch_size(inputs, fakes)

    # host scalars (lifted hyperparameters, 0-d optimizer state) carry their real values
    # through optimizer.step(), so its branches on them are taken (trace/value_guards.py)
    scalars = {
        i: v.detach().clone() for i, v in (
            (i, t if inp.kind == "hparam" else pt.local_tensor(state.optim[(inp.name, inp.key)]))
            for i, (inp, t) in enumerate(zip(inputs, real)) if is_host_scalar_input(inp)
        ) if v.device.type == "cpu"  # a value we can read without a device sync (not on meta)
    }
    n_params, n_buffers = len(state.params), len(state.buffers)
    n_optim, n_grads, n_hparams = len(optim_tensor_keys), len(grads_in), len(lifted)
    # foreach optimizers are traced with their per-parameter implementation (the same
    # update; on CPU the foreach kernels loop over tensors anyway). Fused ones keep their
    # one-kernel update (expand/rules/optimizers.py), reading a group's lr as a tensor.
    per_parameter = ("foreach",) if fused_optimizer else ("foreach", "fused")
    cycled = {g for g, _ in state.cycling}  # fused groups whose momentum / betas a scheduler changes: per-parameter
    multi_tensor = [(g, k) for (g, k), v in state.hparams.items() if (k in per_parameter or k == "fused" and g in cycled) and v]
    fused_groups = {g for (g, k), v in state.hparams.items() if k == "fused" and v and fused_optimizer and g not in cycled}
    if multi_tensor:
        log.info("tracing the optimizer's per-parameter implementation instead of %s", ", ".join(f"param_groups[{g}][{k!r}]=True" for g, k in multi_tensor))
    layout: dict[str, Any] = {}
    read_values: dict[tuple[int, str], Any] = {}  # what the optimizer read for each lifted hparam

    def functional_step(*flat: torch.Tensor) -> list[Any]:
        attach_values(flat, scalars)
        params = dict(zip(state.params, flat[:n_params]))
        buffers = dict(zip(state.buffers, flat[n_params : n_params + n_buffers]))
        optim = {k: v for k, v in state.optim.items() if not isinstance(v, torch.Tensor)}
        start = n_params + n_buffers + n_optim
        optim.update(zip(optim_tensor_keys, flat[n_params + n_buffers : start]))
        for n, g in zip(grads_in, flat[start : start + n_grads]):
            params[n].grad = g  # backward() accumulates into it, as on one device
        start += n_grads
        # numbers are read out with .item() when the optimizer step starts: its
        # arithmetic stays scalar, and the read belongs to the optimizer phase
        hparams = {
            key: (lambda t=t: t) if isinstance(state.hparams[key], torch.Tensor) or key[0] in fused_groups
            else (lambda t=t: tuple(t[i].item() for i in range(t.shape[0]))) if t.dim() == 1  # betas
            else (lambda t=t: t.item())
            for key, t in zip(lifted, flat[start : start + n_hparams])
        }
        hparams = {key: _recording(key, make, read_values) for key, make in hparams.items()}
        hparams.update({key: (lambda: False) for key in multi_tensor})
        batch_leaves = list(leaves)
        it = iter(flat[start + n_hparams :])
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                batch_leaves[i] = next(it)
        b_args, b_kwargs = pytree.tree_unflatten(batch_leaves, batch_spec)
        with swapped_state(model, optimizer, state, params, buffers, optim, hparams) as ctx, gradient_links(params), \
                _mixed_precision(model, mixed_precision):
            result = step_fn(model, optimizer, *b_args, **b_kwargs)
            final_buffers = {n: _module_tensor(model, n) for n in state.buffers}
            final_optim = ctx["optim_state"]()
        grads_left = [n for n, p in params.items() if p.grad is not None]
        user_leaves, user_spec = pytree.tree_flatten(result)
        outs, user_indices, constants, numbers, attrs = user_outputs(user_leaves, read_values, state.hparams, host.stored_numbers())
        descr = [GraphOutput("user", index=i) for i in user_indices]
        for n, p in params.items():
            outs.append(p)
            descr.append(GraphOutput("param", n))
        for n, b in final_buffers.items():
            outs.append(b)
            descr.append(GraphOutput("buffer", n))
        for n in grads_left:  # gradients the next call starts from (accumulation across calls)
            outs.append(params[n].grad)
            descr.append(GraphOutput("grad", n))
        new_keys = []
        for (n, k), v in final_optim.items():
            if isinstance(v, torch.Tensor):
                outs.append(v)
                descr.append(GraphOutput("optim", n, key=k))
                if (n, k) not in optim_tensor_keys:
                    new_keys.append((n, k))
        layout.update(descr=descr, spec=user_spec, constants=constants, new_keys=new_keys, grads_left=grads_left, numbers=numbers, attrs=attrs)
        return outs

    start = time.perf_counter()
    host = HostSnapshot(model, optimizer)
    modes_before = [m.training for m in model.modules()]
    ledger = RngLedger()
    pt.record_stack_traces_of(step_fn)  # the step's own lines (loss, `if`, .item()) get a user line
    rewrites = symbolic_size_rewrites(dynamic)
    try:
        with phase_markers(optimizer), pt.preserve_node_meta(), module_stacks(model), split_point_hooks(model, split_points), \
                host_scalar_values(mode, optimizer, bool(scalars)), traceable_scalars(), rng_replay(ledger), \
                pt.size_oblivious(dynamic), rewrites, refuse_scheduler_steps(), recompute_markers(), \
                pt.meta_trace_for(device_type, enabled=any(t.device.type == "meta" for t in real)), \
                pt.fast_stack_traces(), pt.unchecked_symbolic_pow():
            gm = make_fx(
                functional_step,
                decomposition_table=decomposition_table(),
                tracing_mode="symbolic",
                record_stack_traces=True,
            )(*fakes)
    except pt.data_dependent_exceptions() as e:
        host.restore_symbols()
        raise as_data_dependent_error(e) from e
    except (ValueError, RuntimeError, IndexError, TypeError) as e:
        host.restore_symbols()
        if not torch.is_grad_enabled() and "does not require grad" in str(e):
            raise ValueError(
                f"the step's backward() found nothing to differentiate ({str(e).strip().splitlines()[0]}): the step was "
                f"called with grad disabled (inside torch.no_grad() or torch.inference_mode()), as one device would raise "
                f"too. fix: call the training step outside torch.no_grad(); an evaluation step without backward() may run "
                f"under it"
            ) from e
        fix = pt.explain_grouped_mm_error(e)
        if fix is not None:
            raise TypeError(f"{fix}{_user_frame(e)}\n  torch said: {str(e).strip().splitlines()[0]}") from e
        named = with_batch_sizes_named(e, inputs, fakes, real)
        if named is None:
            raise
        raise named from e
    except BaseException:
        host.restore_symbols()
        raise
    elapsed = time.perf_counter() - start
    with pt.size_oblivious(dynamic):  # its contiguity questions must not guard either
        aliased = contiguous_copies_written(rewrites, gm)  # dynamic=True: per shape after all (see rewrites.py)
    host.check(gm, stored=set(layout.get("attrs", {}).values()))
    check_data_dependent_shapes(gm)
    value_guards = value_guards_of(gm, mode, inputs)  # before dead code goes: a read may only feed a branch

    replay_recomputed_draws(gm, ledger)
    tag_phases(gm)
    recomputed = recompute_selected(gm)  # selective activation checkpointing's policy
    if recomputed:
        log.info("selective activation checkpointing: %d forward nodes recomputed in backward", recomputed)
    _cleanup(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # make_fx makes one placeholder per argument of functional_step, in order; from here
    # on every stage finds an input by its name (node.meta["spmd_input"])
    assert len(placeholders) == len(inputs), (len(placeholders), len(inputs))
    for node, inp in zip(placeholders, inputs):
        prefix = {"param": "p", "buffer": "b", "optim": "o", "grad": "g", "hparam": "h", "batch": "in"}[inp.kind]
        pt.rename_node(node, f"{prefix}_{_safe_name(inp.label)}")
        node.meta["spmd_input"] = inp
    gm.recompile()
    log.info("traced step: %d nodes in %.2fs", len(gm.graph.nodes), elapsed)
    traced = TracedStep(
        gm=gm,
        inputs=inputs,
        outputs=layout["descr"],
        user_spec=layout["spec"],
        user_constants=layout["constants"],
        batch_spec=batch_spec,
        batch_constants=batch_constants,
        state=state,
        new_optim_keys=layout["new_keys"],
        grads_in=tuple(grads_in),
        grads_left=tuple(layout["grads_left"]),
        trace_seconds=elapsed,
        model=model,
        value_guards=value_guards,
        host_numbers=layout["numbers"],
        host_attributes=layout["attrs"],
        mode_writes=tuple((i, m.training) for i, (m, was) in enumerate(zip(model.modules(), modes_before)) if m.training != was),
    )
    if aliased:
        traced.dynamic_fallback = aliased  # type: ignore[attr-defined]
    return traced


def _recording(key: tuple[int, str], make: Callable[[], Any], read: dict) -> Callable[[], Any]:
    def install() -> Any:
        read[key] = value = make()
        return value

    return install


def _module_tensor(model: torch.nn.Module, fqn: str) -> torch.Tensor:
    mod_path, _, attr = fqn.rpartition(".")
    mod = model.get_submodule(mod_path) if mod_path else model
    return getattr(mod, attr)


def _cleanup(gm: fx.GraphModule) -> None:
    """Drop profiler markers and dead code left by the trace."""
    g = gm.graph
    for node in reversed(list(g.nodes)):
        if node.op == "call_function" and node.target in _DROP_TARGETS:
            for user in list(node.users):
                g.erase_node(user)
            g.erase_node(node)
    g.eliminate_dead_code()
    g.lint()


def _same_batch_size(inputs: list[GraphInput], fakes: list[Any]) -> None:
    """One symbol for the batch size of every batch tensor of the same example size
    (``input_ids``, ``attention_mask``, ``labels``): each gets its own symbol, and a model
    that views one by another's size (GPT-2's ``attention_mask.view(batch_size, -1)``)
    would otherwise divide one symbol by another, which no sharding rule can read. The
    equality is a guard, so a later call whose leaves differ in batch size gets a program
    of its own, never a wrong one."""
    first: dict[int, Any] = {}
    for inp, fake in zip(inputs, fakes):
        if inp.kind != "batch" or fake.dim() == 0 or not pt.is_symbolic(fake.shape[0]):
            continue
        size = fake.shape[0]
        seen = first.setdefault(pt.size_hint(size), size)
        if seen is not size:
            torch._check(size == seen)


def _user_frame(e: BaseException) -> str:
    """``\n  user code: file:line in fn`` of the innermost frame of ``e``'s traceback
    outside torch and spmd_compiler (the model's line that called the op), or ""."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/torch/" not in f.filename and "/spmd_compiler/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"\n  user code: {f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
