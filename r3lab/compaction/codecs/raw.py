"""``raw``: the compact buffer as it is."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from r3lab.compaction.codecs.base import Buffer, RowCodec
from r3lab.compaction.codecs.registry import register_codec


@register_codec
class Raw(RowCodec):
    """The compact buffer as it is: one uint8/uint16 per id, little-endian (format versions 1 and 2)."""

    codec_id = "raw"
    before_byte_stage: ClassVar[dict[str, Any]] = {"order": "layer"}

    def _rows_size(self, n_rows: int, top_k: int, dtype: np.dtype[Any], num_experts: int) -> int:
        return n_rows * top_k * np.dtype(dtype).itemsize

    def _encode_rows(self, rows: np.ndarray, num_experts: int) -> bytes:
        return rows.astype(rows.dtype.newbyteorder("<"), copy=False).tobytes()

    def _decode_rows(self, buf: Buffer, n_rows: int, top_k: int, dtype: np.dtype[Any], num_experts: int) -> np.ndarray:
        self._check_size(buf, n_rows, top_k, dtype, num_experts)
        le = np.dtype(dtype).newbyteorder("<")
        return np.frombuffer(buf, dtype=le).astype(dtype, copy=False).reshape(n_rows, top_k)
