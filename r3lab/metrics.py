"""Drift metrics: pure functions on arrays (no engine, no trainer, no torch).

``delta = logp_train - logp_infer`` on sampled tokens; ``rho = exp(delta)``.
"""

from __future__ import annotations

import numpy as np

from r3lab.errors import R3LabError

__all__ = ["k3_kl", "extreme_token_fraction", "set_differs", "set_overlap", "token_route_flips", "route_agreement"]


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


def set_overlap(a: np.ndarray, b: np.ndarray, num_experts: int) -> np.ndarray:
    """Per (token, layer): how many expert ids two ``[T, L, K]`` route arrays share (0..K, order ignored)."""
    a, b = np.asarray(a), np.asarray(b)
    set_differs(a, b)  # the same shape checks
    if a.size and (max(int(a.max()), int(b.max())) >= num_experts or min(int(a.min()), int(b.min())) < 0):
        raise R3LabError(f"expert ids outside [0, {num_experts})")
    ha = np.zeros(a.shape[:2] + (num_experts,), dtype=bool)
    hb = np.zeros_like(ha)
    np.put_along_axis(ha, a.astype(np.int64), True, axis=2)
    np.put_along_axis(hb, b.astype(np.int64), True, axis=2)
    return (ha & hb).sum(axis=2)


def token_route_flips(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per token: whether any layer's expert set differs between two ``[T, L, K]`` route arrays."""
    return set_differs(a, b).any(axis=1)


def route_agreement(a: np.ndarray, b: np.ndarray, num_experts: int, layer_ids=None) -> dict:
    """Set-based agreement of two ``[T, L, K]`` route arrays over the same tokens (order inside top-k ignored).

    Returns ``per_layer_agreement`` (layer id -> share of tokens with the same expert set),
    ``per_layer_overlap`` (mean shared ids / k), ``router_disagreement`` (share of (token, layer) rows
    that differ), ``token_disagreement`` (share of tokens where any layer differs), ``chance`` = k / E
    (the overlap of unrelated routes) and ``tokens``. ``layer_ids`` names the layer axis (default 0..L-1).
    """
    differs = set_differs(a, b)
    shared = set_overlap(a, b, num_experts)
    T, L, K = np.asarray(a).shape
    lids = list(range(L)) if layer_ids is None else [int(g) for g in layer_ids]
    if len(lids) != L:
        raise R3LabError(f"{len(lids)} layer ids for {L} layers")
    if T == 0:
        raise R3LabError("no tokens to compare")
    return {
        "per_layer_agreement": {g: float(1.0 - differs[:, j].mean()) for j, g in enumerate(lids)},
        "per_layer_overlap": {g: float(shared[:, j].mean() / K) for j, g in enumerate(lids)},
        "router_disagreement": float(differs.mean()),
        "token_disagreement": float(differs.any(axis=1).mean()),
        "chance": K / num_experts,
        "tokens": int(T),
    }
