"""A Chrome / Perfetto trace of one step, timed from a real run.

``step.trace_step("step.json")`` (every rank) or ``SPMD_COMPILER_TRACE=step.json`` runs
one call of a :class:`~spmd_compiler.CompiledStep` on a timed runner
(:func:`~.executor.compile_runner` with ``timed=True``: two clock reads per node), gathers
every rank's spans on rank 0 and writes them in the Trace Event Format, which
``ui.perfetto.dev`` and ``chrome://tracing`` open:
``{"traceEvents": [{"name", "ph": "X", "ts", "dur", "pid", "tid", "args"}, ...]}``.

Layout: one process per rank (``pid`` = rank, named ``rank R (coordinate ...)``), with
three threads:

* ``compute`` (tid 1): one span per node the rank runs, named after its op (``aten.mm``),
  with the node, the traced node it came from, the user's line, the phase and the local
  shape in ``args``; a collective's launch and its ``wait_tensor`` are spans here too
  (the time this thread spent on them), as is the step check's wait (``step check``);
* ``collectives`` (tid 2): one span per collective from its launch to the end of its
  wait (in flight, as this thread saw it), named ``<kind> on <axis>: <why>``, with the
  full description (value, transition, consumer, user line), bytes and ring bytes; a
  collective launched while another is in flight goes on a thread of its own (tid 3, ...:
  the spans of one thread must nest);
* ``phases`` (tid 0): the runs of forward, backward and optimizer nodes (``other``: nodes
  of no phase, the step check's).

Times (``ts``, ``dur``) are microseconds of the wall clock, from the trace's first
event; ranks of one machine share that clock.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..dump.format import describe_collective, short_source, target_name
from ..errors import user_source_line

__all__ = ["ENV_TRACE", "rank_events", "trace_json", "write_step_trace"]

log = logging.getLogger(__name__)

ENV_TRACE = "SPMD_COMPILER_TRACE"
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_PHASES, _COMPUTE, _COMMS = 0, 1, 2
_WALL_OFFSET_NS = time.time_ns() - time.perf_counter_ns()  # perf_counter -> wall clock, once per process


def _op_name(node: fx.Node) -> str:
    name = target_name(node.target)
    for suffix in (".default", ".Tensor", ".Scalar"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _waits(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """Each collective's waits (directly, or through the getitems of a list result)."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not _WAIT or not isinstance(n.args[0], fx.Node):
            continue
        src = n.args[0]
        if src.target is operator.getitem and isinstance(src.args[0], fx.Node):
            src = src.args[0]
        out.setdefault(src, []).append(n)
    return out


def _node_args(node: fx.Node) -> dict[str, Any]:
    args: dict[str, Any] = {"node": node.name, "phase": node.meta.get("spmd_phase", "?")}
    origin = node.meta.get("spmd_origin") or {}
    if origin.get("node"):
        args["from"] = origin["node"]
    line = short_source(user_source_line(node))
    if line:
        args["user line"] = line
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        args["local shape"] = list(val.shape)
        args["dtype"] = str(val.dtype).replace("torch.", "")
    return args


def _wall(ns: int) -> int:
    """A ``perf_counter_ns`` reading on the wall clock (ns; made microseconds by :func:`trace_json`)."""
    return ns + _WALL_OFFSET_NS


