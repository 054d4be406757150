"""Stage 1: trace a whole training step into one fx graph (see :func:`trace`)."""

from .tracer import GraphInput, GraphOutput, TracedStep, trace

__all__ = ["trace", "TracedStep", "GraphInput", "GraphOutput"]
