"""Running optimization passes over the per-rank graph.

Every pass has the shape ``fn(gm, *, <options>) -> gm``. :func:`run_passes` applies a
list of them in order, skips the disabled ones by name, logs each with its time and the
number of nodes and collectives before and after, can hand each intermediate graph to a
callback (dumps write one file per pass), checks each pass's output graph
(:func:`check_program`), and re-raises a failure naming the pass, the node, the user's
source line and a fix, in a few lines (never the whole graph).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from ..errors import SpmdError, describe_node
from ..expand.values import placements_text

__all__ = ["PassSpec", "PassRecord", "PassCheckError", "run_passes", "check_program", "DEFAULT_PASSES", "default_passes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassSpec:
    """A pass and its keyword options."""

    name: str
    fn: Callable[..., fx.GraphModule]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    collectives_before: int
    collectives_after: int


def _count(gm: fx.GraphModule) -> tuple[int, int]:
    nodes = list(gm.graph.nodes)
    return len(nodes), sum(1 for n in nodes if "spmd_comm" in n.meta)


class PassCheckError(SpmdError):
    """A pass returned a graph that is not a valid per-rank program (``node``: where)."""

    def __init__(self, message: str, node: fx.Node | None = None, argument: fx.Node | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.argument = argument


@dataclass(frozen=True)
class _Interface:
    """What the runtime binds values by: the placeholders, in order, and the output count."""

    inputs: tuple[str, ...]
    num_outputs: int

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "_Interface":
        nodes = list(gm.graph.nodes)
        out = next((n for n in reversed(nodes) if n.op == "output"), None)
        ret = out.args[0] if out is not None and out.args else ()
        return cls(tuple(n.name for n in nodes if n.op == "placeholder"), len(ret) if isinstance(ret, (list, tuple)) else 1)


def check_program(gm: fx.GraphModule, interface: _Interface | None = None) -> None:
    """Raise :class:`PassCheckError` unless every node's inputs are defined before it in
    ``gm`` (the per-rank program's value order), the placeholders and output count are
    ``interface``'s, and ``graph.lint()`` passes."""
    seen: set[fx.Node] = set()
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            if a not in seen:
                where = "after it" if a.graph is gm.graph and not getattr(a, "_erased", False) else "nowhere (erased or from another graph)"
                raise PassCheckError(f"node {n.name!r} reads {a.name!r} before it is defined ({a.name!r} is {where})", n, a)
        seen.add(n)
    if interface is not None:
        now = _Interface.of(gm)
        if now.inputs != interface.inputs:
            raise PassCheckError(f"the program's inputs changed: expected {list(interface.inputs)}, got {list(now.inputs)}")
        if now.num_outputs != interface.num_outputs:
            raise PassCheckError(f"the program's outputs changed: expected {interface.num_outputs}, got {now.num_outputs}")
    try:
        gm.graph.lint()
    except Exception as e:  # lint's message embeds the whole graph: keep its first line
        raise PassCheckError(_first_line(e)) from e


def _first_line(e: BaseException, limit: int = 300) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return first if len(first) <= limit else first[: limit - 3] + "..."


def _named_node(gm: fx.GraphModule, e: BaseException, text: str) -> fx.Node | None:
    """The node a pass failure is about: the one the exception carries, else the first
    node of ``gm`` the message names (``Node 'add_3'``, ``Argument 't_1'``, ``Node get_attr_1``)."""
    node = getattr(e, "spmd_node", None) or getattr(e, "node", None)
    if isinstance(node, fx.Node):
        return node
    names = {n.name: n for n in gm.graph.nodes}
    found = [a or b for a, b in re.findall(r"'([A-Za-z_][\w.]*)'|Node ([A-Za-z_]\w*)", text)]
    return next((names[m] for m in found if m in names), None)


def _node_context(node: fx.Node | None, label: str = "graph node") -> str:
    """The node, its placements and where it came from, for a pass failure."""
    if node is None:
        return ""
    out = describe_node(node).replace("graph node:", f"{label}:".ljust(11), 1)
    spec = node.meta.get("spmd_spec")
    if spec is not None:
        out += f"\n  placements: {placements_text(spec.placements)} {list(spec.shape)}"
    origin = node.meta.get("spmd_origin")
    if isinstance(origin, dict) and origin.get("node"):
        out += f"\n  expanded from: {origin['node']} ({origin.get('op')})"
    return out


def pass_failure(name: str, gm: fx.GraphModule, e: BaseException) -> SpmdError:
    """The error for pass ``name`` raising ``e`` or leaving an invalid graph: the pass,
    what went wrong, the node and the user's line, and a way out, in a few short lines."""
    first = _first_line(e)
    node = _named_node(gm, e, first)
    what = f"left an invalid program: {first}" if isinstance(e, PassCheckError) else f"failed: {type(e).__name__}: {first}"
    context = _node_context(node)
    argument = getattr(e, "argument", None)
    if isinstance(argument, fx.Node):
        context += _node_context(argument, "reads")
    lines = [f"optimization pass {name!r} {what}"]
    lines += [line for line in context.strip("\n").splitlines() if line not in lines]  # a shared source line once
    lines += [
        "  this is a bug in spmd-compiler (passes take any program expansion makes); please report it with this message",
        f"  fix for now: compile(..., passes_disabled=({name!r},)) compiles without this pass",
    ]
    return SpmdError("\n".join(line if len(line) <= 400 else line[:397] + "..." for line in lines))


def run_passes(
    gm: fx.GraphModule,
    passes: Sequence[PassSpec],
    *,
    disabled: Sequence[str] = (),
    after_pass: Callable[[str, fx.GraphModule], None] | None = None,
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Apply ``passes`` to ``gm`` in order; returns the final graph and one record per pass run.

    Every pass's output is checked (:func:`check_program`): a pass either transforms the
    program into a valid one or fails here, named, with the node and a way out. The
    graph's Python code is generated once, after the last pass (after every pass when
    ``after_pass`` records them): passes work on the graph, not on ``gm.code``."""
    known = {p.name for p in passes}
    unknown = [d for d in disabled if d not in known]
    if unknown:
        raise ValueError(f"cannot disable unknown passes {unknown}; the passes are {sorted(known)}")
    records = []
    for spec in passes:
        if spec.name in disabled:
            log.info("pass %s: disabled", spec.name)
            continue
        n0, c0 = _count(gm)
        interface = _Interface.of(gm)
        start = time.perf_counter()
        try:
            out = spec.fn(gm, **spec.options)
            if not isinstance(out, fx.GraphModule):
                raise PassCheckError(f"expected the pass to return an fx.GraphModule, got {type(out).__name__}")
            gm = out
            check_program(gm, interface)
            if after_pass is not None:
                gm.recompile()
        except Exception as e:
            raise pass_failure(spec.name, gm, e) from e
        elapsed = time.perf_counter() - start
        n1, c1 = _count(gm)
        records.append(PassRecord(spec.name, elapsed, n0, n1, c0, c1))
        log.info("pass %s: %.3fs, %d -> %d nodes, %d -> %d collectives", spec.name, elapsed, n0, n1, c0, c1)
        if after_pass is not None:
            after_pass(spec.name, gm)
    if records and after_pass is None:  # the code once, for the final graph (about 1 s per recompile at 20,000 nodes)
        try:
            gm.recompile()
        except Exception as e:
            raise pass_failure(records[-1].name, gm, e) from e
    return gm, records


def default_passes(
    *, bucket_mb: float = 25.0, first_bucket_mb: float | None = 1.0, overlap: bool = True, prefetch: int = 2,
    backward_prefetch: int = 1,
) -> list[PassSpec]:
    """The default pipeline: remove redundant collectives, sum Partial terms added together
    before one reduction (:mod:`.partial_sums`), reduce a mean's count and value
    in one all_reduce (:mod:`.mean_reductions`), divide the gradients by that count after
    their reduction so the pair rides in a gradient bucket (:mod:`.deferred_divisor`), bucket gradient reductions, gather FSDP
    parameters per module unit, overlap communication with compute (issue early, wait
    late), then move compute into the gaps (:mod:`.schedule`), send independent small
    all_reduces left standalone together (:mod:`.fuse_all_reduces`), recompute cheap saved activations in backward and delay parameter gathers that would raise the peak
    (:mod:`.memory`)."""
    from .bucketing import bucket_gradients_pass
    from .deferred_divisor import defer_mean_divisor_pass
    from .fuse_all_reduces import fuse_all_reduces_pass
    from .gathers import bucket_parameter_gathers_pass
    from .mean_reductions import fuse_mean_reductions_pass
    from .memory import budget_prefetch_pass, rematerialize_pass
    from .overlap import overlap_pass
    from .partial_sums import sum_partials_before_reducing_pass
    from .redundant import remove_redundant_collectives_pass
    from .schedule import schedule_for_overlap_pass

    out = [
        PassSpec("remove_redundant_collectives", remove_redundant_collectives_pass),
        PassSpec("sum_partials_before_reducing", sum_partials_before_reducing_pass),
        PassSpec("fuse_mean_reductions", fuse_mean_reductions_pass),
        PassSpec("defer_mean_divisor", defer_mean_divisor_pass),
        PassSpec("bucket_gradients", bucket_gradients_pass, {"bucket_mb": bucket_mb, "first_bucket_mb": first_bucket_mb}),
        PassSpec("bucket_parameter_gathers", bucket_parameter_gathers_pass),
    ]
    if overlap:
        out.append(PassSpec("overlap", overlap_pass, {"prefetch": prefetch, "backward_prefetch": backward_prefetch}))
        out.append(PassSpec("schedule", schedule_for_overlap_pass))
    out.append(PassSpec("fuse_all_reduces", fuse_all_reduces_pass))
    out.append(PassSpec("rematerialize", rematerialize_pass))
    if overlap:
        out.append(PassSpec("budget_prefetch", budget_prefetch_pass))
    return out


DEFAULT_PASSES = (
    "remove_redundant_collectives", "sum_partials_before_reducing", "fuse_mean_reductions", "defer_mean_divisor", "bucket_gradients", "bucket_parameter_gathers", "overlap", "schedule",
    "fuse_all_reduces", "rematerialize", "budget_prefetch",
)
