"""``weights``: the routing weights beside the ids, as float32, float16 or bfloat16 (format version 3).

Layout: ``T * L * K`` little-endian floats of the chosen dtype, ``[token, layer]`` rows in order and, inside each
row, in ascending order of the row's expert ids (so the block means the same whichever id codec precedes it: the
set codecs return rows sorted, ``raw`` and ``bitpack`` in the engine's order; :func:`to_block` and
:func:`from_block` do the reordering). bfloat16 is the top half
of the float32 bits, rounded to nearest even; float16 is IEEE half (a weight beyond its range raises, never
saturates). Sizes per expert-layer-token: 4, 2, 2 bytes, beside the ids' 1 (uint8) or 2 (uint16).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3lab.errors import RouteFormatError

__all__ = ["to_block", "from_block"]

#: the dtypes the weights travel in, and their bytes per weight
WEIGHT_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


class WeightCodec:
    """float32 ``[T, L, K]`` routing weights <-> bytes in ``dtype`` (``"float32"``, ``"float16"``, ``"bfloat16"``)."""

    codec_id = "weights"

    def __init__(self, dtype: str = "float32"):
        if dtype not in WEIGHT_DTYPES:
            raise RouteFormatError(f"weights dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
        self.dtype = dtype

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "dtype": self.dtype}

    @classmethod
    def from_config(cls, config: Any) -> WeightCodec:
        if not isinstance(config, dict) or config.get("id") != cls.codec_id or set(config) != {"id", "dtype"}:
            raise RouteFormatError(f"bad weights codec config {config!r}; expected {{'id': 'weights', 'dtype': ...}}")
        return cls(config["dtype"])

    def encoded_size(self, shape: tuple[int, ...]) -> int:
        return int(np.prod(shape, dtype=np.int64)) * WEIGHT_DTYPES[self.dtype]

    def encode(self, weights: np.ndarray) -> bytes:
        w = np.ascontiguousarray(weights, dtype=np.float32)
        if self.dtype == "float32":
            return w.astype("<f4", copy=False).tobytes()
        if self.dtype == "float16":
            big = np.abs(w) > np.finfo(np.float16).max
            if big.any():
                raise RouteFormatError(f"routing weight {float(w[big][0])} is beyond float16's range; use bfloat16 "
                                       "or float32")
            return w.astype("<f2").tobytes()
        u = w.view(np.uint32).astype(np.uint64)
        rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")  # round to nearest even
        return rounded.tobytes()

    def decode(self, buf: Any, shape: tuple[int, ...]) -> np.ndarray:
        want = self.encoded_size(shape)
        if len(buf) != want:
            raise RouteFormatError(f"weights block has {len(buf)} bytes; {self.dtype} {list(shape)} needs {want}")
        if self.dtype == "float32":
            out = np.frombuffer(buf, dtype="<f4").astype(np.float32)
        elif self.dtype == "float16":
            out = np.frombuffer(buf, dtype="<f2").astype(np.float32)
        else:
            out = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        out = out.reshape(shape)
        if out.size and not np.isfinite(out).all():
            raise RouteFormatError("weights block holds a non-finite weight")
        return out


def to_block(ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weights reordered into the block's order: ascending expert id inside each ``[token, layer]`` row."""
    order = np.argsort(ids, axis=2, kind="stable")
    return np.take_along_axis(np.asarray(weights, dtype=np.float32), order, axis=2)


def from_block(ids: np.ndarray, block: np.ndarray) -> np.ndarray:
    """The inverse of :func:`to_block` for the ids as decoded (any order inside a row)."""
    order = np.argsort(ids, axis=2, kind="stable")
    out = np.empty_like(block)
    np.put_along_axis(out, order, block, axis=2)
    return out
