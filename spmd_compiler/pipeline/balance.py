"""Automatic stage balancing, as torchgpipe's balance_by_size / balance_by_time.

The candidates are the children of the model's first ``nn.ModuleList`` (transformer
blocks); each gets a cost: parameter bytes (``params``), FLOPs of one forward on the
example batch (``flops``, counted with torch's FlopCounterMode), or measured forward
time (``time``). The list is cut into contiguous groups minimizing the most expensive
group (what is before the list counts toward the first group, what is after toward the
last), and each group after the first starts with a split point.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..trace.markers import SplitPoint

__all__ = ["candidate_modules", "module_costs", "balanced_split", "partition_costs"]


def candidate_modules(model: torch.nn.Module) -> tuple[str, list[str]]:
    """``(list FQN, [child FQNs])`` of the model's first ModuleList with 2+ children."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) >= 2:
            return name, [f"{name}.{i}" if name else str(i) for i in range(len(mod))]
    raise ValueError(
        "automatic balancing needs the model to hold its layers in an nn.ModuleList (like model.blocks); "
        "none was found. fix: give split points (Pipeline(split={...})) or pipe_split() calls instead"
    )


def module_costs(model: torch.nn.Module, names: list[str], by: str, run: Callable[[], Any] | None) -> list[float]:
    """Cost of each module in ``names``: ``params`` | ``flops`` | ``time``."""
    mods = [model.get_submodule(n) for n in names]
    if by == "params":
        return [float(sum(p.numel() * p.element_size() for p in m.parameters())) for m in mods]
    if run is None:
        raise ValueError(f"balance_by={by!r} needs an example batch to run the model on")
    if by == "flops":
        from torch.utils.flop_counter import FlopCounterMode

        counts: list[float] = []
        handles = []
        for m in mods:
            box: dict[str, Any] = {}

            def pre(mod: Any, args: Any, box: dict = box) -> None:
                box["mode"] = FlopCounterMode(display=False)
                box["mode"].__enter__()

            def post(mod: Any, args: Any, out: Any, box: dict = box) -> None:
                box["mode"].__exit__(None, None, None)
                counts.append(float(box["mode"].get_total_flops()))

            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        try:
            with torch.no_grad():
                run()
        finally:
            for h in handles:
                h.remove()
        return counts
    if by == "time":
        times: list[float] = []
        handles = []
        for m in mods:
            box2: dict[str, float] = {}
            handles.append(m.register_forward_pre_hook(lambda mod, a, box=box2: box.__setitem__("t", time.perf_counter())))
            handles.append(m.register_forward_hook(lambda mod, a, o, box=box2: times.append(time.perf_counter() - box["t"])))
        try:
            with torch.no_grad():
                run()
        finally:
            for h in handles:
                h.remove()
        return times
    raise ValueError(f"balance_by must be 'params', 'flops' or 'time', got {by!r}")


def partition_costs(costs: list[float], parts: int) -> list[int]:
    """Start index of each of ``parts`` contiguous groups minimizing the largest sum."""
    n = len(costs)
    if parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} stages; fix: fewer stages (or more layers)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (parts + 1) for _ in range(n + 1)]
    cut = [[0] * (parts + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for i in range(1, n + 1):
        for k in range(1, min(parts, i) + 1):
            for j in range(k - 1, i):
                v = max(best[j][k - 1], prefix[i] - prefix[j])
                if v < best[i][k]:
                    best[i][k], cut[i][k] = v, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        j = cut[i][k]
        starts.append(j)
        i = j
    return sorted(starts)


def balanced_split(model: torch.nn.Module, stages: int, by: str = "params", run: Callable[[], Any] | None = None) -> dict[str, SplitPoint]:
    """Split points cutting the model's layer list into ``stages`` balanced groups."""
    _, names = candidate_modules(model)
    costs = module_costs(model, names, by, run)
    starts = partition_costs(costs, stages)
    return {names[i]: SplitPoint.BEGINNING for i in starts[1:]}
