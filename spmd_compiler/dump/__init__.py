"""Explaining compiled programs: communication summaries, graph dumps."""

from .summary import CommRow, CommSummary, comm_summary

__all__ = ["comm_summary", "CommSummary", "CommRow"]
