"""The one driver from (step, model, optimizer, batch, mesh, plan, options) to a program.

It composes the compile stages (trace -> expand -> rebuild -> optimize) for one mesh
coordinate (:func:`build_program`), keeps one program per call signature and makes every
rank agree on it (:class:`StepDriver`), and feeds a program and stores its results by
name (:mod:`.io`). ``compile()`` (:mod:`spmd_compiler.runtime`), the pipeline and the
simulated test harness (:mod:`spmd_compiler.testing`) all build on it.
"""

from .agreement import check_agreement, comm_device, compare_fingerprints, exchange, fingerprint
from .batch import batch_placements, global_batch, sharded_batch_dims, signature, why_recompile
from .build import Options, build_program, expand, gc_paused, optimize_program
from .deferred_init import materialize
from .distribute import distribute_state, is_distributed, is_host_scalar
from .io import program_inputs, store_outputs
from .step import Program, StepDriver, as_mesh

__all__ = [
    "Options",
    "build_program",
    "expand",
    "optimize_program",
    "gc_paused",
    "StepDriver",
    "Program",
    "as_mesh",
    "program_inputs",
    "store_outputs",
    "batch_placements",
    "global_batch",
    "sharded_batch_dims",
    "signature",
    "why_recompile",
    "check_agreement",
    "compare_fingerprints",
    "comm_device",
    "exchange",
    "fingerprint",
    "distribute_state",
    "materialize",
    "is_distributed",
    "is_host_scalar",
]
