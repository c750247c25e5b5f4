"""Shared test fixtures; the random-routes generator lives in r3lab.testing (re-exported here for the tests)."""

from __future__ import annotations

import numpy as np
import pytest

from r3lab.testing import random_routes

__all__ = ["random_routes", "rng"]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the GPU recipe's pip dry run in the background once the tests are known (tests/gpu_dry_run.py): it
    waits on the network, so it overlaps the CPU-bound tests instead of adding minutes to the suite."""
    if any(item.path.name == "test_gpu_recipe.py" for item in session.items):
        import gpu_dry_run

        gpu_dry_run.start(*gpu_dry_run.requirements_args())
