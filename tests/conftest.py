"""Shared test helpers: random valid routes."""

from __future__ import annotations

import numpy as np
import pytest

from r3lab.routes import Routes


def random_routes(rng: np.random.Generator, *, num_experts: int, top_k: int, num_layers: int, lengths, layer_ids=None) -> Routes:
    """Routes with top_k distinct ids per row, uniformly drawn."""
    T = int(sum(lengths))
    keys = rng.random((T * num_layers, num_experts))
    vals = np.argpartition(keys, top_k - 1, axis=1)[:, :top_k] if top_k < num_experts else np.argsort(keys, axis=1)
    vals = vals.reshape(T, num_layers, top_k)
    return Routes(vals, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), num_experts, layer_ids)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
