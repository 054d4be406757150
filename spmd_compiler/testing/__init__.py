"""Tools to test sharding: run all ranks in one process and compare with one device."""

from .harness import SimulatedTraining
from .simulate import assemble, rank_coordinates, run_lockstep, shard_tensor

__all__ = ["SimulatedTraining", "assemble", "rank_coordinates", "run_lockstep", "shard_tensor"]
