"""spmd-compiler: compile a single-device PyTorch training step into an SPMD program.

Stages (one subpackage each): ``trace`` -> ``expand`` -> ``rebuild`` -> ``optimize`` ->
``pipeline`` -> ``runtime``; plus ``dump`` (explanations) and ``testing``.
"""

from torch.distributed.tensor import Partial, Replicate, Shard

from .errors import (
    CheckpointError,
    CollectiveError,
    DataDependentError,
    DeferredInitError,
    ExpertCapacityError,
    HostSettingError,
    IncompleteStepError,
    HostValueError,
    IntentError,
    MemoryBudgetError,
    RankMismatchError,
    SpmdError,
    UnevenShardingError,
    UnsupportedOpError,
    UnsupportedPlacementError,
)
from .driver import expand, materialize
from .expand import DSymInt, ExpansionCache, register_rule
from .pipeline import Pipeline, SplitPoint, pipe_split
from .plan import ContextParallel, MixedPrecisionPolicy, Plan, fused_shard
from .rebuild import ExpandedStep
from .runtime import CompiledStep, compile
from .trace import TracedStep, trace

__version__ = "0.1.0"

__all__ = [
    "compile",
    "CompiledStep",
    "trace",
    "expand",
    "materialize",
    "Plan",
    "ContextParallel",
    "MixedPrecisionPolicy",
    "Pipeline",
    "SplitPoint",
    "pipe_split",
    "TracedStep",
    "ExpandedStep",
    "DSymInt",
    "ExpansionCache",
    "register_rule",
    "Shard",
    "Replicate",
    "Partial",
    "fused_shard",
    "SpmdError",
    "UnsupportedOpError",
    "UnsupportedPlacementError",
    "UnevenShardingError",
    "RankMismatchError",
    "CollectiveError",
    "CheckpointError",
    "DataDependentError",
    "HostValueError",
    "HostSettingError",
    "IntentError",
    "MemoryBudgetError",
    "IncompleteStepError",
    "DeferredInitError",
    "ExpertCapacityError",
]
