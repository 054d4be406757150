"""Branches of the optimizer on its own numbers: value guards.

Some optimizers decide in Python what to do from numbers they keep as tensors: RAdam's
``if rho_t > 5.0`` (a function of the step counter), ASGD's ``if mu.item() != 1``,
SGD's ``if momentum != 0`` once ``momentum`` is a graph input (schedulers such as
OneCycleLR change it every step). Read inside a traced step those numbers are symbols
without a value, and the ``if`` cannot be traced.

These numbers come only from *host scalars*: the lifted hyperparameters and the 0-d
optimizer state (``step``, ``eta``, ``mu``), never from parameters or the batch. So while
``optimizer.step()`` is traced, those inputs carry their real values (torch's
real-tensor propagation, limited to them: an op computes for real only when all its
tensor inputs have real values, a handful of 0-d ops per parameter), each ``.item()``
of them gets its value, and a branch on them is taken as on one device and recorded as
a :class:`ValueGuard` instead of failing.

A value guard is re-checked before every call (:meth:`ValueGuard.holds`): the slice of
the graph from those inputs to the ``.item()`` reads is run on the current values and
the branch condition evaluated. Its outcome is part of the call signature, so the step
is compiled again only when a branch flips (RAdam once, around step 6). Branches on
anything else (the loss, a parameter's norm) still raise
:class:`~spmd_compiler.errors.DataDependentError`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..errors import DataDependentError

__all__ = ["ValueGuard", "attach_values", "host_scalar_values", "value_guards_of", "is_host_scalar_input"]

log = logging.getLogger(__name__)

def is_host_scalar_input(inp: Any) -> bool:
    """Inputs (GraphInput) whose real values are known while tracing: lifted
    hyperparameters and 0-d optimizer state (step counters and the like)."""
    return inp.kind == "hparam" or (inp.kind == "optim" and tuple(inp.shape) == ())


def attach_values(fakes: Sequence[Any], values: dict[int, torch.Tensor]) -> None:
    """Give the traced inputs ``fakes[i]`` their real values ``values[i]`` (copies made
    outside the fake mode: operations on them during the trace write to them)."""
    for i, real in values.items():
        pt.set_real_value(fakes[i], real)


@contextlib.contextmanager
def host_scalar_values(mode: Any, optimizer: Any, enabled: bool = True) -> Iterator[None]:
    """Let ``mode`` compute real values during ``optimizer.step()``, for the ops whose
    tensor inputs all have one (:func:`attach_values`)."""
    if optimizer is None or not enabled:
        yield
        return
    pre = optimizer.register_step_pre_hook(lambda *_: pt.propagating_real_values(mode, True))
    post = optimizer.register_step_post_hook(lambda *_: pt.propagating_real_values(mode, False))
    torch_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    torch_log.addFilter(_quiet)  # torch warns at every branch it takes on a real value
    try:
        yield
    finally:
        torch_log.removeFilter(_quiet)
        pre.remove()
        post.remove()
        pt.propagating_real_values(mode, False)


def _quiet(record: logging.LogRecord) -> bool:
    return not pt.is_real_value_log(record)


@dataclass(frozen=True, eq=False)
class ValueGuard:
    """A branch the traced optimizer took on host scalars: ``condition`` (over the
    numbers ``program`` computes from ``inputs``; the branch or its negation, one form
    for both) decides which way it goes.

    ``key`` identifies the branch across traces; ``source`` is the user's line (or the
    optimizer's) that branched, for logs and recompile reasons.
    """

    key: str
    inputs: tuple[Any, ...]  # GraphInput of each placeholder of ``program``
    program: fx.GraphModule
    symbols: tuple[sympy.Symbol, ...]
    condition: Any
    source: str

    def holds(self, state: Any) -> bool:
        """``condition`` for the values in ``state`` (a ModelState): which way the branch goes."""
        from .state import input_value

        args = [pt.local_tensor(input_value(inp, state, [])).detach().clone() for inp in self.inputs]
        with torch.no_grad():
            values = [_number(v) for v in self.program(*args)]
        fn = self.__dict__.get("_fn", False)
        if fn is False:
            fn = self.__dict__["_fn"] = pt.sympy_as_python(self.condition, self.symbols)
        if fn is not None:
            return bool(fn(*values))
        return bool(self.condition.xreplace({s: sympy.sympify(v) for s, v in zip(self.symbols, values)}))

    def __repr__(self) -> str:
        return f"ValueGuard({self.key})"


def _number(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) else v


def value_guards_of(gm: fx.GraphModule, mode: Any, inputs: Sequence[Any]) -> list[ValueGuard]:
    """The branches the trace (in fake mode ``mode``) took on real host-scalar values;
    ``inputs`` are the GraphInputs of ``gm``'s placeholders, in order."""
    conditions = pt.real_value_branches(mode)
    if not conditions:
        return []
    labels = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs))
    readers: dict[sympy.Symbol, fx.Node] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = pt.symbol_of(val)  # as read, before replacements
            if isinstance(expr, sympy.Symbol) and expr not in readers:
                readers[expr] = node
    guards: dict[str, ValueGuard] = {}
    for expr, stack in conditions:
        guard = _guard(expr, readers, labels, stack)
        guards.setdefault(guard.key, guard)
    return list(guards.values())


def _cannot_recheck(expr: Any, stack: Any, why: str) -> None:
    raise DataDependentError(
        f"the step branches on `{expr}`, decided on real values while tracing, but {why}, so the "
        "compiled step could not tell when the branch goes the other way",
        _frame(stack) if stack is not None else None,
        "compute both sides and select with torch.where(cond, a, b) instead of `if` on a tensor's value",
    )


def _guard(expr: Any, readers: dict[sympy.Symbol, fx.Node], labels: dict[fx.Node, Any], stack: Any) -> ValueGuard:
    symbols = tuple(sorted(expr.free_symbols, key=str))
    if any(s not in readers for s in symbols):
        _cannot_recheck(expr, stack, "a number it reads has no node in the graph")
    outs = [readers[s] for s in symbols]
    needed: set[fx.Node] = set()
    todo = list(outs)
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        todo.extend(n.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs, parts = [], []
    order = [n for n in outs[0].graph.nodes if n in needed]
    for i, n in enumerate(order):
        if n.op == "placeholder":
            if not is_host_scalar_input(labels[n]):
                _cannot_recheck(expr, stack, f"it depends on {labels[n].label}, which is not a host scalar")
            env[n] = graph.placeholder(f"n{i}")
            inputs.append(labels[n])
            parts.append(f"n{i}={labels[n].label}")
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
            env[n].name = f"n{i}"
            flat = pytree.tree_leaves((n.args, n.kwargs))
            args = ",".join(f"n{order.index(a)}" if isinstance(a, fx.Node) else repr(a) for a in flat)
            parts.append(f"n{i}={n.target}({args})")
    graph.output(tuple(env[o] for o in outs))
    atom = pt.branch_atom(expr)  # a branch and its other side are one guard
    renamed = atom.xreplace({s: sympy.Symbol(f"v{order.index(readers[s])}") for s in symbols})
    key = f"{renamed} where " + "; ".join(parts)
    return ValueGuard(key, tuple(inputs), fx.GraphModule(torch.nn.Module(), graph), symbols, atom, _frame(stack))


def _frame(stack: Any) -> str:
    try:
        frames = [f for f in stack.summary() if "/torch/fx/" not in f.filename and "/torch/_" not in f.filename]
        f = frames[-1]
        return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
    except Exception:  # a traceback torch could not capture
        return "?"
