"""The per-step rank-agreement check, folded into a collective the step already makes.

The step guard (:mod:`.guard`) costs one extra round trip per step: a one-element
``all_reduce(MAX)`` of "my call signature differs from the agreed one". Most programs
start their communication with an ``all_reduce`` anyway (a DP forward's loss or target
count, or the first gradient bucket), and every rank that runs the agreed program runs
that same collective. So the check can ride on it:

* the *fold point* (:func:`find_fold`) is the program's first effect in execution order
  when it is an ``all_reduce`` over every rank (sum, avg or max, on a CPU tensor of a
  float or integer dtype) that only random ops precede;
* the *guarded variant* (:func:`fold_guard_pass`) sends that collective's payload
  flattened with one more element, 0 (a rank running the program has the agreed
  signature), waits for it before the program's next effect (moving the wait up if the
  schedule put it later), checks the extra element (:func:`resync_if_flagged`: anything
  above 0 means some rank's signature changed; every rank raises :class:`.guard.Resync`
  there together, nothing having changed, the CPU RNG restored if a random op ran), and
  hands the original elements on to the collective's users;
* a rank whose own signature changed cannot run the program (its shapes differ), so it
  joins only that collective, with zeros and the extra element 1
  (:meth:`FoldPoint.join`), and raises Resync.

The steady step then makes exactly the collectives of the program, one element longer.
Only for gloo: on NCCL reading the flag would synchronize the host with the GPU stream,
so there the standalone check on a gloo side group stays (:class:`.guard.StepGuard`), as
it does for pipelines and for programs without such a collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.fx as fx

from ..optimize.graph_utils import WAIT, new_node
from .guard import GuardError, Resync, _is_effect

__all__ = ["FoldPoint", "find_fold", "fold_guard_pass", "resync_if_flagged"]

log = logging.getLogger(__name__)

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
_OPS = ("sum", "avg", "max")  # reductions under which "some rank sent 1" reads as "> 0"


@dataclass(frozen=True)
class FoldPoint:
    """The collective a program's step check rides on (nodes by name: the guarded
    variant is a copy of the graph).

    Attributes:
        collective, wait: names of the ``all_reduce`` node and of its ``wait_tensor``.
        op, group: its reduce op and group name; ``shape``, ``dtype``: its payload's.
        random_before: a random op runs before it (the CPU RNG is restored on Resync).
    """

    collective: str
    wait: str
    op: str
    group: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    random_before: bool = False

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"FoldPoint op={self.op!r}: expected one of {list(_OPS)}")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def join(self) -> NoReturn:
        """This rank's signature changed: take part in the agreed program's folded
        collective (zeros, flag 1; same size, dtype, op and group), then raise Resync."""
        buf = torch.zeros(self.numel + 1, dtype=self.dtype)
        buf[-1] = 1
        try:
            c10d.wait_tensor.default(c10d.all_reduce.default(buf, self.op, self.group))
        except RuntimeError as e:
            raise GuardError(str(e), where=self.where()) from e
        raise Resync()

    def where(self) -> str:
        return (f"the program's first all_reduce ({self.collective}, {self.op} of {list(self.shape)} {self.dtype}), "
                f"which carries the per-step check that every rank runs the same program")


def resync_if_flagged(packed: torch.Tensor, rng_state: torch.Tensor | None = None) -> None:
    """The folded check: the last element of the reduced payload is above 0 when some
    rank's signature changed; then restore the RNG (if a random op ran) and raise Resync."""
    if packed[-1].item() > 0:
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        raise Resync()


