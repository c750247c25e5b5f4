"""Synthetic route sets shaped like real workloads (skewed expert popularity), for notebooks and benchmarks.

Real batches route unevenly: a few experts of each layer take most tokens. ``workload_routes`` draws top-k
sets with popularity ``1 / rank**skew`` per layer (0: uniform), so transport and slicing can be measured on
batches the size of the field's without a model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3lab.routes import Routes

__all__ = ["workload_routes"]


def workload_routes(*, num_experts: int, top_k: int, num_layers: int, tokens: int, seq_len: int = 2048,
                    skew: float = 1.0, seed: int = 0, layer_ids: Any = None) -> Routes:
    """Routes shaped like a real workload: per layer, expert popularity ~ ``1 / rank**skew`` (0: uniform), top-k
    sets drawn without replacement (Gumbel top-k, in chunks to bound memory), sequences of ``seq_len`` tokens."""
    rng = np.random.default_rng(seed)
    out = np.empty((tokens, num_layers, top_k), dtype=np.uint16)
    for j in range(num_layers):
        logw = -skew * np.log(np.arange(1, num_experts + 1))[rng.permutation(num_experts)]
        for s in range(0, tokens, 4096):
            n = min(4096, tokens - s)
            g = logw + rng.gumbel(size=(n, num_experts))
            out[s : s + n, j] = np.argpartition(-g, top_k - 1, axis=1)[:, :top_k]
    lens = np.full(max(tokens // seq_len, 1), min(seq_len, tokens))
    lens[-1] += tokens - lens.sum()
    return Routes(out, np.concatenate([[0], np.cumsum(lens)]), num_experts, layer_ids)
