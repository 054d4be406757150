"""Stage 3: splice recipes into the per-rank graph and finish it."""

from .finalize import ExpandedStep, OutputSlot, finalize
from .splice import splice_recipe

__all__ = ["ExpandedStep", "OutputSlot", "finalize", "splice_recipe"]