def _why_not(node: fx.Node, world_size: int) -> str | None:
    """Why the collective ``node`` cannot carry the check (None: it can)."""
    if node.target is not c10d.all_reduce.default:
        return f"the first effect {node.name} is {node.target}, not an all_reduce"
    size = node.meta.get("spmd_comm", {}).get("group_size")
    if size != world_size:  # a flag must reach every rank, not one mesh axis's group
        return f"{node.name} spans {size} ranks of {world_size}"
    payload, op = node.args[0], node.args[1]
    val = payload.meta.get("val") if isinstance(payload, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
        return f"{node.name}'s payload is not a CPU tensor"
    if not all(isinstance(s, int) for s in val.shape):
        return f"{node.name}'s payload has a symbolic shape"
    if val.dtype in (torch.bool,) or val.dtype.is_complex:
        return f"{node.name}'s payload is {val.dtype}"
    if op not in _OPS or (op == "avg" and not val.dtype.is_floating_point):
        return f"{node.name} reduces with {op} ({val.dtype})"
    if len(node.users) != 1 or next(iter(node.users)).target is not WAIT:
        return f"{node.name} is not waited exactly once"
    return None


def find_fold(gm: fx.GraphModule, *, world_size: int) -> FoldPoint | None:
    """The collective of ``gm`` the step check can ride on, or None (the reason is
    logged at DEBUG): its first effect, an all_reduce over all ``world_size`` ranks that
    only random ops precede."""
    random_before = False
    for n in gm.graph.nodes:
        if not _is_effect(n):
            continue
        t = n.target
        if t.namespace != "_c10d_functional" and not t._schema.is_mutable:  # a random op
            val = n.meta.get("val")
            if "generator" in n.kwargs or not (isinstance(val, torch.Tensor) and val.device.type == "cpu"):
                log.debug("no folded step check: random op %s before the first collective is not on the CPU generator", n.name)
                return None
            random_before = True
            continue
        why = _why_not(n, world_size)
        if why is not None:
            log.debug("no folded step check: %s", why)
            return None
        val = n.args[0].meta["val"]
        return FoldPoint(n.name, next(iter(n.users)).name, n.args[1], n.args[2], tuple(val.shape), val.dtype, random_before)
    log.debug("no folded step check: the program makes no collective")
    return None


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with a copy of ``gm``'s graph (node meta shared, shallowly copied)."""
    g = fx.Graph()
    out, old = g.graph_copy(gm.graph, {}, return_output_node=True)
    new_out = g.output(out, type_expr=old.type)
    new_out.meta = dict(old.meta)
    return fx.GraphModule(gm, g)


def fold_guard_pass(gm: fx.GraphModule, *, point: FoldPoint) -> fx.GraphModule:
    """A copy of ``gm`` whose ``point`` collective carries the step check (see the module
    docstring); ``gm`` itself is left as it is. Same collectives, same results."""
    new = _copy(gm)
    g = new.graph
    nodes = list(g.nodes)
    by_name = {n.name: n for n in nodes}
    coll, wait = by_name[point.collective], by_name[point.wait]
    pos = {n: i for i, n in enumerate(nodes)}
    nxt = next((n for n in nodes[pos[coll] + 1:] if n is not wait and _is_effect(n)), None)
    anchor = wait.next if nxt is None or pos[wait] < pos[nxt] else nxt  # the check runs before the next effect
    rng = None
    if point.random_before:
        with g.inserting_before(next(n for n in nodes if n.op != "placeholder")):
            rng = g.call_function(torch.get_rng_state, ())
    payload, op, group = coll.args
    with g.inserting_before(coll):
        flat = new_node(g, aten.reshape.default, (payload, [-1]))
        packed = new_node(g, aten.constant_pad_nd.default, (flat, [0, 1], 0))
        folded = new_node(g, c10d.all_reduce.default, (packed, op, group))
    folded.meta.update({k: v for k, v in coll.meta.items() if k not in ("val", "tensor_meta")})
    comm = coll.meta.get("spmd_comm")
    if comm is not None:
        folded.meta["spmd_comm"] = {**comm, "history": [*comm.get("history", []), "carries the per-step check (one element more)"]}
    with g.inserting_before(anchor):
        done = new_node(g, WAIT, (folded,))
        g.call_function(resync_if_flagged, (done,) if rng is None else (done, rng))
        part = new_node(g, aten.slice.Tensor, (done, 0, 0, point.numel))
        value = new_node(g, aten.view.default, (part, list(point.shape)))
    wait.replace_all_uses_with(value)
    g.erase_node(wait)
    g.erase_node(coll)
    g.lint()
    new.recompile()
    log.debug("step check folded into %s (%s of %s %s)", point.collective, op, list(point.shape), point.dtype)
    return new
