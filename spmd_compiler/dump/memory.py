"""Static memory trace of a per-rank program: the bytes alive at each node, and the peak.

The runtime runs the per-rank graph in node order and drops every value after its last
use (:mod:`spmd_compiler.runtime.executor`), so what is resident at each node follows
from the graph alone:

* **inputs** (parameters, gradients, optimizer state, batch, hyperparameters) are held
  by the caller for the whole step;
* every other node that makes a tensor **allocates** it, sized from ``meta["val"]``
  (shape, strides, dtype); views (``t``, ``view``, ``narrow``, ``getitem`` of a ``split``,
  a ``reshape`` or ``contiguous`` that needs no copy), in-place ops (``add_``, ``copy_``)
  ``_unsafe_view`` and ``wait_tensor`` return storage that already exists and allocate
  nothing;
* a storage is freed after the last use of any value that aliases it (a view keeps its
  base alive), or at the end when the program returns it.

:func:`memory_trace` walks the graph once and returns a :class:`MemoryTrace`: the peak,
the node it is reached at, the inputs' bytes by kind and what is alive at the peak.
With ``backend="gloo"`` it also counts what gloo's collectives stage through torch's
allocator while in flight (measured on torch 2.13: ``all_gather_into_tensor`` holds a
second buffer of its output's size, ``reduce_scatter_tensor`` one of its input's size,
from issue to wait). What it does not see: other backends' internal buffers, the 0-d
tensors a Python number becomes inside an op (``x + 1``: 12 bytes), the allocator's
rounding and caching, and the Python objects around the tensors.

A symbolic program (``dynamic=True``) has shapes in the batch size symbols: with
``sizes`` (a :class:`~spmd_compiler.dump.sizes.SizeContext` that knows the global sizes
of a call) every size is that call's value for the program's rank; without it, the
example call's (rank 0's local size).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .format import format_bytes

__all__ = ["MemoryTrace", "LiveValue", "Storage", "memory_trace", "storages", "tensor_bytes"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default
# what a backend's collectives stage while in flight: kind -> the buffer it copies ("output"/"input")
STAGING = {"gloo": {"all_gather": "output", "reduce_scatter": "input"}}
# ops that return their input's storage without saying so in their schema
_UNANNOTATED_ALIASES = {_WAIT, torch.ops.aten._unsafe_view.default}
_MAYBE_COPY = {torch.ops.aten.reshape.default, torch.ops.aten.contiguous.default}


@dataclass(frozen=True)
class LiveValue:
    """A storage alive at the peak: the node that made it (or the input), its bytes, and
    what it is (``param``, ``grad``, ``optim``, ``batch``: an input of that kind; otherwise
    ``"<phase> <op>"`` of the node that allocated it)."""

    name: str
    bytes: int
    what: str


@dataclass
class MemoryTrace:
    """The result of :func:`memory_trace`.

    Attributes:
        peak_bytes: the most bytes alive at any node (inputs included).
        peak_node: the node where the peak is reached (the first such node).
        peak_phase: that node's phase (forward, backward, optimizer, output).
        input_bytes: bytes of the graph's inputs by kind (param, grad, optim, batch, ...).
        live: bytes alive at each node, in program order (``live[i]`` at node ``i``).
        at_peak: the storages alive at the peak, largest first (all of them).
    """

    peak_bytes: int
    peak_node: str
    peak_phase: str
    input_bytes: dict[str, int]
    live: list[int] = field(default_factory=list, repr=False)
    at_peak: list[LiveValue] = field(default_factory=list, repr=False)

    @property
    def total_input_bytes(self) -> int:
        return sum(self.input_bytes.values())

    def breakdown(self) -> dict[str, int]:
        """Bytes alive at the peak by what they are (inputs by kind, the rest by phase and op)."""
        out: dict[str, int] = {}
        for v in self.at_peak:
            out[v.what] = out.get(v.what, 0) + v.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def table(self, top: int = 8) -> str:
        """The peak, the inputs and the largest contributions at the peak, as text."""
        lines = [
            f"peak {format_bytes(self.peak_bytes)} per rank at {self.peak_node} ({self.peak_phase}); "
            f"inputs {format_bytes(self.total_input_bytes)} ("
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(self.input_bytes.items()))
            + ")"
        ]
        for what, nbytes in list(self.breakdown().items())[:top]:
            lines.append(f"  {what:<40} {format_bytes(nbytes):>12}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _int(x: Any, sizes: Any = None) -> int:
    if isinstance(x, torch.SymInt) and sizes is not None:  # a call's sizes (dump.sizes.SizeContext)
        try:
            return sizes.value(x)
        except (ValueError, TypeError):  # a size the batch sizes do not determine: its hint, below
            pass
    if isinstance(x, torch.SymInt):  # dynamic=True: the example call's size (rank 0's for a local size)
        from ..expand.symbolic import size_hint

        try:
            return size_hint(x)
        except (TypeError, ValueError, RuntimeError):
            pass
    try:
        return int(x)
    except (TypeError, ValueError, RuntimeError):  # an unbacked symbol: its hint if it has one
        node = getattr(x, "node", None)
        hint = getattr(node, "hint", None)
        return int(hint) if hint is not None else 0


def _memo_int(x: Any, sizes: Any, memo: dict | None) -> int:
    """:func:`_int`, remembered per symbolic expression in ``memo`` (a program's tensors
    share a few size expressions; each costs a sympy evaluation)."""
    if memo is None or not isinstance(x, torch.SymInt):
        return _int(x, sizes)
    key = (id(x.node.shape_env), x.node.expr)
    out = memo.get(key)
    if out is None:
        out = memo[key] = _int(x, sizes)
    return out


def tensor_bytes(t: torch.Tensor, sizes: Any = None, memo: dict | None = None) -> int:
    """Bytes of the storage a fresh tensor like ``t`` needs (its strides' extent);
    ``sizes``: the SizeContext symbolic sizes are evaluated with (see the module doc);
    ``memo``: a dict that remembers evaluated sizes across calls with the same ``sizes``."""
    if _memo_int(t.numel(), sizes, memo) == 0:
        return 0
    extent = 1 + sum((_memo_int(s, sizes, memo) - 1) * abs(_memo_int(st, sizes, memo)) for s, st in zip(t.shape, t.stride()))
    return extent * t.element_size()


def _returns_alias(target: Any) -> bool:
    """The op's first return aliases its first argument (a view or an in-place op)."""
    if target in _UNANNOTATED_ALIASES:
        return True
    schema = getattr(target, "_schema", None)
    rets = getattr(schema, "returns", None)
    return bool(rets and rets[0].alias_info is not None)


def _copies(node: fx.Node, sizes: Any = None, memo: dict | None = None) -> bool:
    """Whether a ``reshape`` / ``contiguous`` (aliasing in the schema) copies here."""
    src, out = node.args[0], node.meta.get("val")
    src_val = src.meta.get("val") if isinstance(src, fx.Node) else None
    if not isinstance(src_val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return True
    if node.target is torch.ops.aten.contiguous.default:
        return not src_val.is_contiguous()
    probe = torch.empty_strided([_memo_int(s, sizes, memo) for s in src_val.shape], [_memo_int(s, sizes, memo) for s in src_val.stride()],
                                device="meta")
    try:
        probe.view([_memo_int(s, sizes, memo) for s in out.shape])
    except RuntimeError:
        return True
    return False


def _tensors(val: Any) -> list[torch.Tensor | None]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _what(n: fx.Node) -> str:
    """What an allocation is, for the breakdown: ``"<phase> <op>"``, with parameter
    gathers (and the copy-out of a fused one) and collective buffers named as such."""
    phase = n.meta.get("spmd_phase", "?")
    comm = n.meta.get("spmd_comm")
    if n.meta.get("spmd_copy_out") or n.meta.get("spmd_param_gather") is not None:
        return f"{phase} gathered parameters"
    if comm is not None:
        return f"{phase} {comm.get('kind', 'collective')} buffer"
    return f"{phase} {getattr(n.target, '__name__', str(n.target))}"


@dataclass
class Storage:
    """One storage of a per-rank program, independent of the node order: the node that
    allocates it (an input's: the graph's first node, it is held for the whole step),
    its bytes, what it is (see :class:`LiveValue`), the name it is reported under, and
    every node that reads it through any alias (the output node when it is returned).
    In a given order it is alive from its allocation to its last reader."""

    alloc: fx.Node
    bytes: int
    what: str
    name: str
    readers: list[fx.Node] = field(default_factory=list)


def storages(gm: fx.GraphModule, *, backend: str | None = None, sizes: Any = None) -> tuple[list[Storage], dict[str, int]]:
    """The storages of ``gm`` (see :class:`Storage` and the module doc) in the order
    :func:`memory_trace` reports them, and the inputs' bytes by kind. One walk of the
    graph; moving nodes (without changing what they read) leaves the result valid."""
    staging = STAGING.get(backend or "", {})
    memo: dict = {}
    nodes = list(gm.graph.nodes)
    first, out_node = nodes[0] if nodes else None, nodes[-1] if nodes else None
    found: dict[Any, Storage] = {}
    holds: dict[fx.Node, list[Any]] = {}  # node -> storage ids it holds
    input_bytes: dict[str, int] = {}
    for n in nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            if isinstance(val, torch.Tensor):
                kind = getattr(n.meta.get("spmd_input"), "kind", "input")
                nbytes = tensor_bytes(val, sizes, memo)
                found[n] = Storage(first, nbytes, kind, n.name, [out_node])
                input_bytes[kind] = input_bytes.get(kind, 0) + nbytes
                holds[n] = [n]
            continue
        src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if n.op == "output":
            pass
        elif n.op == "call_function" and n.target is operator.getitem and src is not None:
            parent = holds.get(src, [])
            i = n.args[1]
            if _returns_alias(src.target) or len(parent) <= (i if isinstance(i, int) else 0):
                holds[n] = list(parent)  # a piece of a split: the input's storage
            else:
                holds[n] = [parent[i]] if isinstance(i, int) else list(parent)
        elif n.op == "call_function" and src is not None and _returns_alias(n.target) and not (
            n.target in _MAYBE_COPY and _copies(n, sizes, memo)
        ):
            holds[n] = list(holds.get(src, []))
        else:
            ids = []
            what = _what(n)
            for j, t in enumerate(_tensors(val)):
                if t is None:
                    continue
                found[(n, j)] = Storage(n, tensor_bytes(t, sizes, memo), what, n.name)
                ids.append((n, j))
            if isinstance(val, (list, tuple)):
                holds[n] = [(n, j) if t is not None else None for j, t in enumerate(_tensors(val))]
            else:
                holds[n] = ids
        for a in n.all_input_nodes:
            for sid in holds.get(a, ()):
                if sid is not None:
                    found[sid].readers.append(n)
        kind = (n.meta.get("spmd_comm") or {}).get("kind")
        if kind in staging and n.op == "call_function" and n.users:
            like = val if staging[kind] == "output" else (src.meta.get("val") if src is not None else None)
            if isinstance(like, torch.Tensor):  # from its issue to its wait
                what = f"{n.meta.get('spmd_phase', '?')} {kind} staging ({backend})"
                found[(n, "staging")] = Storage(n, tensor_bytes(like, sizes, memo), what, n.name, list(n.users))
    return list(found.values()), input_bytes


def memory_trace(gm: fx.GraphModule, *, backend: str | None = None, sizes: Any = None) -> MemoryTrace:
    """The bytes alive at each node of the per-rank program ``gm`` and the peak (see the
    module doc). ``backend``: the process group's backend (``"gloo"`` adds the buffers its
    collectives stage while in flight; others, or None, add nothing). ``sizes``: for a
    symbolic program, the :class:`~spmd_compiler.dump.sizes.SizeContext` of the call
    whose sizes the bytes are counted at."""
    found, input_bytes = storages(gm, backend=backend, sizes=sizes)
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    spans = []
    delta = [0] * (len(nodes) + 1)
    for s in found:
        first = pos[s.alloc]
        last = max(first, max((pos[r] for r in s.readers), default=first))
        spans.append((first, last))
        delta[first] += s.bytes
        delta[last + 1] -= s.bytes
    live, running = [], 0
    for i in range(len(nodes)):
        running += delta[i]
        live.append(running)
    peak_at = max(range(len(live)), key=lambda i: (live[i], -i)) if live else 0
    at_peak = [LiveValue(s.name, s.bytes, s.what) for s, (first, last) in zip(found, spans) if first <= peak_at <= last and s.bytes]
    at_peak.sort(key=lambda v: -v.bytes)
    peak_node = nodes[peak_at] if nodes else None
    return MemoryTrace(
        peak_bytes=live[peak_at] if live else 0,
        peak_node=peak_node.name if peak_node is not None else "",
        peak_phase=str(peak_node.meta.get("spmd_phase", "?")) if peak_node is not None else "",
        input_bytes=input_bytes,
        live=live,
        at_peak=at_peak,
    )
