"""Facts about per-rank graphs that passes need: aliasing, mutation, purity, order; and
cutting a part of a graph out as a GraphModule of its own (:func:`cut_graph`)."""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..expand.redistribute import COLLECTIVE_OPS
from ..trace.markers import RECOMPUTE

__all__ = [
    "is_inplace",
    "is_view",
    "alias_root",
    "written_roots",
    "is_pure",
    "is_collective",
    "is_wait",
    "WAIT",
    "written_inputs",
    "written_through",
    "mutation_edges",
    "fused_comm",
    "cut_graph",
]

WAIT = torch.ops._c10d_functional.wait_tensor.default
_PY_PURE = {operator.mul, operator.add, operator.sub, operator.floordiv, operator.getitem, min, max}


def is_inplace(node: fx.Node) -> bool:
    """The node writes its first argument in place and returns it (``add_``, ``copy_``)."""
    return node.op == "call_function" and pt.writes_first_arg(node.target)


def is_view(node: fx.Node) -> bool:
    """The op returns an alias of its first argument (view, t, detach, getitem of split...)."""
    t = node.target
    if node.op != "call_function":
        return False
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload):
        return False
    rets = t._schema.returns
    return bool(rets and rets[0].alias_info is not None and not rets[0].alias_info.is_write)


def alias_root(node: Any) -> Any:
    """The node whose storage ``node`` shares (through views and in-place ops)."""
    while isinstance(node, fx.Node) and (is_view(node) or is_inplace(node)) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def param_root(node: Any) -> Any:
    """:func:`alias_root`, through the casts of an FSDP shard to its compute dtype (mixed
    precision: ``meta["spmd_param_cast"]``, :mod:`spmd_compiler.expand.fsdp`): the
    parameter placeholder a gather of a cast shard collects."""
    root = alias_root(node)
    while isinstance(root, fx.Node) and root.meta.get("spmd_param_cast") and root.args and isinstance(root.args[0], fx.Node):
        root = alias_root(root.args[0])
    return root


def written_roots(gm: fx.GraphModule) -> set[fx.Node]:
    """Storage roots written by some in-place op anywhere in the graph."""
    return {alias_root(n.args[0]) for n in gm.graph.nodes if is_inplace(n) and isinstance(n.args[0], fx.Node)}


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in COLLECTIVE_OPS


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is WAIT


def is_pure(node: fx.Node) -> bool:
    """No side effect and deterministic: safe to deduplicate or move."""
    if node.op != "call_function":
        return False
    t = node.target
    if t in _PY_PURE:
        return True
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if is_inplace(node) or t._schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in t.tags:
        return False
    return True


def positions(gm: fx.GraphModule) -> dict[fx.Node, float]:
    """Node -> position in the graph (floats, so moves can keep them up to date cheaply)."""
    return {n: float(i) for i, n in enumerate(gm.graph.nodes)}


def move_after(node: fx.Node, anchor: fx.Node, pos: dict[fx.Node, float]) -> None:
    """Move ``node`` right after ``anchor`` and give it a position between its neighbours."""
    nxt = anchor.next
    anchor.append(node)
    upper = pos.get(nxt, pos[anchor] + 1.0) if nxt is not node else pos[anchor] + 1.0
    if nxt.op == "root":
        upper = pos[anchor] + 1.0
    pos[node] = (pos[anchor] + upper) / 2.0


def move_before(node: fx.Node, anchor: fx.Node, pos: dict[fx.Node, float]) -> None:
    """Move ``node`` right before ``anchor``."""
    move_after(node, anchor.prev, pos) if anchor.prev is not node else None


_PREP_TARGETS = {
    torch.ops.aten.contiguous.default,
    torch.ops.aten.movedim.int,
    torch.ops.aten.constant_pad_nd.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.view.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
}


