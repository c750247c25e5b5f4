"""Drift metrics: pure functions on arrays (no engine, no trainer, no torch).

``delta = logp_train - logp_infer`` on sampled tokens; ``rho = exp(delta)``.
"""

from __future__ import annotations

import numpy as np

from r3lab.errors import R3LabError

__all__ = ["k3_kl", "extreme_token_fraction", "set_differs", "token_route_flips"]


def _deltas(logp_train: np.ndarray, logp_infer: np.ndarray) -> np.ndarray:
    a = np.asarray(logp_train, dtype=np.float64)
    b = np.asarray(logp_infer, dtype=np.float64)
    if a.shape != b.shape:
        raise R3LabError(f"logprob arrays differ in shape: {a.shape} vs {b.shape}")
    if a.size == 0:
        raise R3LabError("no tokens to compare")
    return a - b


def k3_kl(logp_train: np.ndarray, logp_infer: np.ndarray) -> float:
    """The k3 estimator of KL(infer || train) on sampled tokens: ``mean(rho - 1 - delta)`` (>= 0)."""
    d = _deltas(logp_train, logp_infer)
    return float(np.mean(np.expm1(d) - d))


def extreme_token_fraction(logp_train: np.ndarray, logp_infer: np.ndarray, tau: float = 2.0) -> float:
    """F(tau): share of tokens whose probability ratio is beyond ``tau`` either way (``max(rho, 1/rho) > tau``)."""
    d = _deltas(logp_train, logp_infer)
    return float(np.mean(np.abs(d) > np.log(tau)))


def set_differs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per (token, layer): whether two ``[T, L, K]`` route arrays chose different expert *sets* (order ignored)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim != 3:
        raise R3LabError(f"route arrays must both be [T, L, K] of one shape, got {a.shape} and {b.shape}")
    return (np.sort(a, axis=2) != np.sort(b, axis=2)).any(axis=2)


def token_route_flips(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per token: whether any layer's expert set differs between two ``[T, L, K]`` route arrays."""
    return set_differs(a, b).any(axis=1)
