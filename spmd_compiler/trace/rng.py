"""Random numbers that a traced step draws again: activation checkpointing's recompute.

``torch.utils.checkpoint`` saves the generator state before a checkpointed forward and,
when backward recomputes it, restores that state around the recompute
(``torch.random.fork_rng`` + ``set_rng_state``), so the recompute draws the forward's
numbers again (dropout gets the same mask) and the generator ends where it was.

During tracing the real generator never moves (fake tensors draw nothing), so the
recompute's random ops would become fresh draws in the graph. :func:`rng_replay` watches
the generator-state calls made while tracing and records, for each, where in the
sequence of the graph's random ops the (abstract) generator stands;
:func:`replay_recomputed_draws` then makes every random op drawn from a restored
position use the value of the op that drew there first. The program draws each number
once, as the single-device step's generator does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..errors import SpmdError, add_context

__all__ = ["RngLedger", "rng_replay", "replay_recomputed_draws", "is_random_op"]

log = logging.getLogger(__name__)


def is_random_op(node: fx.Node) -> bool:
    """Whether ``node`` draws from the generator: an op torch tags as seeded. The fused
    attention kernels' backwards are tagged too (for their dropout) but draw nothing: they
    replay the philox seed and offset their forward returned, so they are no draw (counted
    as one, a checkpointed recompute's draws were paired with the wrong forward ones). The
    forwards stay draws, with or without dropout: a checkpointed recompute of one reuses
    the forward's outputs (as torch.compile's partitioner keeps them)."""
    if node.op != "call_function" or not getattr(node.target, "_nondeterministic_seeded", False):
        return False
    name = getattr(getattr(node.target, "_schema", None), "name", "")
    return not (name.startswith("aten::_") and "attention" in name and name.endswith("_backward"))


@dataclass
class RngLedger:
    """Generator-state reads and writes seen while tracing, in order: ``(number of random
    ops in the graph at that moment, "get" or "set", state token)``."""

    events: list[tuple[int, str, int]] = field(default_factory=list)
    states: dict[int, torch.Tensor] = field(default_factory=dict)  # token -> the state handed out (kept alive)
    seeded: str | None = None  # a manual_seed call inside the step (where)


def _draws_so_far() -> int:
    graph = pt.tracing_graph()
    return 0 if graph is None else sum(1 for n in graph.nodes if is_random_op(n))


@contextlib.contextmanager
def rng_replay(ledger: RngLedger) -> Iterator[None]:
    """Record torch's generator-state calls (CPU and CUDA) made while tracing."""
    patched: list[tuple[Any, str, Any]] = []

    def wrap_get(owner: Any, name: str) -> None:
        orig = getattr(owner, name)

        def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
            state = orig(*args, **kwargs)  # a fresh tensor per call
            ledger.states[id(state)] = state
            ledger.events.append((_draws_so_far(), "get", id(state)))
            return state

        patched.append((owner, name, orig))
        setattr(owner, name, get_rng_state)

    def wrap_set(owner: Any, name: str) -> None:
        orig = getattr(owner, name)

        def set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            ledger.events.append((_draws_so_far(), "set", id(new_state)))  # the real generator is left alone

        patched.append((owner, name, orig))
        setattr(owner, name, set_rng_state)

    wrap_get(torch, "get_rng_state")
    wrap_set(torch, "set_rng_state")
    wrap_get(torch.random, "get_rng_state")
    wrap_set(torch.random, "set_rng_state")
    if torch.cuda.is_available():
        wrap_get(torch.cuda, "get_rng_state")
        wrap_set(torch.cuda, "set_rng_state")
    orig_seed = torch.manual_seed

    def manual_seed(seed: Any) -> Any:
        ledger.seeded = f"torch.manual_seed({seed!r})"
        return orig_seed(seed)

    patched.append((torch, "manual_seed", orig_seed))
    torch.manual_seed = manual_seed
    try:
        yield
    finally:
        for owner, name, orig in reversed(patched):
            setattr(owner, name, orig)


def replay_recomputed_draws(gm: fx.GraphModule, ledger: RngLedger) -> int:
    """Make the random ops drawn from a restored generator position reuse the values
    first drawn there; returns how many were replaced."""
    if ledger.seeded is not None:
        raise SpmdError(
            f"the step calls {ledger.seeded}: a compiled step draws its random numbers from the generator every "
            "rank agrees on, and a seed set inside the traced step would be set once at trace time, not at every "
            "call. fix: seed before calling the compiled step (torch.manual_seed(seed) at the start of training)"
        )
    live: list[fx.Node] = []
    cursor: int | None = None  # None: drawing fresh numbers; else: the live draw being replayed
    position: dict[int, int] = {}
    replays: list[tuple[fx.Node, fx.Node]] = []
    events = iter(ledger.events)
    pending = next(events, None)

    def apply_until(count: int) -> None:
        """Apply the events recorded when ``count`` random ops had been traced."""
        nonlocal cursor, pending
        while pending is not None and pending[0] <= count:
            _, kind, token = pending
            here = len(live) if cursor is None else cursor
            if kind == "get":
                position[token] = here
            elif token not in position:
                raise SpmdError(
                    "the step sets the random generator's state to one it did not read inside the step "
                    "(torch.set_rng_state of a state saved before the call): the compiled program cannot restore it. "
                    "fix: set the state before calling the compiled step"
                )
            else:
                cursor = None if position[token] == len(live) else position[token]
            pending = next(events, None)

    draws = [n for n in gm.graph.nodes if is_random_op(n)]
    for i, node in enumerate(draws):
        apply_until(i)
        if cursor is None:
            live.append(node)
        else:
            replays.append((node, live[cursor]))
            cursor = cursor + 1 if cursor + 1 < len(live) else None
    apply_until(len(draws))
    for node, first in replays:
        _check_same_draw(node, first)
        node.replace_all_uses_with(first)
        gm.graph.erase_node(node)
    if replays:
        log.info("activation checkpointing: %d recomputed random op(s) reuse the forward's draws", len(replays))
    return len(replays)


def _shape(node: fx.Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in val)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else val


def _check_same_draw(node: fx.Node, first: fx.Node) -> None:
    scalars = lambda n: [a for a in n.args[1:] if not isinstance(a, fx.Node)]  # noqa: E731
    if node.target is not first.target or scalars(node) != scalars(first) or str(_shape(node)) != str(_shape(first)):
        raise add_context(
            SpmdError(
                f"a recomputed region draws {node.format_node()} where its forward drew {first.format_node()}: the "
                "recompute would not get the forward's random numbers. fix: make the checkpointed function draw the "
                "same random ops in the same order each time it runs"
            ),
            node,
        )
