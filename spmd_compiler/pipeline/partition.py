"""Assigning every node of the traced train step to pipeline stages.

Forward: ``pipe_split`` markers (from ``pipe_split()`` calls or a split spec) cut the
forward into stages in trace order: stage k is everything between marker k and k+1.

Backward: **a backward node belongs to the stage of the forward op it differentiates.**
While tracing, every autograd node reachable from the loss is hooked so that the nodes
traced during its backward carry its forward op's autograd sequence number
(``node.meta["seq_nr"]``, as AOTAutograd does); the forward node with that number
gives the stage. Nodes with no forward op of their own (gradient accumulation into
``.grad``, sums of gradient contributions) take the stage of the earliest stage among
the backward nodes they read, i.e. where the gradient flows to next; and no backward
node runs later than a stage whose gradient it reads (gradients flow to earlier stages:
autograd sums two gradient contributions while running whichever op finished last, so
that sum gets the earlier of the two stages).

Optimizer (and any code on gradients after ``backward()``): a node belongs to every
stage that owns a parameter it touches; a parameter is owned by each stage whose
forward uses it. A parameter used by two stages (tied embedding and LM head) is thus
owned, stored and updated on both; its gradient is the sum computed by the backward
graph, which reaches both stages.

Buffers belong to the stages of their forward users; a buffer the forward does not read
(BatchNorm running statistics once their update is deferred to the optimizer) lives with
its module's other state.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from ..errors import SpmdError
from ..trace.markers import MARKER, PIPE_SPLIT

__all__ = ["StageAssignment", "assign_stages", "is_pipe_split"]


def is_pipe_split(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is MARKER and node.args[0] == PIPE_SPLIT


@dataclass
class StageAssignment:
    """Stages of the traced graph's nodes, by node name.

    ``stages[name]`` is a frozenset of stage indices (one for forward and backward
    nodes; several for placeholders and optimizer nodes of tied parameters).
    ``param_stages[fqn]`` lists the stages owning each parameter, ``buffer_stages[fqn]``
    each buffer.
    """

    num_stages: int
    stages: dict[str, frozenset[int]] = field(default_factory=dict)
    param_stages: dict[str, tuple[int, ...]] = field(default_factory=dict)
    buffer_stages: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def of(self, name: str) -> frozenset[int]:
        return self.stages.get(name, frozenset())

    def tied(self) -> dict[str, tuple[int, ...]]:
        return {k: v for k, v in self.param_stages.items() if len(v) > 1}


def _phase(n: fx.Node) -> str:
    return n.meta.get("spmd_phase", "forward")


def assign_stages(gm: fx.GraphModule, outputs: list[Any] | None = None) -> StageAssignment:
    """Assign stages to the nodes of a traced train step (see module docstring).

    ``outputs`` (the TracedStep's GraphOutput list) tells which parameter each state
    output belongs to: optimizer state made from constants and returned unread (Adam's
    first ``step``) lives with its parameter."""
    nodes = list(gm.graph.nodes)
    stage = 0
    fwd: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op != "call_function" or _phase(n) != "forward":
            continue
        if is_pipe_split(n):
            stage += 1
            continue
        fwd[n] = stage
    num = stage + 1
    out = StageAssignment(num)
    seq_stage: dict[int, int] = {}
    for n, s in fwd.items():
        seq = n.meta.get("seq_nr", -1)
        if isinstance(seq, int) and 0 <= seq < 2**62:
            seq_stage.setdefault(seq, s)
    # getitem/view-like nodes inherit the stage of what they read, whatever their seq_nr
    stages: dict[fx.Node, frozenset[int]] = {n: frozenset([s]) for n, s in fwd.items()}

    # placeholders and constants: the stages of their forward users
    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            users = {s for u in n.users if u in fwd for s in [fwd[u]]}
            stages[n] = frozenset(users)
    for n in nodes:
        inp = n.meta.get("spmd_input")
        if n.op == "placeholder" and inp is not None and inp.kind == "param":
            owners = tuple(sorted(stages[n])) or (0,)
            stages[n] = frozenset(owners)
            out.param_stages[inp.name] = owners

    # buffers: the stages of their forward users; one the forward does not read (BatchNorm
    # running statistics, whose update moved to the optimizer) lives with its module's
    # other state
    def module_of(fqn: str) -> str:
        return fqn.rpartition(".")[0]

    by_module: dict[str, set[int]] = {}
    for fqn, owners in out.param_stages.items():
        by_module.setdefault(module_of(fqn), set()).update(owners)
    buffers = [n for n in nodes if n.op == "placeholder" and getattr(n.meta.get("spmd_input"), "kind", None) == "buffer"]
    for n in buffers:
        if stages[n]:
            by_module.setdefault(module_of(n.meta["spmd_input"].name), set()).update(stages[n])
    for n in buffers:
        if not stages[n]:
            stages[n] = frozenset(by_module.get(module_of(n.meta["spmd_input"].name), ()))

    # backward, in trace order: by the forward op differentiated, else where the gradient flows
    for n in nodes:
        if n.op != "call_function" or _phase(n) != "backward" or is_pipe_split(n):
            continue
        seq = n.meta.get("seq_nr", -1)
        bwd_in = [min(stages[a]) for a in n.all_input_nodes if _phase(a) == "backward" and stages.get(a)]
        if n.target is not operator.getitem and isinstance(seq, int) and seq in seq_stage:
            # gradients only flow to earlier stages: a node reading stage t's gradient runs
            # at stage t or before (autograd's accumulation of two gradient contributions
            # is traced under whichever op finished last, not the one that reads the sum)
            stages[n] = frozenset([min([seq_stage[seq], *bwd_in])])
            continue
        if bwd_in:
            stages[n] = frozenset([min(bwd_in)])
            continue
        fwd_in = [s for a in n.all_input_nodes for s in stages.get(a, ())]
        stages[n] = frozenset([max(fwd_in)]) if fwd_in else frozenset([num - 1])

    # optimizer: every stage owning a parameter the node touches (through its inputs, or,
    # for values made from constants such as Adam's initial step, through its users)
    opt_nodes = [n for n in nodes if n.op == "call_function" and _phase(n) == "optimizer"]
    for n in opt_nodes:
        owners: set[int] = set()
        for a in n.all_input_nodes:
            inp = a.meta.get("spmd_input")
            if a.op == "placeholder" and inp is not None and inp.kind in ("param", "optim"):
                owners |= set(out.param_stages.get(inp.name, ()))
            elif a.op == "placeholder" and inp is not None and inp.kind == "buffer":
                owners |= set(stages.get(a, ()))
            elif a in stages and _phase(a) in ("optimizer", "backward", "forward") and a.op == "call_function":
                owners |= set(stages[a])
        if owners:
            stages[n] = frozenset(owners)
    output_owner: dict[fx.Node, set[int]] = {}
    output_node = next(n for n in nodes if n.op == "output")
    for arg, desc in zip(output_node.args[0], outputs or []):
        if isinstance(arg, fx.Node) and getattr(desc, "kind", None) in ("param", "optim"):
            output_owner.setdefault(arg, set()).update(out.param_stages.get(desc.name, ()))
    for n in reversed(opt_nodes):
        if n in stages:
            continue
        owners = {s for u in n.users if u in stages and u.op == "call_function" for s in stages[u]}
        owners |= output_owner.get(n, set())
        stages[n] = frozenset(owners) if owners else frozenset(range(num))

    # optimizer-state placeholders live with their parameter
    for n in nodes:
        inp = n.meta.get("spmd_input")
        if n.op == "placeholder" and inp is not None and inp.kind == "optim":
            stages[n] = frozenset(out.param_stages.get(inp.name, (0,)))
        elif n.op == "placeholder" and not stages.get(n):
            stages[n] = frozenset(s for u in n.users for s in stages.get(u, ()))
    for n in buffers:
        out.buffer_stages[n.meta["spmd_input"].name] = tuple(sorted(stages[n]))
    out.stages = {n.name: s for n, s in stages.items()}
    _check(gm, out, fwd)
    return out


def _check(gm: fx.GraphModule, a: StageAssignment, fwd: dict[fx.Node, int]) -> None:
    """Forward values flow to later stages only; backward values to earlier ones."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        mine = a.stages.get(n.name, frozenset())
        for i in n.all_input_nodes:
            theirs = a.stages.get(i.name, frozenset())
            if not mine or not theirs or i.op in ("placeholder", "get_attr"):
                continue
            if _phase(n) == "forward" and _phase(i) == "forward" and min(mine) < max(theirs):
                raise SpmdError(
                    f"forward node {n.name} (stage {min(mine)}) reads {i.name} from the later stage {max(theirs)}; "
                    f"stages must follow the order of the forward"
                )
