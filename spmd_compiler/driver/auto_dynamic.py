"""``compile(..., dynamic=None)`` (the default): automatic dynamic batch sizes.

As torch.compile's automatic dynamic shapes: the first call compiles for its exact
shapes (a static program). A later call whose *sharded batch sizes* differ from a cached
program's, everything else in the call signature the same (the free signature of
:meth:`~.sizes.BatchSizes.free_key`: dtypes, other dims, state, hyperparameters), compiles
once more with those dims symbolic (the ``dynamic=True`` machinery, docs/dynamic_shapes.md),
and every later size reuses that program as long as its size guards hold. A call that
changes anything else compiles a static program, as ``dynamic=False`` does.

The decision is taken by every rank together: it reads only the payloads all ranks
exchanged to agree on the program (each rank's free-signature digest and local sizes)
and the compile cache, which is the same on every rank (:meth:`AutoDynamic.decide`).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["AutoDynamic", "switch_message"]

log = logging.getLogger(__name__)


def switch_message(old: Any, new: Any) -> str:
    """The INFO line logged when a step switches to the symbolic program."""
    return (f"batch size changed from {_text(old)} to {_text(new)}: compiling once with the batch dims symbolic; "
            f"later sizes reuse it (dynamic=False to keep one program per size)")


def _text(sizes: Any) -> str:
    """One number when every sharded batch dim has the same size (x and y of one batch)."""
    if isinstance(sizes, (list, tuple)):
        return str(sizes[0]) if len(set(sizes)) == 1 else str(list(sizes))
    return str(sizes)


class AutoDynamic:
    """The ``dynamic=None`` decisions of a :class:`~.step.StepDriver` (every rank the same)."""

    def __init__(self) -> None:
        # free signatures (every rank's digests) whose symbolic compile fell back to a
        # static program: their later sizes compile static directly, with no symbolic try
        self.fallen: set[Any] = set()

    def decide(self, programs: Any, free: tuple, sizes: Any, dims: Any, everyone: list[Any]) -> tuple[bool, str | None]:
        """Whether the compile for the call with every rank's free digests ``free`` and
        ``(coordinate, local sizes)`` ``everyone`` is symbolic, and the INFO line to log.

        Symbolic when a cached program (``programs``, the compile cache) has the same
        free signatures: the call differs from it only in the sharded batch sizes (the
        exact signature found no program). Static when the free signature is new, when
        its symbolic compile fell back before, when a batch dim is split over several
        mesh axes (``dims`` None), or when the batch is not laid out as torch.chunk cuts
        it (the symbolic program reads that layout; a static one takes any)."""
        if dims is None or not dims or free in self.fallen:
            return False, None
        old = next((p for p in reversed(programs.values()) if getattr(p, "free", None) == free), None)
        if old is None:
            return False, None
        try:
            new = sizes.global_of(dims, everyone)
        except ValueError:
            return False, None
        return True, switch_message(old.batch_sizes if old.batch_sizes is not None else "another size", new)

    def compiled(self, free: tuple, symbolic: bool, program: Any) -> None:
        """Record the outcome of a symbolic compile (a program with no size symbols fell back)."""
        if symbolic and not program.step.size_symbols:
            self.fallen.add(free)
