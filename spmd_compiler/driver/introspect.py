"""What a compiled step tells about itself: dumps of its programs, the collective
summary, the static memory trace and the compile timings (a mixin of
:class:`~.step.StepDriver`, kept apart from the call path)."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

__all__ = ["DriverIntrospection"]

log = logging.getLogger(__name__)


class DriverIntrospection:
    """Dumps and introspection of a :class:`~.step.StepDriver` (its attributes: ``fn``,
    ``dump_dir``, ``dumps``, ``last``, ``_current``, ``_sizes``, ``_compiling``, ``_feed``)."""

    def _dump(self, step: Any, texts: dict[str, Any]) -> None:
        from ..dump.writer import dump_root, write_dump

        if not self._dumping():
            return
        name = getattr(self.fn, "__name__", "step")
        values = texts["size_values"](step) if step.size_symbols and texts.get("size_values") else None
        folder = write_dump(
            dump_root(self.dump_dir), step, name=name, expanded_text=texts.get("expanded"), pass_texts=texts.get("passes", []),
            notes=texts.get("notes"),
            info={"world size": dist.get_world_size() if dist.is_initialized() else 1,
                  **({"compiled because": texts["reason"]} if texts.get("reason") else {})}, sizes=values,
        )
        self.dumps.append(folder)
        log.info("dump of %s written to %s", name, folder)

    def _dump_texts(self, batch: tuple, kwargs: dict) -> dict[str, Any]:
        """What ``_build`` records for a dump: the annotated graphs go in it; a symbolic
        program's texts and dump show the sizes of the call being compiled (``size_values``)."""
        return {"size_values": self._sizes.call_values(batch, kwargs, self._compiling)} if self._sizes is not None else {}

    def _dumping(self) -> bool:
        from ..dump.writer import dump_root, should_dump

        return dump_root(self.dump_dir) is not None and should_dump(dist.get_rank() if dist.is_initialized() else 0)

    # ------------------------------------------------------------------ introspection
    def comm_summary(self) -> Any:
        """Collectives of the last compiled graph per kind, axis and phase (per rank per step)."""
        from ..dump.summary import comm_summary

        if self.last is None:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        return comm_summary(self.last.gm)

    def memory_trace(self) -> Any:
        """Static memory trace of the last compiled graph: bytes alive per node and the
        peak per rank per step (:func:`spmd_compiler.dump.memory_trace`); a symbolic
        program's (dynamic=True) at the batch sizes of the last call."""
        from ..dump.memory import memory_trace
        from ..dump.sizes import SizeContext

        if self.last is None:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        sizes = SizeContext(self.last, self._feed) if self.last.size_symbols and self._feed else None
        return memory_trace(self.last.gm, backend=dist.get_backend() if dist.is_initialized() else None, sizes=sizes)

    def timings(self) -> dict[str, float]:
        """Seconds per compile phase of the last compile (trace, expand, rebuild, passes, total)."""
        if self._current is None:
            return {}
        return dict(self._current.timings)

    def _memory(self, step: Any, batch: tuple, kwargs: dict) -> Any:
        """The program's static memory trace (a symbolic program's at this call's batch
        sizes), with ``sizes_note`` saying which sizes; None where there is none to take."""
        from ..dump.memory import memory_trace

        backend = dist.get_backend() if dist.is_initialized() else None
        if not step.size_symbols:
            trace = memory_trace(step.gm, backend=backend)
            trace.sizes_note = ""
            return trace
        from ..dump.sizes import SizeContext

        try:
            ctx = SizeContext(step, self._sizes.call_values(batch, kwargs, self._compiling)(step) if self._sizes else None)
        except ValueError:  # a batch not laid out as torch.chunk cuts it: raised later, on every rank
            ctx = SizeContext(step)
        trace = memory_trace(step.gm, backend=backend, sizes=ctx if ctx.values is not None else None)
        trace.sizes_note = f", batch sizes {ctx.call_text()}" if ctx.values is not None else ", the trace's example sizes"
        return trace
