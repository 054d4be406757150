"""Running a per-rank graph with little Python between ops.

fx's generated code calls ``torch.ops.aten.mm.default(a, b)``: four attribute lookups
and ``OpOverload.__call__``'s Python frame per op, about 1.1 us of a 2.8 us call for a
small op (measured on the CI machine). A compiled training step makes about a thousand
such calls per step, where DDP's backward runs inside autograd's C++ engine.
:func:`compile_runner` emits the same straight-line program with every operator bound
once to the dispatcher handle ``OpOverload.__call__`` forwards to, and frees each value
after its last use as fx does. The GraphModule stays the reference (dumps, passes,
pipelines); the runner only executes it.

With ``timed=True`` the runner also records, for every node it runs, ``(node index, start
ns, end ns)`` (``time.perf_counter_ns``) in ``run.spans``, and ``(-1, start, end)`` for the
step check's wait; :mod:`.step_trace` makes a Chrome/Perfetto trace of them.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from .. import _private_torch as pt

__all__ = ["compile_runner"]

_LITERALS = (bool, int, str, type(None))


def compile_runner(gm: fx.GraphModule, *, guard: bool = False, check_before: fx.Node | None = None,
                   timed: bool = False) -> Callable[..., Any]:
    """A function equivalent to ``gm.forward`` for a flat graph of call_function,
    get_attr, placeholder and output nodes.

    With ``guard`` the function takes a keyword ``_check``, a callable it calls right
    before running ``check_before`` (or before returning, if that is None or absent):
    the step guard's wait (:mod:`spmd_compiler.driver.guard`). ``run.node_at_line`` maps a
    line of the generated code to the node it runs (for errors). ``timed``: see the module doc.
    """
    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a] = i
    env: dict[str, Any] = {}
    spans: list[tuple[int, int, int]] = []
    if timed:
        env.update(_now=time.perf_counter_ns, _spans=spans)

    def bind(obj: Any, hint: str) -> str:
        name = f"_g{len(env)}_{re.sub(r'[^0-9a-zA-Z_]', '_', hint)[:40]}"
        env[name] = obj
        return name

    def render(x: Any) -> str:
        if isinstance(x, fx.Node):
            return x.name
        if isinstance(x, list):
            return "[" + ", ".join(render(v) for v in x) + "]"
        if isinstance(x, tuple):
            return "(" + ", ".join(render(v) for v in x) + ("," if len(x) == 1 else "") + ")"
        if isinstance(x, _LITERALS) or (isinstance(x, float) and math.isfinite(x)):
            return repr(x)
        return bind(x, type(x).__name__)  # dtypes, devices, memory formats, inf/nan

    params = [n.name for n in nodes if n.op == "placeholder"]
    guarded = guard
    lines = [f"def run({', '.join(params + (['*', '_check'] if guarded else []))}):"]
    node_at_line: dict[int, fx.Node] = {}
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            continue
        if guarded and (n is check_before or n.op == "output"):
            lines.extend(["    _spmd_t = _now()", "    _check()", "    _spans.append((-1, _spmd_t, _now()))"] if timed else ["    _check()"])
            guarded = False
        if n.op == "output":
            lines.append(f"    return {render(n.args[0])}")
            break
        if timed:
            lines.append("    _spmd_t = _now()")
        node_at_line[len(lines) + 1] = n
        if n.op == "get_attr":
            lines.append(f"    {n.name} = {bind(getattr(gm, n.target), 'attr')}")
        elif n.op == "call_function":
            fn = bind(pt.raw_operator(n.target), getattr(n.target, "__name__", "op"))
            args = [render(a) for a in n.args] + [f"{k}={render(v)}" for k, v in n.kwargs.items()]
            call = f"{fn}({', '.join(args)})"
            lines.append(f"    {n.name} = {call}" if n.users else f"    {call}")
        else:
            raise ValueError(f"cannot run node {n.format_node()}: expected call_function, get_attr, placeholder or output")
        if timed:
            lines.append(f"    _spans.append(({i}, _spmd_t, _now()))")
        dead = [a.name for a in n.all_input_nodes if last_use[a] == i]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    source = "\n".join(lines) + "\n"
    code = compile(source, f"<spmd_compiler per-rank step {id(gm):x}>", "exec")
    exec(code, env)
    run = env["run"]
    run.source = source  # type: ignore[attr-defined]
    run.node_at_line = node_at_line  # type: ignore[attr-defined]
    run.spans = spans  # type: ignore[attr-defined]
    return run
