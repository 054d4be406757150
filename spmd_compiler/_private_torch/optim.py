"""Creating a torch optimizer's lazy state without stepping.

``torch.optim`` optimizers create their per-parameter state (Adam's ``step``, ``exp_avg``,
``exp_avg_sq``; NAdam's ``mu_product``; Rprop's ``prev`` and ``step_size``...) in
``_init_group``, on their first ``step()``, and then run the same update every later step
runs. A compiled training step traced before that first step would be another program
than the steady one (it creates the state in the graph), and the second call would
compile again. :func:`create_lazy_state` runs ``step()``'s own code now with its update
function replaced by a no-op (found among the names ``step`` calls: the module-level
functions of the optimizer's own module other than ``_init_group``; ``adam`` for Adam and
AdamW), with a zero gradient for every trainable parameter that has none, and without the
optimizer's step hooks: the state is exactly what the first step creates before its
update, and the first step then runs the steady program on it. SGD's momentum buffer is
created inside its update (``clone(grad)``): without dampening a zero buffer gives the same
number (``0 * momentum + grad``), so it is created as zeros; with dampening it stays lazy.

Touches the optimizer class's undecorated ``step`` (``inspect.unwrap``) and its module's
globals. Checked against torch 2.13.0 and 2.14.1.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["create_lazy_state"]


def _update_functions(step: Any) -> list[str]:
    g = step.__globals__
    return [n for n in step.__code__.co_names
            if n != "_init_group" and callable(g.get(n)) and getattr(g[n], "__module__", None) == g.get("__name__")]


def create_lazy_state(optimizer: Any) -> int:
    """Create the state ``optimizer`` would create on its first ``step()`` for every
    trainable parameter that has none; returns for how many parameters it did (0 for an
    optimizer that is no ``torch.optim`` one, or creates its state in its update)."""
    if not isinstance(optimizer, torch.optim.Optimizer) or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        return 0
    if isinstance(optimizer, torch.optim.LBFGS):
        return 0
    missing = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad and p not in optimizer.state]
    if not missing:
        return 0
    step = inspect.unwrap(type(optimizer).step)
    names = _update_functions(step)
    if not names:
        return 0
    g = step.__globals__
    saved = {n: g[n] for n in names}
    zeroed = [p for p in missing if p.grad is None]
    before = {p: len(optimizer.state.get(p, {})) for p in missing}
    try:
        for p in zeroed:
            p.grad = torch.zeros_like(p)
        for n in names:
            g[n] = _no_update
        with torch.no_grad():
            step(optimizer)
    finally:
        for n, f in saved.items():
            g[n] = f
        for p in zeroed:
            p.grad = None
    for group in optimizer.param_groups:  # state the update itself fills (set to None here)
        for p in group["params"]:
            entry = optimizer.state.get(p) if p in before else None
            if entry is None:
                continue
            if entry.get("momentum_buffer", 0) is None and isinstance(optimizer, torch.optim.SGD) and group.get("dampening", 0) == 0:
                # SGD's first step takes clone(grad) as its buffer; 0 * momentum + grad is the same number
                entry["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key in [k for k, v in entry.items() if v is None]:
                del entry[key]
            if not entry:
                del optimizer.state[p]
    return sum(1 for p in missing if len(optimizer.state.get(p, {})) > before[p])


def _no_update(*args: Any, **kwargs: Any) -> None:
    return None
