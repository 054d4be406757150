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


# ---------------------------------------------------------------- tiers
# The default run (`python -m pytest -q`, the README's) skips the slow tier: the tests
# marked `slow` in their file and those listed in tests/slow_tests.txt (node ids or their
# prefixes, with each one's measured seconds). `pytest -m slow` runs only the slow tier,
# `pytest -m ""` everything; .ci/run runs both tiers on torch 2.13, the default on 2.14.
_SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def _slow_prefixes() -> list[str]:
    with open(_SLOW_LIST) as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


def pytest_collection_modifyitems(session, config, items):
    prefixes = _slow_prefixes()
    used = set()
    for item in items:
        for p in prefixes:
            if item.nodeid == p or item.nodeid.startswith(p if p.endswith(("[", ",")) or "[" in p else p + "["):
                item.add_marker(pytest.mark.slow)
                used.add(p)
                break
    # a whole-suite collection must find every listed test: a renamed one would run in no tier's intent
    whole = [str(a) for a in config.args] in (["tests"], [str(config.rootpath / "tests")], []) and not config.option.keyword
    stale = [p for p in prefixes if p not in used]
    if whole and stale and len(items) > 500:
        raise pytest.UsageError(f"tests/slow_tests.txt lists tests that do not exist: {stale[:5]}; fix: update the list")
