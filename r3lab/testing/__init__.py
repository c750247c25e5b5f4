"""Helpers for tests, benchmarks and notebooks (in the spirit of ``numpy.testing``): not part of the R3 path.

* :mod:`r3lab.testing.routes`: random valid routes, and routes as vLLM's HTTP API sends them.
* the corpus prompts and the workload-shaped routes are product data: :mod:`r3lab.corpus` and
  :mod:`r3lab.workloads` (nothing outside ``testing`` imports ``testing``).
* :mod:`r3lab.testing.hf`: tiny transformers MoE configs (one factory for every family), expert relabelling.
* :mod:`r3lab.testing.megatron`: megatron-core on CPU ranks (imported on its own: it patches
  process-wide state when used, and imports torch).
* :mod:`r3lab.testing.cluster`: a multi-node Ray cluster on one machine (``local_cluster``; imported on its own).
"""

from r3lab.testing.hf import MOE_FAMILIES, permuted_experts, tiny_moe_config
from r3lab.testing.routes import random_route_tensors, random_routes, vllm_npy_base64

__all__ = [
    "random_routes",
    "random_route_tensors",
    "vllm_npy_base64",
    "MOE_FAMILIES",
    "tiny_moe_config",
    "permuted_experts",
]
