"""Shared fixtures: fake-process-group meshes, hypothesis profiles, float64 models."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
# ci: derandomized (the same examples every run), bounded, no deadline (shared CI machines)
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60, print_blob=True, suppress_health_check=_SLOW_OK)
settings.register_profile("dev", deadline=None, max_examples=30, suppress_health_check=_SLOW_OK)
# thorough: random, 10x the examples; run with HYPOTHESIS_PROFILE=thorough
settings.register_profile("thorough", deadline=None, max_examples=2000, suppress_health_check=_SLOW_OK)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
settings.load_profile(PROFILE)
# property tests scale their example counts with the profile (tests/test_properties.py)
os.environ["SPMD_HYPOTHESIS_SCALE"] = {"ci": "1.0", "dev": "0.25", "thorough": "10"}.get(PROFILE, "1.0")


@pytest.fixture
def mesh4():
    from spmd_compiler.testing import fake_mesh

    return fake_mesh((4,), ("dp",))


@pytest.fixture
def mesh2x2():
    from spmd_compiler.testing import fake_mesh

    return fake_mesh((2, 2), ("dp", "tp"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
