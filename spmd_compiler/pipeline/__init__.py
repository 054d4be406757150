"""Stage 5: pipeline parallelism: split the expanded step into stages over a mesh axis."""

from ..trace.markers import SplitPoint, pipe_split
from .api import Pipeline
from .balance import balanced_split
from .partition import StageAssignment, assign_stages
from .runtime import PipelineRunner, Span
from .schedule import SCHEDULES, Action, build_schedule, format_schedule, validate
from .stages import Piece, StageProgram, split_program

__all__ = [
    "Pipeline",
    "pipe_split",
    "SplitPoint",
    "balanced_split",
    "assign_stages",
    "StageAssignment",
    "split_program",
    "StageProgram",
    "Piece",
    "PipelineRunner",
    "Span",
    "build_schedule",
    "format_schedule",
    "validate",
    "Action",
    "SCHEDULES",
]
