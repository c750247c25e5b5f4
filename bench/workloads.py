"""Route sets shaped like real workloads, for the benchmarks: skewed (Zipf-like per layer) or uniform."""

from __future__ import annotations

from dataclasses import dataclass

from r3lab.routes import Routes
from r3lab.workloads import workload_routes


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
    moe = [layer for layer in range(w.num_layers) if layer not in w.dense_layers]
    return workload_routes(num_experts=w.num_experts, top_k=w.top_k, num_layers=len(moe), tokens=w.tokens,
                           seq_len=w.seq_len, skew=skew, seed=seed, layer_ids=moe)
