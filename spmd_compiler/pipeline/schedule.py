"""Pipeline schedules: for each pipeline rank, the order of its forward and backward
micro-batch actions.

* ``GPipe``: all forwards, then all backwards.
* ``1F1B``: ``p - 1 - r`` warm-up forwards on rank r, then one forward / one backward,
  then the remaining backwards; at most ``p - r`` micro-batches of activations alive.
* ``Interleaved1F1B``: several stages per rank (stage ``s`` on rank ``s mod p``),
  depth-first; the order is torch.distributed.pipelining's own
  (``ScheduleInterleaved1F1B``), validated here.

torch's GPipe and 1F1B orders are also available (``_get_pipeline_order``), but its
1F1B order starts the last rank at micro-batch 1 and ends at micro-batch m, so those two
are derived here; every order, ours or torch's, is checked by :func:`validate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _private_torch as pt

__all__ = ["Action", "SCHEDULES", "build_schedule", "validate", "format_schedule"]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


@dataclass(frozen=True)
class Action:
    """Run the forward (``kind="F"``) or backward (``"B"``) of ``stage`` on ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def _gpipe(pp: int, m: int) -> dict[int, list[Action]]:
    return {r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(pp)}


def _one_f_one_b(pp: int, m: int) -> dict[int, list[Action]]:
    out = {}
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        row = [Action(r, "F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            row.append(Action(r, "F", f))
            f += 1
            row.append(Action(r, "B", b))
            b += 1
        while b < m:
            row.append(Action(r, "B", b))
            b += 1
        out[r] = row
    return out


def build_schedule(name: str, pp: int, m: int, stages_per_rank: int = 1) -> dict[int, list[Action]]:
    """The action order of schedule ``name`` for ``pp`` ranks and ``m`` micro-batches."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {list(SCHEDULES)}")
    if m < 1:
        raise ValueError(f"chunks must be >= 1, got {m}")
    if name == "Interleaved1F1B":
        if stages_per_rank < 2:
            raise ValueError("Interleaved1F1B runs several stages per rank: set stages_per_rank >= 2 (or use 1F1B)")
        if m < pp:
            raise ValueError(
                f"Interleaved1F1B needs at least as many micro-batches as pipeline ranks: got chunks={m} for "
                f"{pp} ranks; fix: chunks >= {pp} (or use 1F1B/GPipe)"
            )
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(f"Interleaved1F1B needs chunks to be a multiple of {rounds} for {pp} ranks, got {m}")
        raw = pt.pipeline_order(name, pp, m, stages_per_rank)
        order = {r: [Action(*a) for a in row if a is not None] for r, row in raw.items()}
    elif stages_per_rank != 1:
        raise ValueError(f"{name} runs one stage per rank; use Interleaved1F1B for stages_per_rank={stages_per_rank}")
    elif name == "GPipe":
        order = _gpipe(pp, m)
    else:
        order = _one_f_one_b(pp, m)
    validate(order, pp, m, stages_per_rank)
    return order


def validate(order: dict[int, list[Action]], pp: int, m: int, stages_per_rank: int = 1) -> None:
    """Every stage runs F and B of every micro-batch exactly once, F before B, on the
    rank that holds the stage; raises ValueError naming the first problem."""
    for r in range(pp):
        row = order.get(r, [])
        mine = [r + k * pp for k in range(stages_per_rank)]
        seen: set[tuple[int, str, int]] = set()
        for a in row:
            if a.stage not in mine:
                raise ValueError(f"schedule gives rank {r} action {a} of stage {a.stage}, which lives on rank {a.stage % pp}")
            key = (a.stage, a.kind, a.microbatch)
            if key in seen:
                raise ValueError(f"schedule runs {a} twice on rank {r}")
            if a.kind == "B" and (a.stage, "F", a.microbatch) not in seen:
                raise ValueError(f"schedule runs {a} on rank {r} before its forward")
            seen.add(key)
        for s in mine:
            for i in range(m):
                for k in "FB":
                    if (s, k, i) not in seen:
                        raise ValueError(f"schedule never runs {s}{k}{i} on rank {r}")


def format_schedule(order: dict[int, list[Action]]) -> str:
    """One line per rank: ``rank 0: 0F0 0F1 0B0 ...``."""
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in row) for r, row in sorted(order.items()))
