"""``topk-gaps``: top-k sets as gaps between sorted, popularity-relabelled ids (a transform for a byte stage)."""

from __future__ import annotations

from typing import Any

import numpy as np

from r3lab.compaction.codecs.base import Buffer, IdCodec, Shape
from r3lab.compaction.codecs.registry import register_codec
from r3lab.errors import RouteFormatError


@register_codec
class TopKGaps(IdCodec):
    """Top-k sets as gaps between sorted, popularity-relabelled ids: a transform for a byte stage (zstd).

    Per layer, experts are relabelled by how often they were chosen (most popular -> 0; the
    ``[L, E]`` relabelling is stored up front), each row is sorted and written as the gaps
    ``c_0, c_1 - c_0 - 1, ...``, slot-major. Skewed popularity turns into many small gaps, which a
    byte stage codes in a few bits. Always layer-major; **decode returns every row sorted**.

    Layout (format versions 1 and 2), every number one little-endian element of the compact dtype:
    ``perm[L, E]`` (``perm[j, r]`` is the expert with rank ``r`` in layer ``j``), then
    ``gaps[L, K, T]``.
    """

    codec_id = "topk-gaps"
    sorts_rows = True

    def __init__(self, order: str = "layer"):
        if order != "layer":
            raise RouteFormatError(f"topk-gaps is always layer-major, got order={order!r}")
        self.order = order

    def _params(self) -> dict[str, Any]:
        return {"order": self.order}

    def encoded_size(self, shape: Shape, dtype: np.dtype[Any], num_experts: int) -> int:
        T, L, K = shape
        return (L * num_experts + T * L * K) * np.dtype(dtype).itemsize

    def encode(self, values: np.ndarray, num_experts: int) -> bytes:
        T, L, K = values.shape
        dt = values.dtype
        perms = np.empty((L, num_experts), dtype=dt)
        gaps = np.empty((L, K, T), dtype=dt)
        for j in range(L):
            counts = np.bincount(values[:, j].reshape(-1), minlength=num_experts)
            order = np.argsort(-counts, kind="stable")  # new label -> expert
            relabel = np.empty(num_experts, dtype=np.int64)
            relabel[order] = np.arange(num_experts)
            srt = np.sort(relabel[values[:, j]], axis=1)
            g = np.diff(srt, axis=1, prepend=-1) - 1
            perms[j] = order
            gaps[j] = g.T
        le = dt.newbyteorder("<")
        return perms.astype(le, copy=False).tobytes() + gaps.astype(le, copy=False).tobytes()

    def decode(self, buf: Buffer, shape: Shape, dtype: np.dtype[Any], num_experts: int) -> np.ndarray:
        T, L, K = shape
        dt = np.dtype(dtype)
        want = self.encoded_size(shape, dt, num_experts)
        if len(buf) != want:
            raise RouteFormatError(f"topk-gaps payload holds {len(buf)} bytes but shape {list(shape)} needs {want}")
        flat = np.frombuffer(buf, dtype=dt.newbyteorder("<"))
        perms = flat[: L * num_experts].reshape(L, num_experts).astype(np.int64)
        gaps = flat[L * num_experts :].reshape(L, K, T).astype(np.int64)
        out = np.empty((T, L, K), dtype=dt)
        for j in range(L):
            if (
                perms[j].max(initial=0) >= num_experts
                or np.bincount(perms[j], minlength=num_experts).max(initial=1) != 1
            ):
                raise RouteFormatError(
                    f"topk-gaps: the relabelling of layer {j} is not a permutation of {num_experts} experts"
                )
            ids = np.cumsum(gaps[j] + 1, axis=0) - 1  # [K, T], strictly increasing along K
            if ids.size and ids[-1].max() >= num_experts:
                raise RouteFormatError(f"topk-gaps: expert id out of range [0, {num_experts}) in layer {j}")
            out[:, j] = np.sort(perms[j][ids.T], axis=1)
        return out
