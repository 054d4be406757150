"""Stage 2: expand a traced step over a DeviceMesh into one per-rank graph.

The expander walks the traced graph in order. Placeholders become local tensors with
the plan's placements; sizes become :class:`DSymInt`; every aten op becomes a recipe
(DTensor's sharding propagation, or a registered rule) that is spliced into the per-rank
graph (:mod:`.recipes`). Recipes are memoized (:mod:`.cache`). The traced outputs are handed to
:mod:`spmd_compiler.rebuild` to finish the graph.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from .tree import leaves, tree_map

from .. import _private_torch as pt
from ..errors import SpmdError, add_context, describe_node
from . import experts, orders, positions
from .advice import log_advice
from .builder import local_fake
from .cache import ExpansionCache
from ..trace.markers import MARKER
from .fsdp import fsdp_cast, fsdp_gathered, is_precision_cast, regathered_view
from .recipes import expand_node
from .symbolic import LocalSizes, size_symbols_of, symbolic_local_shape, symint_of, trace_fake_mode
from .values import DSymInt, DValue, MeshContext, RScalar, placements_text, sym_apply

__all__ = ["expand_graph", "Expansion", "ExpansionStats"]

log = logging.getLogger(__name__)
aten = torch.ops.aten

_SIZE_FUNCS = {
    operator.mul, operator.add, operator.sub, operator.floordiv, operator.truediv, operator.mod,
    operator.neg, operator.pow, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
    operator.ge, operator.and_, operator.or_, math.ceil, math.floor, math.sqrt,
    torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_sum,
}
_DROPPED = {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default}


@dataclass
class ExpansionStats:
    """Counters and timings of one expansion."""

    nodes: int = 0
    ops: int = 0
    seconds: float = 0.0
    cache: dict = field(default_factory=dict)
    coord_dependent: bool = False
    fallbacks: list = field(default_factory=list)


_FIX = (
    "change the placements the plan gives the values above (Plan(params=..., inputs=...)), e.g. Replicate() on "
    "the mesh axis involved, or compile with fallback='replicate'; if the plan is valid, please report it "
    "with this message"
)


def _input_key(inp: Any) -> tuple:
    """How a traced input is named: (kind, name, key)."""
    return (inp.kind, inp.name, inp.key)


def _is_uneven(shape: Any, placements: Any, mesh_shape: Any) -> bool:
    """Whether some rank's local shape differs from another's (a dim splits unevenly)."""
    sizes = list(shape)
    for axis, p in enumerate(placements):
        d = getattr(p, "dim", None)
        if d is None or not (p.is_shard() or isinstance(p, pt.StridedShard)):
            continue
        n = mesh_shape[axis]
        if sizes[d] % n:
            return True
        sizes[d] //= n
    return False


def _as_int(x: Any) -> Any:
    """A size as an int, or the SymInt itself when it depends on a batch symbol."""
    return x if pt.is_symbolic(x) else int(x)


class Expansion:
    """One expansion of a traced step: it walks the traced graph and splices every
    node's recipe into ``graph``; what :func:`spmd_compiler.rebuild.finalize` reads from it
    is ``traced``, ``mctx``, ``graph``, ``coords``, ``constants``, ``input_values``,
    ``output_values``, ``env``, ``stats`` and ``fake_mode``."""

    def __init__(
        self,
        traced: Any,
        mctx: MeshContext,
        placements: Any,
        *,
        fallback: str,
        cache: ExpansionCache,
        fsdp_axes: tuple[int, ...] = (),
        activation_sharding: str = "follow",
        sources: Any = None,
        rng: str = "exact",
        dynamic: bool = False,
        reshard_after_forward: bool = True,
        routing_global: frozenset = frozenset(),
        expert_axes: tuple[int, ...] = (),
        expert_capacity: float | None = None,
    ) -> None:
        self.traced = traced
        # sorts of token routing expanded on gathered tokens (expand/orders.py: a restricted
        # value of theirs met an op that needs the global one)
        self.routing_global = frozenset(routing_global)
        # FSDP axes on which stacked expert weights stay split (expert parallelism)
        self.expert_axes = tuple(expert_axes)
        self.expert_capacity = expert_capacity
        self._expert_weights = experts.expert_weights(traced.gm.graph) if self.expert_axes else set()
        self.mctx = mctx
        placements = list(placements)
        if len(placements) != len(traced.inputs):
            raise ValueError(
                f"got {len(placements)} placements for the {len(traced.inputs)} inputs of the traced step; "
                f"expected one per input. fix: pass plan.resolve(traced, mesh).placements"
            )
        # placements (and the plan entry that gave them) by input name, never by position
        sources = list(sources) if sources is not None else [None] * len(placements)
        self.planned = {_input_key(i): (tuple(p), s) for i, p, s in zip(traced.inputs, placements, sources)}
        self.fallback = fallback
        self.activation_sharding = activation_sharding
        self.rng = rng
        self.cache = cache
        # dynamic: the trace's own fake mode, so sizes derived from batch symbols stay symbolic
        self.size_symbols = size_symbols_of(traced) if dynamic else []
        self.dynamic = bool(self.size_symbols)
        self.fake_mode = trace_fake_mode(traced) if self.dynamic else pt.static_fake_mode()
        self.local_sizes = LocalSizes(pt.shape_env_of(self.fake_mode), mctx) if self.dynamic else None
        if self.dynamic:
            pt.register_symbolic_mode(self.fake_mode)
        self.size_nodes: dict[Any, fx.Node] = {}
        self.size_guard_nodes: list[tuple[str, int]] = []  # (traced node, guards it added)
        self.graph = fx.Graph()
        self.constants: dict[str, torch.Tensor] = {}
        self.env: dict[fx.Node, Any] = {}
        self.stats = ExpansionStats()
        self.warned: set = set()
        self.fsdp_axes = tuple(fsdp_axes)
        self.reshard_after_forward = reshard_after_forward
        self._gathered: dict[tuple[fx.Node, str], DValue] = {}
        self._written = positions.written_storages(traced.gm.graph)  # no position tensor among these
        self._regathered: dict[fx.Node, DValue] = {}  # traced forward view -> its backward replay
        self._cast_shards: dict[tuple[fx.Node, Any], DValue] = {}  # (FSDP shard, dtype) -> the shard cast (fsdp_cast)
        # each traced input as planned (env entries may later point at reduced copies),
        # in the order of traced.inputs; input_value() finds one by name
        self.input_values: list[DValue] = []
        self._inputs_by_key: dict[tuple, DValue] = {}
        self.coords = []
        for name, c in zip(mctx.axis_names, mctx.coordinate):
            node = self.graph.placeholder(f"coord_{name}")
            node.meta["val"] = c
            node.meta["spmd_coord"] = name
            self.coords.append(node)
        for sym in self.size_symbols:  # run-time global batch sizes (dynamic=True)
            node = self.graph.placeholder(f"size_{sym.symbol}")
            node.meta["val"] = symint_of(traced, sym)
            node.meta["spmd_size"] = sym
            self.size_nodes[sym.symbol] = node

    # ------------------------------------------------------------------ nodes
    def run(self) -> None:
        from .progress import Progress

        start = time.perf_counter()
        nodes = list(self.traced.gm.graph.nodes)
        progress = Progress("expanding", len(nodes), log)
        for node in nodes:
            self.stats.nodes += 1
            progress.update(self.stats.nodes)
            known = pt.num_guards(pt.shape_env_of(self.fake_mode)) if self.dynamic else 0
            with pt.size_oblivious(self.dynamic):  # dynamic=True: no 0/1 guards on batch sizes
                try:
                    if node.op == "placeholder":
                        inp = node.meta.get("spmd_input")
                        key = _input_key(inp) if inp is not None else None
                        assert key in self.planned, f"placeholder {node.name} is no input of the traced step ({inp})"
                        self.env[node] = self._placeholder(node, inp, self.planned[key][0])
                        self._inputs_by_key[key] = self.env[node]
                    elif node.op == "get_attr":
                        self.env[node] = self._constant(node)
                    elif node.op == "call_function":
                        self.env[node] = self._call(node)
                    elif node.op == "output":
                        self.output_values = tree_map(self._lookup, node.args[0])
                    else:
                        raise SpmdError(f"unexpected node kind {node.op}" + describe_node(node))
                except orders.OrderEscape:
                    raise
                except (SpmdError, ValueError, TypeError) as e:
                    add_context(e, node, inputs=self._inputs_text(node), fix=_FIX)
                    raise
                except Exception as e:
                    raise add_context(
                        SpmdError(f"expanding {node.name} failed: {type(e).__name__}: {e}"), node, inputs=self._inputs_text(node), fix=_FIX
                    ) from e
            if self.dynamic and pt.num_guards(pt.shape_env_of(self.fake_mode)) > known:
                self.size_guard_nodes.append((node, pt.num_guards(pt.shape_env_of(self.fake_mode)) - known))
        progress.done()
        missing = [i.label for i in self.traced.inputs if _input_key(i) not in self._inputs_by_key]
        assert not missing, f"traced inputs without a placeholder: {missing}"
        self.input_values = [self._inputs_by_key[_input_key(i)] for i in self.traced.inputs]
        log_advice(self, self.cache.warned)
        self.stats.seconds = time.perf_counter() - start
        self.stats.cache = self.cache.stats()

    def _lookup(self, x: Any) -> Any:
        return self.env[x] if isinstance(x, fx.Node) else x

    def input_value(self, kind: str, name: str, key: str | None = None) -> DValue:
        """The value of traced input ``(kind, name, key)`` as planned (not a reduced copy)."""
        if (kind, name, key) not in self._inputs_by_key:
            raise KeyError(f"no traced input {kind} {name!r}" + (f"[{key!r}]" if key else ""))
        return self._inputs_by_key[(kind, name, key)]

    def _inputs_text(self, node: fx.Node) -> str:
        """The placements and global shapes of ``node``'s inputs (for error messages); for
        a placeholder, its planned placements and where the plan gave them."""
        if node.op == "placeholder":
            inp = node.meta.get("spmd_input")
            pl, src = self.planned.get(_input_key(inp), (None, None)) if inp is not None else (None, None)
            if pl is None:
                return ""
            return f"{inp.label} {list(inp.shape)}: {placements_text(pl)}" + (f" from {src}" if src else "")
        parts = []
        for a in node.all_input_nodes:
            v = self.env.get(a)
            if isinstance(v, DValue):
                parts.append(f"{a.name}: {placements_text(v.spec.placements)} {list(v.spec.shape)}")
        return ", ".join(parts)

    def _placeholder(self, node: fx.Node, inp: Any, placements: tuple) -> DValue:
        shape, stride = inp.shape, inp.stride
        val = node.meta.get("val")
        if self.dynamic and inp.kind == "batch" and isinstance(val, torch.Tensor) and any(pt.is_symbolic(s) for s in val.shape):
            shape, stride = tuple(val.shape), tuple(val.stride())
            local_shape = symbolic_local_shape(shape, placements, self.mctx, self.local_sizes)
            self.stats.coord_dependent = True  # the local sizes are expressions of the coordinate
        else:
            local_shape, _ = pt.local_shape_and_offset(inp.shape, self.mctx.shape, self.mctx.coordinate, placements)
            if _is_uneven(inp.shape, placements, self.mctx.shape):
                self.stats.coord_dependent = True
        spec = pt.make_spec(self.mctx.mesh, placements, shape, stride, inp.dtype)
        new = self.graph.placeholder(node.name)
        new.meta["val"] = local_fake(self.fake_mode, local_shape, inp.dtype, device=inp.device)
        new.meta["spmd_spec"] = spec
        new.meta["spmd_input"] = inp
        value = DValue(new, spec)
        # FSDP: a parameter stored sharded is gathered once per phase for compute; so is a
        # buffer the plan names sharded (Llama's rotary inv_freq) unless the step writes it
        # in place (BatchNorm's running statistics stay sharded operands, updated in place)
        fsdp_kind = inp.kind == "param" or (inp.kind == "buffer" and node not in self._written)
        expert = node in self._expert_weights
        if fsdp_kind and any(placements[a].is_shard() and not (expert and a in self.expert_axes) for a in self.fsdp_axes):
            value.extra["fsdp"] = inp.name
        return value

    def _constant(self, node: fx.Node) -> DValue:
        value = getattr(self.traced.gm, node.target)
        if not isinstance(value, torch.Tensor):
            raise SpmdError(f"constant {node.target} is a {type(value).__name__}, expected a tensor" + describe_node(node))
        name = node.target
        self.constants[name] = value.detach().clone()
        new = self.graph.get_attr(name)
        new.meta["val"] = local_fake(self.fake_mode, tuple(value.shape), value.dtype, tuple(value.stride()), device=value.device)
        spec = pt.make_spec(self.mctx.mesh, [pt.Replicate()] * self.mctx.ndim, value.shape, value.stride(), value.dtype)
        new.meta["spmd_spec"] = spec
        return DValue(new, spec)

    def _call(self, node: fx.Node) -> Any:
        target = node.target
        args, kwargs = tree_map(self._lookup, (node.args, node.kwargs))
        phase = node.meta.get("spmd_phase")
        if self.fsdp_axes and self.reshard_after_forward and phase == "backward" and isinstance(target, torch._ops.OpOverload):
            traced = [a for a in leaves((node.args, node.kwargs)) if isinstance(a, fx.Node) and a.meta.get("spmd_phase") == "forward"]
            swap = {a: v for a in traced if (v := regathered_view(self, a, node)) is not None}
            if swap:
                args, kwargs = tree_map(lambda x: swap[x] if isinstance(x, fx.Node) and x in swap else self._lookup(x), (node.args, node.kwargs))
        if self.fsdp_axes and phase in ("forward", "backward") and is_precision_cast(target, args, kwargs):
            return fsdp_cast(self, node, target, args, kwargs)  # mixed precision: cast the shard, gather the cast
        if self.fsdp_axes and phase in ("forward", "backward") and isinstance(target, torch._ops.OpOverload):
            args, kwargs = tree_map(
                lambda v: fsdp_gathered(self, v, node, phase) if isinstance(v, DValue) and "fsdp" in v.extra else v, (args, kwargs)
            )
        if isinstance(target, torch._ops.OpOverload):
            args, kwargs = experts.route(self, node, target, args, kwargs)
        if target is operator.getitem:
            return args[0][args[1]]
        if target in _DROPPED:
            return None
        if target is MARKER:  # pipeline stage boundaries pass through unchanged
            new = self.graph.call_function(MARKER, tuple(node.args))
            new.meta.update(spmd_phase=node.meta.get("spmd_phase"), spmd_origin={"node": node.name, "op": str(target), "source": None})
            return None
        if target is aten.sym_size.int:
            return self._sym_size(args[0], args[1])
        if target is aten.sym_numel.default:
            return self._sym_numel(args[0])
        if target is aten.sym_stride.int:
            t, d = args
            g, l = t.spec.stride[d], t.local.stride()[d]
            return DSymInt(g, l, self._shard_axes(t) if g != l else (), f"{t.node.name}.stride({d})")
        if target is aten.sym_storage_offset.default:
            return DSymInt(0, 0)
        if not isinstance(target, torch._ops.OpOverload):
            if any(isinstance(x, RScalar) for x in leaves((args, kwargs))):
                return self._scalar_call(node, target, args, kwargs)
            if target in _SIZE_FUNCS or not any(isinstance(x, DValue) for x in leaves((args, kwargs))):
                return sym_apply(target, *args, **kwargs) if not kwargs else target(*args, **kwargs)
            raise SpmdError(f"cannot expand call to {target}: only aten ops reach expansion" + describe_node(node))
        self.stats.ops += 1
        value = expand_node(self, node, target, args, kwargs)
        positions.follow(target, args, kwargs, value, node, self._written)
        orders.tag_fresh(target, node, value, self._written)
        return value

    def _scalar_call(self, node: fx.Node, target: Any, args: tuple, kwargs: dict) -> RScalar:
        """Python arithmetic on run-time scalars: emitted as is into the per-rank graph."""

        def as_node(x: Any) -> Any:
            if isinstance(x, RScalar):
                return x.node
            if isinstance(x, DSymInt):
                return x.global_value
            return x

        def as_hint(x: Any) -> Any:
            if isinstance(x, RScalar):
                return x.hint
            if isinstance(x, DSymInt):
                return x.global_value
            return x

        n_args, n_kwargs = tree_map(as_node, (args, kwargs))
        h_args, h_kwargs = tree_map(as_hint, (args, kwargs))
        new = self.graph.call_function(target, tuple(n_args), dict(n_kwargs))
        try:
            hint = target(*h_args, **h_kwargs)
        except (ArithmeticError, ValueError):
            hint = 1.0
        new.meta["val"] = hint
        new.meta["spmd_origin"] = {"node": node.name, "op": str(target), "source": None}
        new.meta["spmd_phase"] = node.meta.get("spmd_phase")
        return RScalar(new, hint)

    def _shard_axes(self, t: DValue, dim: int | None = None) -> tuple[int, ...]:
        return tuple(
            i for i, p in enumerate(t.spec.placements)
            if isinstance(p, (pt.Shard, pt.StridedShard)) and (dim is None or p.dim == dim) and self.mctx.shape[i] > 1
        )

    def _sym_size(self, t: DValue, dim: int) -> DSymInt:
        g, l = _as_int(t.spec.shape[dim]), _as_int(t.local.shape[dim])
        axes = self._shard_axes(t, dim % max(1, len(t.spec.shape)))
        return DSymInt(g, l, axes if (axes or g != l) else (), f"{t.node.name}.size({dim})")

    def _sym_numel(self, t: DValue) -> DSymInt:
        g, l = _as_int(math.prod(t.spec.shape)), _as_int(math.prod(t.local.shape))
        axes = self._shard_axes(t)
        return DSymInt(g, l, axes if (axes or g != l) else (), f"{t.node.name}.numel()")


def expand_graph(
    traced: Any,
    mctx: MeshContext,
    placements: Any,
    *,
    fallback: str = "replicate",
    cache: ExpansionCache | None = None,
    fsdp_axes: tuple[int, ...] = (),
    activation_sharding: str = "follow",
    sources: Any = None,
    rng: str = "exact",
    dynamic: bool = False,
    reshard_after_forward: bool = True,
    expert_axes: tuple[int, ...] = (),
    expert_capacity: float | None = None,
) -> "Expansion":
    """Run the expander; returns it (graph, env, constants, stats) for :mod:`rebuild`.

    ``placements`` has one entry per ``traced.inputs`` (``sources``, optional, says where
    the plan gave each; error messages quote it)."""
    if fallback not in ("replicate", "error"):
        raise ValueError(f"fallback must be 'replicate' or 'error', got {fallback!r}")
    cache = cache if cache is not None else ExpansionCache()
    routing_global: frozenset = frozenset()
    escapes: list[str] = []
    while True:
        ex = Expansion(
            traced, mctx, placements, fallback=fallback, cache=cache,
            fsdp_axes=fsdp_axes, activation_sharding=activation_sharding, sources=sources, rng=rng, dynamic=dynamic,
            reshard_after_forward=reshard_after_forward, routing_global=routing_global, expert_axes=expert_axes,
            expert_capacity=expert_capacity,
        )
        try:
            ex.run()
        except orders.OrderEscape as e:
            if not e.origins or e.origins <= routing_global:
                raise SpmdError(f"token routing could not be expanded globally either ({e.why}); this is a bug in spmd-compiler") from e
            routing_global |= e.origins
            escapes.append(e.why)
            log.warning(
                "spmd_compiler: the token routing sorted by %s runs on gathered tokens (every rank sorts all of them): %s",
                ", ".join(sorted(e.origins)), e.why,
            )
            continue
        for why in escapes:
            ex.stats.fallbacks.append(("token routing", "sort", f"routing on gathered tokens: {why}"))
        return ex
