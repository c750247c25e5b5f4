"""Route sets shaped like real workloads, for the benchmarks: skewed (Zipf-like per layer) or uniform."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from r3lab.routes import Routes


@dataclass(frozen=True)
class Workload:
    name: str
    num_experts: int
    top_k: int
    num_layers: int  # global layers, dense ones included
    dense_layers: tuple[int, ...] = ()
    tokens: int = 32_768
    seq_len: int = 2_048


WORKLOADS = [
    Workload("64e top-8, 16 layers", 64, 8, 16),
    Workload("256e top-8, dense layer 0", 256, 8, 17, dense_layers=(0,)),
    Workload("384e top-8", 384, 8, 12),
    Workload("512e top-22", 512, 22, 8, tokens=16_384),
]


def sample_routes(w: Workload, *, skew: float, seed: int = 0) -> Routes:
    """Sample top-k sets without replacement; per layer, expert popularity ~ 1 / rank**skew (0 = uniform)."""
    rng = np.random.default_rng(seed)
    moe = [layer for layer in range(w.num_layers) if layer not in w.dense_layers]
    out = np.empty((w.tokens, len(moe), w.top_k), dtype=np.uint16)
    for j, _ in enumerate(moe):
        logw = -skew * np.log(np.arange(1, w.num_experts + 1))[rng.permutation(w.num_experts)]
        for s in range(0, w.tokens, 4096):  # Gumbel-top-k, chunked to bound memory
            n = min(4096, w.tokens - s)
            g = logw + rng.gumbel(size=(n, w.num_experts))
            out[s : s + n, j] = np.argpartition(-g, w.top_k - 1, axis=1)[:, : w.top_k]
    lens = np.full(w.tokens // w.seq_len, w.seq_len)
    lens[-1] += w.tokens - lens.sum()
    return Routes(out, np.concatenate([[0], np.cumsum(lens)]), w.num_experts, moe)
