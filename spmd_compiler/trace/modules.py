"""Which module each traced node comes from: ``node.meta["nn_module_stack"]``.

While the step is traced, torch's global module hooks keep the stack of the modules whose
``forward`` is running, each named by its path in the model (``blocks.0.attn.q``; the model
itself ``""``; a module the model does not hold, such as a loss module made in the step, by
its class), and fx copies it to every node it creates, in torch's format: ``{path: (path,
class name)}``, outermost first. Backward nodes carry none (autograd runs them outside any
forward), except the recomputed forward of activation checkpointing; a backward node's
module is its forward op's (``seq_nr``, see :func:`spmd_compiler.dump.modules.module_of`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .. import _private_torch as pt

__all__ = ["module_stacks"]


@contextlib.contextmanager
def module_stacks(model: torch.nn.Module) -> Iterator[None]:
    """While tracing: record the running modules' paths on every node (see the module doc)."""
    paths: dict[int, str] = {}
    for path, mod in model.named_modules():
        paths.setdefault(id(mod), path)
    stack: list[tuple[str, tuple[str, str]]] = []

    def pre(mod: torch.nn.Module, args: Any) -> None:
        cls = type(mod)
        path = paths.get(id(mod), cls.__name__)
        stack.append((path, (path, f"{cls.__module__}.{cls.__qualname__}")))
        pt.set_traced_module_stack(dict(stack))

    def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
        if stack:
            stack.pop()
        pt.set_traced_module_stack(dict(stack))

    remove = pt.module_call_hooks(pre, post)
    try:
        yield
    finally:
        remove()
        pt.set_traced_module_stack(None)