def rank_events(gm: fx.GraphModule, spans: Sequence[tuple[int, int, int]], *, rank: int,
                coordinate: Sequence[int] = ()) -> list[dict[str, Any]]:
    """The trace events of one rank's timed run of ``gm`` (``spans``: the timed runner's),
    ``ts`` and ``dur`` in wall-clock nanoseconds (:func:`trace_json` makes them microseconds)."""
    nodes = list(gm.graph.nodes)
    ended = {i: (t0, t1) for i, t0, t1 in spans}
    waits = _waits(gm)
    index = {n: i for i, n in enumerate(nodes)}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank} (coordinate {tuple(coordinate)})"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    for tid, name in ((_PHASES, "phases"), (_COMPUTE, "compute"), (_COMMS, "collectives")):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    lanes: list[int] = []  # the end of the last collective on each collectives thread (tid _COMMS + k)
    run: list[Any] = []  # the current phase run: [phase, start ns, end ns]
    for i, t0, t1 in spans:
        if i < 0:
            events.append({"name": "step check", "ph": "X", "ts": _wall(t0), "dur": t1 - t0, "pid": rank, "tid": _COMPUTE,
                           "args": {"what": "the per-step check that every rank runs the same program (its wait)"}})
            continue
        node = nodes[i]
        comm = node.meta.get("spmd_comm")
        wait_of = node.args[0] if node.target is _WAIT and node.args and isinstance(node.args[0], fx.Node) else None
        if wait_of is not None and wait_of.target is operator.getitem:
            wait_of = wait_of.args[0]
        name = _op_name(node)
        if comm is not None:
            name = f"launch {comm['kind']} ({node.name})"
        elif wait_of is not None and wait_of.meta.get("spmd_comm") is not None:
            name = f"wait {wait_of.meta['spmd_comm']['kind']} ({wait_of.name})"
        events.append({"name": name, "ph": "X", "ts": _wall(t0), "dur": t1 - t0, "pid": rank, "tid": _COMPUTE,
                       "args": _node_args(node)})
        phase = str(node.meta.get("spmd_phase", "other"))  # no phase: the step check's own nodes
        if run and run[0] == phase:
            run[2] = t1
        else:
            if run:
                events.append({"name": run[0], "ph": "X", "ts": _wall(run[1]), "dur": run[2] - run[1], "pid": rank, "tid": _PHASES})
            run = [phase, t0, t1]
        if comm is not None:
            done = [ended[index[w]][1] for w in waits.get(node, []) if index[w] in ended]
            end = max(done) if done else t1
            why = comm.get("why") or comm.get("reason") or ""
            # spans of one thread must nest: a collective launched while another is in flight gets a thread of its own
            lane = next((k for k, last in enumerate(lanes) if last <= t0), len(lanes))
            if lane == len(lanes):
                lanes.append(0)
                if lane:
                    events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": _COMMS + lane,
                                   "args": {"name": f"collectives (in flight together, {lane + 1})"}})
            lanes[lane] = end
            events.append({
                "name": f"{comm['kind']} on {comm['axis_name']}: {why}"[:160], "ph": "X", "ts": _wall(t0), "dur": end - t0,
                "pid": rank, "tid": _COMMS + lane,
                "args": {"node": node.name, "collective": describe_collective(node), "bytes": comm.get("bytes"),
                         "ring bytes sent": comm.get("wire_bytes"), "phase": node.meta.get("spmd_phase", "?"),
                         "group size": comm.get("group_size")},
            })
    if run:
        events.append({"name": run[0], "ph": "X", "ts": _wall(run[1]), "dur": run[2] - run[1], "pid": rank, "tid": _PHASES})
    return events


def trace_json(per_rank: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """Every rank's events (:func:`rank_events`) in one Trace Event Format object, times in
    microseconds from the first event."""
    events = [dict(e) for evs in per_rank for e in evs]
    start = min((e["ts"] for e in events if "ts" in e), default=0)
    for e in events:
        if "ts" in e:
            e["ts"] = (e["ts"] - start) / 1000
            e["dur"] = e["dur"] / 1000
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"producer": "spmd_compiler step trace"}}


def write_step_trace(path: str | os.PathLike, gm: fx.GraphModule, spans: Sequence[tuple[int, int, int]], *,
                     coordinate: Sequence[int] = ()) -> pathlib.Path | None:
    """Gather every rank's events on rank 0 (collective: every rank calls it) and write
    them to ``path`` there; returns the path on rank 0, None elsewhere."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = rank_events(gm, spans, rank=rank, coordinate=coordinate)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    if rank != 0:
        return None
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace_json(gathered or [])))
    log.info("step trace written to %s (open it in ui.perfetto.dev)", out)
    return out
