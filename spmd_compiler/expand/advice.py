"""Advice on a plan, read from its expansion: activations gathered that FSDP would not gather.

``Plan(params={"*": [Shard(0)]})`` on a mesh axis where the batch is split along dim 0
looks like FSDP, but without ``fsdp_axes`` a sharded parameter is an operand like any
other: DTensor keeps it sharded and redistributes the *activations* (and the batch) to
match it. That is exact, and sometimes wanted (activation-sharding plans), but it is not
what "shard the parameters" means to an FSDP user, and on most models it moves more
bytes. :func:`activation_gather_advice` detects it and says what ``fsdp_axes`` would do.

Terms:

* *state-derived* value: a traced value computed from parameters, buffers, gradients
  or optimizer state only (``weight.t()``); gathering one is gathering a parameter.
* *activation gather*: an ``all_gather`` or ``all_to_all`` in forward or backward of a
  value that is not state-derived (the batch, an activation, an activation gradient).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from .. import _private_torch as pt
from .._format import format_bytes

__all__ = ["activation_gather_advice", "log_advice"]

log = logging.getLogger(__name__)

_STATE = ("param", "buffer", "grad", "optim")
_GATHERS = ("all_gather", "all_to_all")
_PHASES = ("forward", "backward")
_NAMED = 4  # gathered values named in the message


def _is_shard(p: Any) -> bool:
    return isinstance(p, (pt.Shard, pt.StridedShard))


def _state_derived(traced_graph: Any) -> set[str]:
    """Names of the traced nodes computed from training state only."""
    out: set[str] = set()
    for n in traced_graph.nodes:
        if n.op == "placeholder":
            inp = n.meta.get("spmd_input")
            if inp is not None and inp.kind in _STATE:
                out.add(n.name)
        elif n.op == "call_function":
            ins = n.all_input_nodes
            if ins and all(i.name in out for i in ins):
                out.add(n.name)
    return out


def _fsdp_bytes(ex: Any, params: list[tuple[Any, tuple]], axis: int) -> tuple[int, int]:
    """(bytes, collectives) per rank per step that gathering ``params`` on ``axis`` for
    every phase that reads them (forward, backward) would take, as ``fsdp_axes`` does."""
    phases: dict[str, set[str]] = {}
    for n in ex.traced.gm.graph.nodes:
        inp = n.meta.get("spmd_input") if n.op == "placeholder" else None
        if inp is not None and inp.kind == "param":
            phases[inp.name] = {u.meta.get("spmd_phase") for u in n.users} & set(_PHASES)
    total = count = 0
    for inp, placements in params:
        ways = math.prod(ex.mctx.shape[a] for a, p in enumerate(placements) if a != axis and _is_shard(p))
        nbytes = math.prod(inp.shape) * inp.dtype.itemsize // max(1, ways)
        k = len(phases.get(inp.name, ()))
        total += nbytes * k
        count += k
    return total, count


def activation_gather_advice(ex: Any) -> tuple[str, str] | None:
    """``(mesh axis name, warning)`` for an expansion that gathers activations on a mesh
    axis only because parameters are sharded there without FSDP semantics, or None.

    It applies to a mesh axis (of size > 1) that is not in ``fsdp_axes``, on which the
    plan shards at least one parameter and splits a batch input along dim 0 (data
    parallel), and on which forward or backward gathers an activation or the batch.
    A Megatron plan (batch whole on the tensor-parallel axis) and a sequence-parallel
    plan (batch split along the sequence) never qualify.
    """
    inputs = [(inp, ex.planned[(inp.kind, inp.name, inp.key)][0]) for inp in ex.traced.inputs]
    derived: set[str] | None = None
    for axis, size in enumerate(ex.mctx.shape):
        if size == 1 or axis in ex.fsdp_axes:
            continue
        params = [(i, pl) for i, pl in inputs if i.kind == "param" and _is_shard(pl[axis])]
        batch = [pl for i, pl in inputs if i.kind == "batch" and isinstance(pl[axis], pt.Shard) and pl[axis].dim == 0]
        if not params or not batch:
            continue
        if derived is None:
            derived = _state_derived(ex.traced.gm.graph)
        gathered: dict[str, int] = {}
        for n in ex.graph.nodes:
            comm = n.meta.get("spmd_comm")
            if comm is None or comm["axis"] != axis or comm["kind"] not in _GATHERS or n.meta.get("spmd_phase") not in _PHASES:
                continue
            value = comm.get("value")
            if value is None or value in derived:
                continue
            gathered[value] = gathered.get(value, 0) + comm["bytes"]
        if not gathered:
            continue
        name = ex.mctx.axis_names[axis]
        fsdp, num_fsdp = _fsdp_bytes(ex, params, axis)
        values = sorted(gathered, key=lambda v: -gathered[v])
        named = ", ".join(values[:_NAMED]) + (f" and {len(values) - _NAMED} more" if len(values) > _NAMED else "")
        whole = [pt.Replicate() if a == axis else p for a, p in enumerate(batch[0])]
        fix_axes = tuple(ex.mctx.axis_names[a] for a in sorted((*ex.fsdp_axes, axis)))
        return name, (
            f"spmd_compiler: the plan shards {len(params)} parameter(s) (e.g. {params[0][0].name}) on mesh axis "
            f"{name!r}, where the batch is split along dim 0, but {name!r} is not in fsdp_axes: the parameters stay "
            f"sharded for compute, and activations and the batch are redistributed (all_gather, all_to_all) to match them "
            f"({format_bytes(sum(gathered.values()))} per rank per step in forward and backward, {len(values)} values: "
            f"{named}). With {name!r} in fsdp_axes the parameters would be gathered instead "
            f"(about {format_bytes(fsdp)} in {num_fsdp} all_gathers per step) and no activation would be. "
            f"fix: for FSDP (parameters stored sharded, gathered for compute) write Plan(..., fsdp_axes={fix_axes!r}); "
            f"for tensor parallelism give every rank the whole batch on that axis (Plan(..., default_input="
            f"{whole!r})); to keep activation sharding, silence this logger ({__name__})"
        )
    return None


def log_advice(ex: Any, seen: set) -> None:
    """Log :func:`activation_gather_advice` at WARNING, once per mesh axis in ``seen`` (a
    set shared by the expansions of one compile: every simulated rank, every recompile)."""
    advice = activation_gather_advice(ex)
    if advice is not None and ("activation_gather", advice[0]) not in seen:
        seen.add(("activation_gather", advice[0]))
        log.warning("%s", advice[1])
