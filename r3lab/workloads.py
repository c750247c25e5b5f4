"""Synthetic route sets shaped like real workloads (skewed expert popularity), for notebooks and benchmarks.

Real batches route unevenly: a few experts of each layer take most tokens. ``workload_routes`` draws top-k
sets with popularity ``1 / rank**skew`` per layer (0: uniform), so transport and slicing can be measured on
batches the size of the field's without a model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3lab.errors import RouteFormatError
from r3lab.routes import Routes

__all__ = ["workload_routes", "fixed_length_routes"]


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


def fixed_length_routes(num_seqs: int, length: int, *, num_layers: int, top_k: int, num_experts: int,
                        seed: int = 0) -> Routes:
    """``num_seqs`` sequences of ``length`` tokens whose rows are drawn from 4096 distinct top-k sets (uint8 ids, so
    ``num_experts`` <= 256): valid routes that build fast at billions of ids, for measuring transport and decoding
    at the field's batch sizes where the routing's statistics do not matter."""
    if num_experts > 256:
        raise RouteFormatError(f"fixed_length_routes: ids are uint8, so at most 256 experts, got {num_experts}")
    rng = np.random.default_rng(seed)
    base = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(4096)]).astype(np.uint8)
    vals = np.empty((num_seqs * length, num_layers, top_k), dtype=np.uint8)
    for s in range(0, vals.shape[0], 1 << 16):
        n = min(1 << 16, vals.shape[0] - s)
        vals[s : s + n] = base[rng.integers(0, 4096, (n, num_layers))]
    return Routes(vals, np.arange(num_seqs + 1) * length, num_experts, validate=False)
