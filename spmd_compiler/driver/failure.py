"""When a collective of the step fails: say which one, and which ranks did not come.

A timeout or a dead peer surfaces from gloo or NCCL as a bare ``RuntimeError``
("Connection closed by peer", "Timed out waiting ...") naming no step, node or value.
:func:`collective_failure` turns it into a :class:`~spmd_compiler.errors.CollectiveError`:
the node the per-rank program was running (from the generated code's line), its
collective's provenance (kind, mesh axis, which value, which traced node, the user's
source line), and a roll call through the rendezvous store: every surviving rank writes
where it failed and waits a few seconds for the others; the ranks that never write are
named as not having arrived.

Not arriving is not dying. A rank blocked in the same collective on a live peer (a ring
all_reduce: rank 0 waits for rank 1's data while rank 1, next to the dead rank 2, has
already failed) fails only when that peer's process ends or its own timeout passes, after
the roll call: it used to be named with the dead ("rank(s) [0, 2] did not report ...
(dead, or stuck elsewhere)" about a live rank 0). So every rank of a step keeps a
heartbeat in the store (:func:`start_heartbeat`: a daemon thread adds 1 to its counter
every second, also while the main thread waits in a collective, which releases the GIL),
and the roll call tells the ranks whose counter moved during its wait (alive, blocked in a
collective or elsewhere) from those whose did not (dead, or hung with the GIL held).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any

import torch.distributed as dist
import torch.fx as fx

from .. import _private_torch as pt
from ..errors import CollectiveError, user_source_line
from ..optimize.graph_utils import is_collective, is_wait

__all__ = ["collective_failure", "failed_node", "is_collective_node", "start_heartbeat", "stop_heartbeats"]

log = logging.getLogger(__name__)

ROLL_CALL_SECONDS = 5.0
HEARTBEAT_SECONDS = 1.0
_HEARTBEAT = "spmd_compiler/heartbeat"
_beating: dict[int, tuple[threading.Thread, threading.Event]] = {}  # id of the store -> its heartbeat (one per process)


def start_heartbeat() -> None:
    """Start this process's heartbeat (once; a daemon thread): ``store.add`` of 1 to its
    rank's counter every :data:`HEARTBEAT_SECONDS`. Stops quietly when the store goes, and
    at exit (:func:`stop_heartbeats`)."""
    store = pt.default_store()
    if store is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if id(store) in _beating and _beating[id(store)][0].is_alive():
        return
    key = f"{_HEARTBEAT}/{dist.get_rank()}"
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                store.add(key, 1)
            except Exception:  # the store (on rank 0) went away, or the group was torn down
                return
            stop.wait(HEARTBEAT_SECONDS)

    thread = threading.Thread(target=beat, name="spmd_compiler heartbeat", daemon=True)
    _beating[id(store)] = (thread, stop)
    thread.start()


def stop_heartbeats(timeout: float = 2.0) -> None:
    """Stop every heartbeat and wait for its thread to end (at exit: a thread still inside
    ``store.add`` when the interpreter finalizes is ended by Python as it takes the GIL
    back, inside C++, which aborts the process)."""
    for thread, stop in list(_beating.values()):
        stop.set()
    for thread, _ in list(_beating.values()):
        thread.join(timeout)
    _beating.clear()


def _beats(store: Any, ranks: list[int]) -> dict[int, int]:
    """The heartbeat counters of ``ranks`` (-1 for a rank that has none)."""
    return {r: int(store.add(f"{_HEARTBEAT}/{r}", 0)) if store.check([f"{_HEARTBEAT}/{r}"]) else -1 for r in ranks}


def failed_node(error: BaseException, runner: Any) -> fx.Node | None:
    """The node of the per-rank program that was running when ``error`` was raised (the
    runner's ``failed_node(error)`` first, where it has one: inductor's compiled code)."""
    if callable(getattr(runner, "failed_node", None)):
        node = runner.failed_node(error)
        if node is not None:
            return node
    lines = getattr(runner, "node_at_line", {})
    node = None
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_filename.startswith("<spmd_compiler per-rank step"):
            node = lines.get(lineno, node)
    return node


def is_collective_node(node: fx.Node | None) -> bool:
    """A functional collective or its wait."""
    return node is not None and (is_collective(node) or is_wait(node))


def _provenance(node: fx.Node) -> str:
    comm = node.meta.get("spmd_comm")
    if comm is None and node.args and isinstance(node.args[0], fx.Node):  # a wait: its collective
        comm = node.args[0].meta.get("spmd_comm")
    if comm is None:
        line = user_source_line(node)
        return f"node {node.name}" + (f" ({line})" if line else "")
    where = comm.get("source") or user_source_line(node)
    return (
        f"{comm.get('kind', 'collective')} on mesh axis {comm.get('axis_name', comm.get('axis'))!r} of {comm.get('value', '?')} "
        f"(node {node.name}, for traced node {comm.get('origin', '?')}: {comm.get('reason', '')})" + (f"\n  user code: {where}" if where else "")
    )


def _roll_call(tag: str, what: str) -> str:
    """Write this rank's failure to the store and name the ranks that do not write theirs.

    The store lives in rank 0's process. Rank 0 stays until every rank that reported has
    finished its roll call (``done``), so a survivor still waiting for a dead peer is not
    cut off by rank 0 raising and its process exiting, which used to be reported as
    "rank 0 may be the rank that died" about a live rank 0. Should the store go away all
    the same after rank 0 reported, the message says so instead of blaming rank 0."""
    store = pt.default_store()
    if store is None or not dist.is_initialized():
        return "no rendezvous store to ask which ranks are alive"
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"spmd_compiler/failure/{tag}"
    missing = list(range(world))
    try:
        store.set(f"{key}/{rank}", what)
        before = _beats(store, [r for r in range(world) if r != rank])
        deadline = time.monotonic() + ROLL_CALL_SECONDS
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{key}/{r}"])]
            if missing:
                time.sleep(0.1)
        after = _beats(store, missing)
        store.set(f"{key}/done/{rank}", "1")
        if rank == 0:  # keep the store up for the ranks still calling the roll
            reported = [r for r in range(world) if r not in missing]
            until = time.monotonic() + ROLL_CALL_SECONDS + 1.0
            while time.monotonic() < until and not all(store.check([f"{key}/done/{r}"]) for r in reported):
                time.sleep(0.1)
    except Exception as e:  # the store lives on rank 0's host
        if 0 not in missing:
            left = [r for r in missing if r != rank]
            return (f"the rendezvous store (on rank 0, which reported the same failure) closed during the roll call "
                    f"({type(e).__name__})" + (f"; rank(s) {left} had not reported by then (dead, or stuck elsewhere)" if left else ""))
        return f"could not reach the rendezvous store ({type(e).__name__}); rank 0, which hosts it, may be the rank that died"
    if not missing:
        return "every rank reported the same failure"
    alive = [r for r in missing if after[r] > before.get(r, -1) >= 0]
    silent = [r for r in missing if r not in alive]
    parts = []
    if silent:
        parts.append(f"rank(s) {silent} did not report within {ROLL_CALL_SECONDS:.0f}s and their heartbeat stopped (dead, or hung)")
    if alive:
        parts.append(f"rank(s) {alive} are alive (their heartbeat goes on) but did not report: blocked in a collective "
                     f"(waiting for a rank above) or busy elsewhere")
    return "; ".join(parts)


def collective_failure(
    error: BaseException, runner: Any = None, *, where: str | None = None, step_name: str, call: int, timeout: float | None
) -> CollectiveError:
    """A CollectiveError for ``error`` raised while running ``runner`` (or, with
    ``where``, in the driver's own collectives); every surviving rank makes one."""
    if where is None:
        node = failed_node(error, runner)
        where = _provenance(node) if node is not None else "outside any collective of the program"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    who = _roll_call(f"{step_name}/{call}", where)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CollectiveError(
        f"step {step_name!r} (call {call}) failed on rank {rank} in {where}\n"
        f"  backend said: {type(error).__name__}: {first}\n  {who}\n"
        f"  fix: look at the log of the rank(s) named above; if a rank is only slow (a long compile, a large "
        f"checkpoint), raise compile(..., timeout=...) (now {timeout}s)"
    )
