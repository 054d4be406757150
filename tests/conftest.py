"""Shared fixtures: fake-process-group meshes, hypothesis profiles, float64 models."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=60,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


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
