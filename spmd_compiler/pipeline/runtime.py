"""Running the per-stage programs of a pipelined step on one rank.

Each rank of the pipeline axis holds one stage (or several with Interleaved1F1B: stage
``s`` lives on pipeline rank ``s mod p``). For every step the rank walks its schedule:

* before the first action of stage ``s`` in a step: ``G[s]``, what its forward and
  backward compute from the parameters alone (FSDP gathers), kept until its last
  backward of the step;
* ``F(s, mb)``: receive the forward values stage ``s`` reads from earlier stages (shapes
  and dtypes are known from compile time, so buffers are allocated up front and nothing
  else is exchanged), run ``F[s]`` on micro-batch ``mb``, send its values to later stages;
* ``B(s, mb)``: receive gradients from later stages, run ``B[s]``, send gradients to
  earlier stages, add the parameter gradients into this step's accumulators;
* after all micro-batches: gradients summed (and divided by the number of micro-batches
  when ``scale_grads``) go through ``O[s]``, the optimizer, once.

Sends are asynchronous and receives wait, so a rank only ever waits for data another
rank has already scheduled. Every action is timed; :meth:`PipelineRunner.timeline`
returns the spans for the Chrome trace and the text timeline.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import SpmdError
from ..expand.rules.random import is_random
from .schedule import build_schedule
from .stages import Piece, StageProgram

__all__ = ["PipelineRunner", "Span"]

log = logging.getLogger(__name__)


@dataclass
class Span:
    """One timed action of one rank: ``kind`` F, B, O, R (recomputed forward), send,
    recv; times in seconds."""

    rank: int
    kind: str
    stage: int
    microbatch: int | None
    start: float
    end: float
    detail: str = ""


@dataclass
class _Route:
    value: str
    src: int  # stage
    dst: int
    src_kind: str
    dst_kind: str
    tag: int


class PipelineRunner:
    """Executes a :class:`StageProgram` on this rank for a given schedule."""

    def __init__(self, program: StageProgram, *, pp_size: int, pp_coord: int, stage_rank: Any, chunks: int,
                 schedule: str, stages_per_rank: int, scale_grads: bool, pp_group: Any, checkpoint: str = "never",
                 piece_runner: Callable[[Piece], Callable[..., Any]] | None = None, rng_sync: Any = None) -> None:
        self.program = program
        self.rng_sync = rng_sync  # driver.rng.AxesRngSync over this stage's ranks (None: one rank per stage)
        self.pp = pp_size
        self.me = pp_coord
        self.stage_rank = stage_rank  # stage -> global rank holding it (with this rank's other coordinates)
        self.m = chunks
        self.scale_grads = scale_grads
        self.pp_group = pp_group
        self.checkpoint = checkpoint
        self.my_stages = [s for s in range(program.num_stages) if s % pp_size == pp_coord]
        self.order = build_schedule(schedule, pp_size, chunks, stages_per_rank)[pp_coord]
        # what runs each piece of this rank's stages: its GraphModule, or (backend="inductor")
        # the runner ``piece_runner`` makes of it (compiled on first use)
        self.runners: dict[tuple[int, str], Callable[..., Any]] = {
            key: (piece_runner(piece) if piece_runner is not None else piece.gm)
            for key, piece in program.pieces.items() if key[0] in self.my_stages}
        self.routes: list[_Route] = []
        first_use: dict[tuple[str, int, int], tuple[str, str]] = {}
        for value, t, s, tk, k in sorted(program.cross_stage()):
            if tk == "O":
                raise SpmdError(
                    f"value {value} flows from the optimizer part of stage {t} to the {dict(F='forward', B='backward', O='optimizer')[k]} "
                    f"part of stage {s}: code after backward() that combines values of several stages (such as "
                    f"torch.nn.utils.clip_grad_norm_ over all parameters) is not supported in a pipeline. fix: remove it from "
                    f"the step, or make it per parameter (e.g. clip_grad_value_), or compile without pipeline="
                )
            key = (value, t, s)  # sent once per destination stage, received at its first use
            if key not in first_use or "FBO".index(k) < "FBO".index(first_use[key][1]):
                first_use[key] = (tk, k)
        for i, ((value, t, s), (tk, k)) in enumerate(sorted(first_use.items())):
            self.routes.append(_Route(value, t, s, tk, k, i))
        self.spans: list[Span] = []
        self.peak_activation_bytes = 0  # last step: most bytes of micro-batch values held at once
        self.last_stage = program.num_stages - 1
        self._size_of: Callable[[Any, int | None], int] | None = None

    # ------------------------------------------------------------------ helpers
    def _tag(self, route: _Route, mb: int | None) -> int:
        return route.tag * 4096 + (mb if mb is not None else 4095)

    def _buffer(self, name: str, mb: int | None) -> torch.Tensor:
        v = self.program.vals[name]
        shape = tuple(v.shape) if self._size_of is None else tuple(self._size_of(d, mb) for d in v.shape)
        return torch.empty(shape, dtype=v.dtype, device=v.device)

    def _span(self, kind: str, stage: int, mb: int | None, start: float, detail: str = "") -> None:
        self.spans.append(Span(dist.get_rank() if dist.is_initialized() else 0, kind, stage, mb, start, time.perf_counter(), detail))

    # ------------------------------------------------------------------ step
    def run(self, feed: Any, size_of: Callable[[Any, int | None], int] | None = None) -> dict[str, Any]:
        """Run one step. ``feed(name, mb)`` returns the value of an expanded-graph
        placeholder (coordinate, size, parameter, state, or micro-batch ``mb`` of a batch
        tensor). Returns graph-output values by name (combined over micro-batches).
        ``size_of(dim, mb)``: a symbolic program's (dynamic=True) dim sizes for micro-batch
        ``mb`` (receive buffers); None: the shapes are static.

        When this rank's stages draw random numbers, the generators of the stage's ranks
        (the other mesh axes) are agreed first, as a non-pipelined step agrees every
        rank's (docs/randomness.md, "Pipelines")."""
        self._size_of = size_of
        if self.rng_sync is None or not any(self._draws(s) for s in self.my_stages):
            return self._run(feed)
        own = self.rng_sync.check_now()
        try:
            return self._run(feed)
        finally:
            self.rng_sync.restore(own)

    def _run(self, feed: Any) -> dict[str, Any]:
        self.spans = []
        self.peak_activation_bytes = 0
        store: list[dict[str, Any]] = [dict() for _ in range(self.m)]
        drew: dict[tuple[int, int], Any] = {}  # checkpointing: generator state before a forward that draws
        acc: dict[str, torch.Tensor] = {}
        gathered: dict[int, dict[str, Any]] = {}  # per stage: its G piece's values for this step
        last_use = {a.stage: i for i, a in enumerate(self.order) if a.kind in ("F", "B")}
        sends: list[Any] = []
        outputs: dict[str, list[Any]] = defaultdict(list)
        program = self.program

        def recv(route: _Route, mb: int | None, into: dict[str, Any]) -> None:
            if route.value in into:
                return
            t0 = time.perf_counter()
            buf = self._buffer(route.value, mb)
            log.debug("recv %s mb %s from rank %d tag %d", route.value, mb, self.stage_rank(route.src), self._tag(route, mb))
            dist.irecv(buf, src=self.stage_rank(route.src), tag=self._tag(route, mb)).wait()
            into[route.value] = buf
            self._span("recv", route.dst, mb, t0, f"{route.value} from stage {route.src}")

        def send(route: _Route, mb: int | None, value: torch.Tensor) -> None:
            t0 = time.perf_counter()
            value = value.contiguous()
            log.debug("send %s mb %s to rank %d tag %d", route.value, mb, self.stage_rank(route.dst), self._tag(route, mb))
            sends.append((dist.isend(value, dst=self.stage_rank(route.dst), tag=self._tag(route, mb)), value))
            self._span("send", route.src, mb, t0, f"{route.value} to stage {route.dst}")

        def run_piece(stage: int, kind: str, mb: int | None, values: dict[str, Any], label: str | None = None) -> None:
            piece = program.pieces.get((stage, kind))
            if piece is None:
                return
            args = []
            for name in piece.inputs:
                if name in program.placeholders:
                    args.append(feed(name, mb))
                elif name in values:
                    args.append(values[name])
                elif name in gathered.get(stage, ()):
                    args.append(gathered[stage][name])
                elif kind == "O" and name in acc:
                    args.append(acc[name])
                else:
                    raise SpmdError(f"stage {stage} {kind} needs {name}, which no earlier action produced on this rank")
            t0 = time.perf_counter()
            log.debug("run %s%d mb %s", kind, stage, mb)
            with torch.no_grad():
                outs = self.runners[(stage, kind)](*args)
            for name, v in zip(piece.outputs, outs):
                values[name] = v
            self._span(label or kind, stage, mb, t0)

        for position, action in enumerate(self.order):
            s, kind, mb = action.stage, action.kind, action.microbatch
            values = store[mb]
            if s not in gathered:  # the stage's parameter-only values, once per step
                gathered[s] = {}
                run_piece(s, "G", None, gathered[s])
            for r in self.routes:  # inputs from other stages
                if r.dst == s and r.dst_kind == kind and r.src_kind in ("F", "B") and r.src not in self.my_stages:
                    recv(r, mb, values)
                elif r.dst == s and r.dst_kind == kind and r.src in self.my_stages and r.value not in values:
                    raise SpmdError(f"schedule runs {action} before stage {r.src} produced {r.value}")
            if kind == "B" and self.checkpoint_stage(s) and (s, "F") in program.pieces:
                with replaying_rng(drew.pop((s, mb), None)):  # the recompute draws the forward's numbers again
                    run_piece(s, "F", mb, values, label="R")  # recompute the stage's forward for its backward
            if kind == "F" and self.checkpoint_stage(s) and self._draws(s):
                drew[(s, mb)] = rng_state()
            run_piece(s, kind, mb, values)
            for r in self.routes:  # outputs to other stages
                if r.src == s and r.src_kind == kind and r.dst not in self.my_stages and r.dst_kind in ("F", "B"):
                    send(r, mb, values[r.value])
            if kind == "F":
                for name in program.outputs:
                    if name in values and program.producer.get(name, (None,))[0] == s:
                        outputs[name].append(values[name])
            if kind in ("F", "B"):
                self._accumulate(s, kind, values, acc)
            self._release(position, mb, values)
            if last_use.get(s) == position and not self._optimizer_reads_g(s):  # no later action reads them
                gathered[s] = {}
            live = self._live_bytes(store)
            self.peak_activation_bytes = max(self.peak_activation_bytes, live)
        # gradients summed over micro-batches, to the optimizer
        if self.scale_grads and self.m > 1:
            for name in acc:
                if self.program.producer.get(name, (None, "B"))[1] == "B":
                    acc[name] = acc[name] / self.m
        for r in self.routes:
            if r.src_kind in ("F", "B") and r.dst_kind == "O":
                if r.src in self.my_stages and r.dst not in self.my_stages:
                    send(r, None, acc[r.value])
                elif r.dst in self.my_stages and r.src not in self.my_stages:
                    holder: dict[str, Any] = {}
                    recv(r, None, holder)
                    acc[r.value] = holder[r.value]
        step_values: dict[str, Any] = {}
        for s in self.my_stages:
            run_piece(s, "O", None, step_values)
        for work, _ in sends:
            work.wait()
        result = {name: vs for name, vs in outputs.items()}
        for name in program.outputs:
            if name in step_values:
                result[name] = [step_values[name]]
        return result

    def _optimizer_reads_g(self, stage: int) -> bool:
        g, o = self.program.pieces.get((stage, "G")), self.program.pieces.get((stage, "O"))
        return g is not None and o is not None and bool(set(g.outputs) & set(o.inputs))

    def _draws(self, stage: int) -> bool:
        """The stage's forward piece has random ops (dropout...)."""
        piece = self.program.pieces.get((stage, "F"))
        return piece is not None and any(is_random(n) for n in piece.gm.graph.nodes)

    # ------------------------------------------------------------------ memory
    def checkpoint_stage(self, stage: int) -> bool:
        if self.checkpoint == "always":
            return True
        if self.checkpoint == "except_last":
            return stage != self.last_stage
        return False

    def _accumulate(self, stage: int, kind: str, values: dict[str, Any], acc: dict[str, torch.Tensor]) -> None:
        """Fold this micro-batch's values that the optimizer reads into ``acc``:
        gradients (from B) are summed; forward statistics (from F, e.g. deferred
        BatchNorm means) are averaged over the micro-batches."""
        piece = self.program.pieces.get((stage, kind))
        if piece is None:
            return
        for name in piece.outputs:
            if not any(k == "O" and name in p.inputs for (s, k), p in self.program.pieces.items()):
                continue
            v = values[name] if kind == "B" else values[name] / self.m
            acc[name] = acc[name] + v if name in acc else v.clone()

    def _release(self, position: int, mb: int, values: dict[str, Any]) -> None:
        """Drop the micro-batch's values that no later action of this rank reads."""
        needed: set[str] = set(self.program.outputs)
        for a in self.order[position + 1 :]:
            if a.microbatch != mb:
                continue
            piece = self.program.pieces.get((a.stage, a.kind))
            if piece is not None:
                if a.kind == "B" and self.checkpoint_stage(a.stage):
                    # recomputed: keep the forward's inputs, not its saved activations
                    f = self.program.pieces.get((a.stage, "F"))
                    made_by_f = set(f.outputs) if f is not None else set()
                    needed |= {n for n in piece.inputs if n not in made_by_f}
                    needed |= set(f.inputs) if f is not None else set()
                else:
                    needed |= set(piece.inputs)
        for name in list(values):
            if name not in needed:
                values.pop(name)

    @staticmethod
    def _live_bytes(store: list[dict[str, Any]]) -> int:
        """Bytes of the distinct tensor storages held for in-flight micro-batches."""
        seen: dict[int, int] = {}
        for values in store:
            for v in values.values():
                if isinstance(v, torch.Tensor):
                    st = v.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    # ------------------------------------------------------------------ timeline
    def timeline(self) -> list[Span]:
        return list(self.spans)


def rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state, and the current CUDA device's when CUDA is in use."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def replaying_rng(saved: tuple[torch.Tensor, torch.Tensor | None] | None) -> Iterator[None]:
    """Draw from ``saved`` inside the block, then put the generators back where they
    were (as ``torch.utils.checkpoint`` does for its recompute); no-op for None."""
    if saved is None:
        yield
        return
    now = rng_state()
    torch.set_rng_state(saved[0])
    if saved[1] is not None:
        torch.cuda.set_rng_state(saved[1])
    try:
        yield
    finally:
        torch.set_rng_state(now[0])
        if now[1] is not None:
            torch.cuda.set_rng_state(now[1])
