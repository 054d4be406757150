"""The device-memory budget: a plan that will not fit fails at compile time.

``compile(..., memory_budget_gb=80)`` compares the per-rank program's static peak
(:func:`spmd_compiler.dump.memory_trace`: every input, activation, gathered parameter,
gradient and collective buffer alive at once, in the program's order) with the budget,
on every rank inside the compile's agreed block, so every rank raises the same
:class:`~spmd_compiler.errors.MemoryBudgetError` before the step ever runs: the peak,
where it is reached, its largest contributors and a fix chosen by what dominates
(activations: checkpointing; parameters, gradients and optimizer state: sharding them;
gathered parameters: resharding after forward, bfloat16 gathers). The static trace counts
what the program holds, not the allocator's fragmentation or the backend's workspaces:
leave a margin (a budget of 90% of the device).
"""

from __future__ import annotations

from typing import Any

from .._format import format_bytes
from ..errors import MemoryBudgetError

__all__ = ["check_budget", "GIB"]

GIB = 2**30

_FIXES = {  # what dominates the peak -> the first thing to try
    "activations": "checkpoint activations: torch.utils.checkpoint around each block (or a selective policy, "
                   "create_selective_checkpoint_contexts), or fewer sequences per rank",
    "state": "shard parameters, gradients and optimizer state: Plan(params={'*': [Shard(0)]}, fsdp_axes=('dp',)) "
             "(FSDP), or more ranks on the FSDP axis",
    "gathered": "gather less at once: Plan(reshard_after_forward=True), bfloat16 gathers "
                "(compile(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))), or tensor parallelism",
}


def _category(what: str) -> str:
    if what in ("param", "grad", "optim", "buffer"):
        return "state"
    if "gathered parameters" in what or "all_gather" in what:
        return "gathered"
    return "activations"


def check_budget(trace: Any, budget_gb: float, *, name: str = "step") -> None:
    """Raise MemoryBudgetError when ``trace`` (a MemoryTrace) peaks above ``budget_gb`` GiB."""
    budget = int(budget_gb * GIB)
    if trace.peak_bytes <= budget:
        return
    parts = list(trace.breakdown().items())
    by_category: dict[str, int] = {}
    for what, nbytes in parts:
        by_category[_category(what)] = by_category.get(_category(what), 0) + nbytes
    first = max(by_category, key=by_category.get) if by_category else "activations"
    top = "\n".join(f"    {what:<40} {format_bytes(nbytes):>12}" for what, nbytes in parts[:6])
    others = [fix for key, fix in _FIXES.items() if key != first]
    raise MemoryBudgetError(
        f"{name} needs {format_bytes(trace.peak_bytes)} per rank at its static peak (node {trace.peak_node}, "
        f"{trace.peak_phase}), over compile(memory_budget_gb={budget_gb:g}) ({format_bytes(budget)}), by "
        f"{format_bytes(trace.peak_bytes - budget)}; nothing ran.\n  largest contributors at the peak:\n{top}\n"
        f"  fix: {_FIXES[first]}; else {'; or '.join(others)}",
        trace.peak_bytes, budget, parts)
