"""``compile(..., dynamic=True)``: expand with symbolic batch sizes, or fall back.

:func:`expand_dynamic` tries the symbolic expansion (:mod:`spmd_compiler.expand.symbolic`).
When a size cannot stay symbolic (an op whose rule or DTensor strategy needs a concrete
size, a decision that pins a batch size to the example's value), it logs one INFO line
naming the op and the user's line, and returns the per-shape expansion of today: the
program is then exactly the one ``dynamic=False`` builds, so the option never changes a
number. See docs/dynamic_shapes.md for what stays symbolic.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from .. import _private_torch as pt
from ..errors import SpmdError, user_source_line

__all__ = ["expand_dynamic", "pinned_symbols"]

log = logging.getLogger(__name__)


def pinned_symbols(step: Any) -> list[Any]:
    """The size symbols a guard fixed to one value (the program would serve one size)."""
    env = pt.shape_env_of(pt.fake_mode_of(step.traced.placeholders()[step.size_symbols[0].index].meta["val"]))
    out = []
    for s in step.size_symbols:
        lo, hi = pt.symbol_range(env, s.symbol)
        if pt.is_pinned(env, s.symbol) or (lo is not None and lo == hi):
            out.append(s)
    return out


def expand_dynamic(expand: Any, traced: Any, **kwargs: Any) -> Any:
    """``expand(traced, dynamic=True, **kwargs)``, or ``expand(traced, dynamic=False,
    **kwargs)`` after one INFO log when the sizes cannot stay symbolic. A trace that
    fell back once (``traced.dynamic_fallback`` holds why) is not tried again."""
    why = getattr(traced, "dynamic_fallback", None)
    if why is None:
        try:
            with warnings.catch_warnings():
                # recipe nodes take SymInt sizes, which fx warns about; emit_sizes_pass
                # replaces them by integer nodes before the program runs
                warnings.filterwarnings("ignore", message="Raw Sym", category=UserWarning)
                step = expand(traced, dynamic=True, **kwargs)
        except (SpmdError, RuntimeError, TypeError, ValueError, NotImplementedError) as e:
            node = getattr(e, "spmd_node", None)
            why = _why(node, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        else:
            if not step.size_symbols:
                why = _pinned_in_trace(traced) or "no batch dim of the trace is symbolic (the plan shards none, or symbolic='none')"
            else:
                pinned = pinned_symbols(step)
                if not pinned:
                    return step
                nodes = [n for n, _ in step.size_guard_nodes]
                why = _why(nodes[-1] if nodes else None, f"a guard fixed {pinned[0].label} dim {pinned[0].dim} to one size")
        traced.dynamic_fallback = why
    if not getattr(traced, "dynamic_fallback_logged", False):  # once per trace (the trace may have said why)
        traced.dynamic_fallback_logged = True
        log.info("dynamic=True: the batch sizes cannot stay symbolic, compiling one program per batch shape: %s", why)
    return expand(traced, dynamic=False, **kwargs)


def _why(node: Any, what: str) -> str:
    if node is None:
        return what
    line = user_source_line(node)
    return f"{node.target} ({node.name}{', ' + line if line else ''}): {what}"


def _pinned_in_trace(traced: Any) -> str | None:
    """The trace's guard that fixed a batch size to its example value (``if x.size(0) == 6``),
    with the user's line, or None."""
    import sympy

    mode = next((m for n in traced.placeholders() if (m := pt.fake_mode_of(n.meta.get("val"))) is not None), None)
    if mode is None:
        return None
    for expr, where in pt.shape_env_guards(pt.shape_env_of(mode)):
        if isinstance(expr, sympy.Eq) and any(a.is_Symbol for a in expr.args) and any(a.is_Integer for a in expr.args):
            return f"the step branches on a batch size ({expr}, at {where}), which fixes it"
    return None
