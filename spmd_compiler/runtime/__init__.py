"""Stage 6: compile-and-run API and running on real process groups."""

from .compiled import CompiledStep, compile
from .distribute import distribute_state

__all__ = ["compile", "CompiledStep", "distribute_state"]