def prep_chain(collective: fx.Node) -> list[fx.Node]:
    """The local ops that only prepare ``collective``'s input (contiguous, movedim, pad;
    for a fused gather its copy-in; nodes a rule marked ``meta["spmd_prep"]``), nearest
    first; they can move with it."""
    copy_in = collective.meta.get("spmd_copy_in")
    if copy_in:
        chain = list(reversed(copy_in))
        for flat in copy_in[:-1]:
            node = flat.args[0]
            while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _PREP_TARGETS and len(node.users) == 1:
                chain.append(node)
                node = node.args[0]
        return chain
    chain = []
    node = collective.args[0]
    while (
        isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1
        and (node.target in _PREP_TARGETS or node.meta.get("spmd_prep"))
    ):
        chain.append(node)
        node = node.args[0]
    return chain


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes whose storage ``node`` writes: every argument its schema marks as
    written (``Tensor(a!)``, lists of them included)."""
    if node.op != "call_function":
        return []
    out = []
    for i, name in pt.written_args(node.target):
        v = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, fx.Node):
                out.append(x)
    return out


def written_through(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose result some in-place op writes: the written argument and every view
    or in-place result it was made from, up to its storage root."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        for x in written_inputs(n):
            while isinstance(x, fx.Node):
                out.add(x)
                if not ((is_view(x) or is_inplace(x)) and x.args and isinstance(x.args[0], fx.Node)):
                    break
                x = x.args[0]
    return out


def mutation_edges(gm: fx.GraphModule) -> dict[fx.Node, set[fx.Node]]:
    """Ordering constraints that data edges miss, as extra predecessors per node.

    Every access of a storage (any node reading a view of it) keeps its order relative
    to every write to it: a read before a write stays before it (write-after-read), a
    read after it stays after (read-after-write through an alias), writes keep their
    order. A pass that reorders nodes must respect these as well as ``all_input_nodes``.
    """
    preds: dict[fx.Node, set[fx.Node]] = defaultdict(set)
    last_write: dict[Any, fx.Node] = {}
    reads_since: dict[Any, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        written = {alias_root(x) for x in written_inputs(n)}
        for root in {alias_root(x) for x in n.all_input_nodes} | written:
            w = last_write.get(root)
            if w is not None and w is not n:
                preds[n].add(w)
            if root not in written:
                reads_since[root].append(n)
        for root in written:
            preds[n].update(r for r in reads_since.pop(root, ()) if r is not n)
            last_write[root] = n
    return preds


def writes_by_root(gm: fx.GraphModule) -> dict[Any, list[fx.Node]]:
    """In-place ops of the graph, grouped by the storage root they write."""
    out: dict[Any, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if is_inplace(n) and isinstance(n.args[0], fx.Node):
            out.setdefault(alias_root(n.args[0]), []).append(n)
    return out


def hoist(
    gm: fx.GraphModule,
    node: fx.Node,
    pos: dict[fx.Node, float],
    *,
    not_before: fx.Node | None = None,
    writes: dict[Any, list[fx.Node]] | None = None,
) -> None:
    """Move ``node`` (and its prep chain) to right after the latest of its inputs, or after
    ``not_before`` if that is later (the prep chain too: a fused gather's copy-in buffer is
    not made long before its collective). Never moves a node past a write to one of its
    inputs, and never a node of a checkpointed region's recomputation (``meta[RECOMPUTE]``)
    before the region's first node: it would run in forward and hold its result until
    backward, the memory checkpointing saves. ``pos`` (from :func:`positions`) is kept up
    to date; pass ``writes`` (from :func:`writes_by_root`) when hoisting many nodes."""
    writes = writes if writes is not None else writes_by_root(gm)
    region = node.meta.get(RECOMPUTE)
    if region is not None and not (is_collective(node) and _reads_state_only(node)):  # a parameter gather may prefetch
        first = min((n for n in gm.graph.nodes if n.meta.get(RECOMPUTE) == region), key=lambda n: pos[n])
        if first.prev.op != "root" and (not_before is None or pos[first.prev] > pos[not_before]):
            not_before = first.prev
    if is_collective(node):
        for prep in reversed(prep_chain(node)):
            hoist(gm, prep, pos, not_before=not_before, writes=writes)
    inputs = list(node.all_input_nodes)
    anchor = max(inputs, key=lambda a: pos[a]) if inputs else None
    if not_before is not None and (anchor is None or pos[not_before] > pos[anchor]):
        anchor = not_before
    if anchor is None or pos[anchor] >= pos[node]:
        return
    # do not read an input before an in-place write to it that lies in between
    for a in inputs:
        for w in writes.get(alias_root(a), ()):
            if pos[anchor] < pos[w] < pos[node]:
                anchor = w
    if anchor is not node.prev:
        move_after(node, anchor, pos)


def _reads_state_only(collective: fx.Node) -> bool:
    """The collective's input (through its prep chain) is a graph input's storage (a
    parameter shard an FSDP gather reads): it holds no activation, wherever it is issued."""
    roots = [alias_root(a) for a in collective.all_input_nodes]
    chain = prep_chain(collective)
    if chain:
        roots = [alias_root(a) for c in chain for a in c.all_input_nodes if a not in chain]
    return bool(roots) and all(isinstance(r, fx.Node) and r.op == "placeholder" for r in roots)


def fake_call(target: Any, args: tuple, kwargs: dict | None = None) -> Any:
    """Run ``target`` on the fake values of its node arguments (for ``meta['val']``)."""
    from torch.utils import _pytree as pytree

    kwargs = kwargs or {}
    vals = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (args, kwargs))
    mode = next((v.fake_mode for v in pytree.tree_leaves(vals) if hasattr(v, "fake_mode")), None)
    if mode is None:
        return target(*vals[0], **vals[1])
    with mode:
        return target(*vals[0], **vals[1])


def new_node(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None, meta: dict | None = None) -> fx.Node:
    """Create a call_function node (at the graph's insertion point) with its fake value."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = fake_call(target, args, kwargs)
    if meta:
        node.meta.update(meta)
    return node


def fused_comm(members: list[fx.Node], *, reason: str, label: str, what: str) -> dict[str, Any]:
    """The ``spmd_comm`` record of one collective that replaces ``members``: summed
    sizes, and every member's provenance kept (``bucket``) so dumps can list them."""
    first = members[0].meta["spmd_comm"]
    return {
        **{k: v for k, v in first.items() if k in ("kind", "axis", "axis_name", "group_size", "dtype")},
        "bytes": sum(m.meta["spmd_comm"]["bytes"] for m in members),
        "wire_bytes": sum(m.meta["spmd_comm"]["wire_bytes"] for m in members),
        "reason": reason,
        "transition": first.get("transition", ""),
        "value": f"{label}[" + ", ".join(str(m.meta["spmd_comm"].get("value", "?")) for m in members) + "]",
        "origin": ", ".join(str(m.meta["spmd_comm"].get("origin", "?")) for m in members),
        "op": "bucket",
        "source": None,
        "history": [f"fused {len(members)} {what} ({', '.join(m.name for m in members)})"],
        "bucket": [{k: m.meta["spmd_comm"].get(k) for k in ("value", "origin", "op", "source", "bytes", "transition")} for m in members],
    }


def cut_graph(
    gm: fx.GraphModule, nodes: Sequence[fx.Node], *, recompute: Callable[[fx.Node], bool] | None = None,
    outputs: Sequence[fx.Node] | None = None,
) -> tuple[fx.GraphModule, list[str], dict[fx.Node, fx.Node]]:
    """A GraphModule of ``nodes`` (in graph order) cut out of ``gm``.

    A value read from outside ``nodes`` becomes a placeholder named after it (with its
    meta), in the order of first read, except ``get_attr`` nodes and the nodes for which
    ``recompute(node)`` holds: those are copied in, with what they read. The GraphModule
    returns ``outputs`` (nodes of ``gm``) as a list; with ``outputs=None`` it has no
    output node yet (the caller adds one and recompiles). Returns the GraphModule, the
    names of its inputs (in placeholder order) and each copied node's copy by original.
    """
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[str] = []

    def arg(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a.op == "get_attr" or (recompute is not None and recompute(a)):
            new = g.node_copy(a, arg)
        else:
            new = g.placeholder(a.name)
            new.meta = dict(a.meta)
            inputs.append(a.name)
        env[a] = new
        return new

    for n in nodes:
        env[n] = g.node_copy(n, arg)
    if outputs is not None:
        g.output([env[n] for n in outputs])
    return fx.GraphModule(gm, g), inputs, env
