"""When a collective of the step fails: say which one, and which ranks did not come.

A timeout or a dead peer surfaces from gloo or NCCL as a bare ``RuntimeError``
("Connection closed by peer", "Timed out waiting ...") naming no step, node or value.
:func:`collective_failure` turns it into a :class:`~spmd_compiler.errors.CollectiveError`:
the node the per-rank program was running (from the generated code's line), its
collective's provenance (kind, mesh axis, which value, which traced node, the user's
source line), and a roll call through the rendezvous store: every surviving rank writes
where it failed and waits a few seconds for the others; the ranks that never write are
named as not having arrived (dead, or stuck elsewhere).
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

import torch.distributed as dist
import torch.fx as fx

from .. import _private_torch as pt
from ..errors import CollectiveError, user_source_line
from ..optimize.graph_utils import is_collective, is_wait

__all__ = ["collective_failure", "failed_node", "is_collective_node"]

log = logging.getLogger(__name__)

ROLL_CALL_SECONDS = 5.0


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
    """Write this rank's failure to the store and name the ranks that do not write theirs."""
    store = pt.default_store()
    if store is None or not dist.is_initialized():
        return "no rendezvous store to ask which ranks are alive"
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store.set(f"spmd_compiler/failure/{tag}/{rank}", what)
        missing = list(range(world))
        deadline = time.monotonic() + ROLL_CALL_SECONDS
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"spmd_compiler/failure/{tag}/{r}"])]
            if missing:
                time.sleep(0.1)
    except Exception as e:  # the store lives on rank 0's host: it may be the one that died
        return f"could not reach the rendezvous store ({type(e).__name__}); rank 0, which hosts it, may be the rank that died"
    if not missing:
        return "every rank reported the same failure"
    return f"rank(s) {missing} did not report within {ROLL_CALL_SECONDS:.0f}s (dead, or stuck elsewhere)"


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
