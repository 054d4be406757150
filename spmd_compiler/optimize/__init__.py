"""Stage 4: optimization passes on the per-rank graph (``(gm, *, options) -> gm``)."""

from .bucketing import bucket_gradients_pass
from .deferred_divisor import defer_mean_divisor_pass
from .fuse_all_reduces import fuse_all_reduces_pass
from .gathers import bucket_parameter_gathers_pass
from .mean_reductions import fuse_mean_reductions_pass
from .memory import budget_prefetch_pass, rematerialize_pass
from .overlap import overlap_pass
from .redundant import cse_pass, fold_gather_narrow_pass, remove_redundant_collectives_pass
from .runner import DEFAULT_PASSES, PassCheckError, PassRecord, PassSpec, check_program, default_passes, run_passes
from .schedule import schedule_for_overlap_pass

__all__ = [
    "run_passes",
    "PassSpec",
    "PassRecord",
    "PassCheckError",
    "check_program",
    "default_passes",
    "DEFAULT_PASSES",
    "remove_redundant_collectives_pass",
    "cse_pass",
    "fold_gather_narrow_pass",
    "bucket_gradients_pass",
    "fuse_mean_reductions_pass",
    "defer_mean_divisor_pass",
    "bucket_parameter_gathers_pass",
    "fuse_all_reduces_pass",
    "overlap_pass",
    "schedule_for_overlap_pass",
    "rematerialize_pass",
    "budget_prefetch_pass",
]
