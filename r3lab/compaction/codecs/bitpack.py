"""``bitpack``: ceil(log2 E) bits per id."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from r3lab.compaction.codecs.base import Buffer, RowCodec
from r3lab.compaction.codecs.registry import register_codec
from r3lab.compaction.kernels import pack_ids, unpack_ids


def id_bits(num_experts: int) -> int:
    """Bits per expert id: ceil(log2 E), at least 1."""
    return max(1, (num_experts - 1).bit_length())


@register_codec
class BitPack(RowCodec):
    """ceil(log2 E) bits per id, one little-endian bit stream (least significant bit first).

    Layout (format version 2; also version 1 for ids of at most 8 bits): with ``b`` bits per id,
    id number ``i`` (rows in ``order``, ids within a row in their stored order) holds bits
    ``[i*b, (i+1)*b)`` of the stream, its least significant bit first; stream bit ``j`` is bit
    ``j % 8`` of byte ``j // 8``. The last byte is zero-padded; the payload is ``ceil(n*b/8)`` bytes.
    So 16 experts (4 bits) put ids ``1, 2`` in byte ``0x21``, and 65536 experts (16 bits) write each
    id as a little-endian uint16.

    Version 1 buffers with ids wider than 8 bits (E > 256) are ambiguous: the first version 1 writer
    used :class:`~r3lab.compaction.legacy.BitPackPlanesV1`'s layout, later ones this layout, both
    under the same version and config (CHANGELOG.md's format table names the writers). The container
    refuses them unless told which (``legacy_bitpack=``).
    """

    codec_id = "bitpack"
    before_byte_stage: ClassVar[dict[str, Any]] = {"order": "layer"}

    def _rows_size(self, n_rows: int, top_k: int, dtype: np.dtype[Any], num_experts: int) -> int:
        return -(-n_rows * top_k * id_bits(num_experts) // 8)

    def _encode_rows(self, rows: np.ndarray, num_experts: int) -> bytes:
        return pack_ids(rows, id_bits(num_experts))

    def _decode_rows(self, buf: Buffer, n_rows: int, top_k: int, dtype: np.dtype[Any], num_experts: int) -> np.ndarray:
        self._check_size(buf, n_rows, top_k, dtype, num_experts)
        return unpack_ids(buf, n_rows * top_k, id_bits(num_experts), dtype).reshape(n_rows, top_k)
