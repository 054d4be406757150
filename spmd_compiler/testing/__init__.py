"""Tools to test sharding: run all ranks in one process and compare with one device.

* :func:`assert_spmd_matches` - a function sharded vs on one device, first differing node.
* :func:`assert_training_matches` / :class:`SimulatedTraining` - whole train steps.
* :func:`assert_distributed` / :func:`distribution_of` - prove a program is really
  distributed as its plan says (local shapes, sharded inputs, collectives).
* :func:`fake_mesh` - a DeviceMesh over a fake process group (no communication).
* :mod:`.strategies` - hypothesis strategies (meshes, placements, programs); import it
  explicitly (``from spmd_compiler.testing import strategies``), it needs hypothesis.
* :mod:`.models` - small models and plans (MLP, GPT).
"""

from .checks import Distribution, assert_distributed, distribution_of
from .compare import TrainingComparison, assert_training_matches
from .harness import SimulatedTraining
from .mesh import fake_mesh
from .simulate import assemble, group_axes_of, rank_coordinates, run_lockstep, shard_tensor
from .spmd import SpmdMismatch, SpmdRun, assert_spmd_matches, run_spmd

__all__ = [
    "assert_spmd_matches",
    "run_spmd",
    "SpmdMismatch",
    "SpmdRun",
    "assert_distributed",
    "distribution_of",
    "Distribution",
    "assert_training_matches",
    "TrainingComparison",
    "SimulatedTraining",
    "fake_mesh",
    "assemble",
    "rank_coordinates",
    "run_lockstep",
    "group_axes_of",
    "shard_tensor",
]
