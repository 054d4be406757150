"""Stage 6: the compile-and-run API and running on real process groups."""

from .compiled import CompiledStep, compile

__all__ = ["compile", "CompiledStep"]
