"""The intent check: the per-rank program still does what the user's step wrote.

Bugs of one class give no error and a different result or cost: NAdam's first step
divided by a NaN folded into the trace, activation checkpointing's recomputation merged
back into the forward by CSE (the memory it saves gone), an update dropped by a pass.
Numbers alone do not always show them (a merged recomputation computes the same values).
:func:`check_intent` compares the program with its trace and raises
:class:`~spmd_compiler.errors.IntentError` naming what was lost and where (the trace, the
expansion, or the optimization pass that lost it):

* **host constants**: no Python arithmetic on host numbers (``operator.truediv``, ``mul``,
  ``pow``..., the learning rate and the optimizer's step counts and products) has a NaN
  or an infinity among its constants: such a constant was never a number the user wrote
  (NAdam's ``1 - mu_product.item()`` on the state-creating call became ``x / nan``);
* **recomputation**: every checkpointed region the trace recomputes in backward
  (``meta[RECOMPUTE]``, :mod:`spmd_compiler.trace.checkpointing`) still has its own
  compute in the program, and none of it runs before backward starts;
* **updates**: every parameter the traced step writes (the optimizer's update; a
  parameter with a gradient that the optimizer holds) is still written by the program;
* **phases**: every phase that computes in the trace (forward, backward, optimizer)
  still computes in the program.

It is on in the test harness (:class:`spmd_compiler.testing.SimulatedTraining`) and a
compile option for users, ``compile(..., check_intent=True)`` (off by default: it costs
a few walks of the program per pass at each compile).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import IntentError
from ..optimize.graph_utils import alias_root, is_view, written_inputs
from ..trace.markers import RECOMPUTE

__all__ = ["Intent", "intent_of", "intent_losses", "host_constant_losses", "check_intent", "check_trace"]

_PHASES = ("forward", "backward", "optimizer")
_NOT_COMPUTE = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.sym_size.int}


@dataclass(frozen=True)
class Intent:
    """What the trace says the step does: the phases that compute, the checkpointed
    regions recomputed in backward, and the parameters it writes (FQNs)."""

    phases: frozenset[str]
    regions: frozenset[int]
    updated: frozenset[str]


def _computes(n: fx.Node) -> bool:
    """An aten op that makes a value (not a view, a detach or a size read)."""
    return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target not in _NOT_COMPUTE
            and not is_view(n))


def _written_params(gm: fx.GraphModule) -> set[str]:
    out = set()
    for n in gm.graph.nodes:
        for x in written_inputs(n):
            root = alias_root(x)
            inp = root.meta.get("spmd_input") if isinstance(root, fx.Node) and root.op == "placeholder" else None
            if inp is not None and inp.kind == "param":
                out.add(inp.name)
    return out


def intent_of(traced_gm: fx.GraphModule) -> Intent:
    """The :class:`Intent` of a traced step's graph."""
    computing = [n for n in traced_gm.graph.nodes if _computes(n)]
    return Intent(
        phases=frozenset(p for n in computing if (p := n.meta.get("spmd_phase")) in _PHASES),
        regions=frozenset(n.meta[RECOMPUTE] for n in computing if RECOMPUTE in n.meta),
        updated=frozenset(_written_params(traced_gm)),
    )


def host_constant_losses(gm: fx.GraphModule) -> list[str]:
    """Python arithmetic on host numbers with a NaN or infinite constant (see module doc)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or isinstance(n.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            continue
        bad = [a for a in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(a, float) and not math.isfinite(a)]
        if bad:
            out.append(f"{n.format_node()} computes a host number from the constant {bad[0]}, which no step writes "
                       f"(a number read from a tensor that had no value when it was traced)")
    return out


def intent_losses(intent: Intent, gm: fx.GraphModule) -> list[str]:
    """What ``gm`` (a per-rank program) lost of ``intent``, one line each (empty: nothing)."""
    out = host_constant_losses(gm)
    nodes = list(gm.graph.nodes)
    computing = [n for n in nodes if _computes(n)]
    phases = {n.meta.get("spmd_phase") for n in computing}
    out += [f"the trace computes in {p}, the program does not" for p in _PHASES if p in intent.phases and p not in phases]
    # "before backward starts": before the first backward node and the forward's last node
    first_backward = next((i for i, n in enumerate(nodes) if n.meta.get("spmd_phase") == "backward" and RECOMPUTE not in n.meta), None)
    last_forward = max((i for i, n in enumerate(nodes) if n.meta.get("spmd_phase") == "forward" and _computes(n)), default=-1)
    regions = Counter(n.meta[RECOMPUTE] for n in computing if RECOMPUTE in n.meta)
    for r in sorted(intent.regions):
        if not regions[r]:
            out.append(f"checkpointed region {r}'s recomputation in backward is gone (merged into the forward it repeats: "
                       f"its activations live from forward to backward again)")
    if first_backward is not None and last_forward >= 0:
        early = [n for n in nodes[:min(first_backward, last_forward)] if RECOMPUTE in n.meta and _computes(n)]
        if early:
            out.append(f"checkpointed region {early[0].meta[RECOMPUTE]}'s recomputation runs before backward starts "
                       f"({early[0].format_node()}): its result lives from forward to backward")
    missing = sorted(intent.updated - _written_params(gm))
    if missing:
        out.append(f"the trace updates parameter(s) {', '.join(missing)}, the program does not write them")
    return out


def check_intent(intent: Intent, gm: fx.GraphModule, where: str) -> None:
    """Raise :class:`~spmd_compiler.errors.IntentError` if ``gm`` lost any of ``intent``;
    ``where`` names the stage that made ``gm`` (``"the trace"``, ``"expansion"``,
    ``"pass 'overlap'"``)."""
    losses = intent_losses(intent, gm)
    if losses:
        raise IntentError(where, losses)


def check_trace(traced_gm: fx.GraphModule) -> Intent:
    """The host-constant check on the trace itself; returns its :class:`Intent`."""
    losses = host_constant_losses(traced_gm)
    if losses:
        raise IntentError("the trace", losses)
    return intent_of(traced_gm)
