"""Tools to test sharding: run all ranks in one process and compare with one device."""

from .compare import TrainingComparison, assert_training_matches
from .harness import SimulatedTraining
from .mesh import fake_mesh
from .simulate import assemble, rank_coordinates, run_lockstep, shard_tensor

__all__ = ["SimulatedTraining", "fake_mesh", "assert_training_matches", "TrainingComparison", "assemble", "rank_coordinates", "run_lockstep", "shard_tensor"]
