"""Shared test fixtures; the random-routes generator lives in r3lab.testing (re-exported here for the tests)."""

from __future__ import annotations

import numpy as np
import pytest

from r3lab.testing import random_routes

__all__ = ["random_routes", "rng"]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
