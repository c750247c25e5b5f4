"""Random valid routes for tests and benchmarks (k distinct expert ids per row, uniformly drawn), and routes written
as vLLM sends them over HTTP."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from r3lab.routes import Routes


def random_routes(
    rng: np.random.Generator,
    *,
    num_experts: int,
    top_k: int,
    num_layers: int,
    lengths: Sequence[int],
    layer_ids: Any = None,
) -> Routes:
    """Packed :class:`~r3lab.routes.Routes` of sequences with ``lengths``, top_k distinct ids per row."""
    T = int(sum(lengths))
    keys = rng.random((T * num_layers, num_experts))
    vals = np.argpartition(keys, top_k - 1, axis=1)[:, :top_k] if top_k < num_experts else np.argsort(keys, axis=1)
    vals = vals.reshape(T, num_layers, top_k)
    return Routes(vals, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), num_experts, layer_ids)


def random_route_tensors(n_tokens: int, layers: Sequence[int], *, num_experts: int, top_k: int, seed: int = 5) -> dict:
    """Per-layer replay ids ``{layer_id: int64 torch tensor [n_tokens, top_k]}`` (random permutation prefixes)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        layer: torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(n_tokens)])
        for layer in layers
    }


def vllm_npy_base64(arr: np.ndarray, **save_kwargs: Any) -> str:
    """``arr`` as vLLM's completions API sends ``routed_experts``: a ``.npy`` file (``np.save``; ``save_kwargs``
    such as ``allow_pickle=True`` for a hostile payload), base64-encoded; what
    :func:`r3lab.compaction.payload.read_vllm_npy_base64` reads."""
    bio = io.BytesIO()
    np.save(bio, arr, **save_kwargs)
    return base64.b64encode(bio.getvalue()).decode()
