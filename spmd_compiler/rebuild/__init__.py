"""Stage 3: finish the per-rank graph an expansion spliced together (see :func:`finalize`)."""

from .finalize import ExpandedStep, OutputSlot, finalize

__all__ = ["ExpandedStep", "OutputSlot", "finalize"]
