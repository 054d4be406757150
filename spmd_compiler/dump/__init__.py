"""Explaining compiled programs: communication summaries, static memory traces, graph dumps."""

from .memory import LiveValue, MemoryTrace, memory_trace
from .summary import CommRow, CommSummary, comm_summary

__all__ = ["comm_summary", "CommSummary", "CommRow", "memory_trace", "MemoryTrace", "LiveValue"]
