"""Readers of older format versions: what version 1 buffers mean where it differs from today, and refusals.

Only one layout changed between versions 1 and 2: ``bitpack`` with ids wider than 8 bits, which
the first version 1 writer laid out as two planes (:class:`BitPackPlanesV1`) and later
writers as version 2's one bit stream (:data:`LEGACY_BITPACK` names them). Nothing here is ever written. See
:mod:`r3lab.compaction.container` for the versioning rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from r3lab.compaction.codecs.base import Buffer, IdCodec
from r3lab.compaction.codecs.bitpack import BitPack, id_bits
from r3lab.errors import RouteFormatError

__all__ = ["V1_CODEC_IDS", "v1_coder"]

#: the writers of version 1 ``bitpack`` buffers with ids wider than 8 bits, for ``decode(legacy_bitpack=...)``
LEGACY_BITPACK = {
    "planes": "r3lab cf15985: a low-byte plane, then the high bits as a bit stream",
    "stream": "r3lab 9956a86 up to format version 2: one bit stream, as version 2 writes",
}
#: the codec ids version 1 knew; any other id in a version 1 header is refused
V1_CODEC_IDS = frozenset({"raw", "bitpack", "topk-set", "topk-gaps", "zstd"})


def _unpack_small_v1(buf: Buffer, n: int, b: int) -> np.ndarray:
    """The planes layout's reader of ``n`` values of ``b <= 8`` bits packed LSB first (a plain bit stream)."""
    g = 8 // math.gcd(b, 8)  # ids per byte-aligned group
    nbytes_group = g * b // 8
    m = -(-n // g)
    raw = np.zeros(m * nbytes_group, dtype=np.uint8)
    raw[: len(buf)] = np.frombuffer(buf, dtype=np.uint8)
    words = np.zeros((m, 8), dtype=np.uint8)
    words[:, :nbytes_group] = raw.reshape(m, nbytes_group)
    acc = words.view("<u8").reshape(m)
    mask = np.uint64((1 << b) - 1)
    out = np.empty((m, g), dtype=np.uint16)
    for j in range(g):
        out[:, j] = (acc >> np.uint64(j * b)) & mask
    return out.reshape(-1)[:n]


class BitPackPlanesV1(BitPack):
    """Read-only: ``bitpack`` as the first format version 1 writer laid out ids wider than 8 bits.

    Two planes, for ``n`` ids of ``b`` bits (8 < b <= 16): first the low byte of every id (``n``
    bytes), then the high ``b - 8`` bits of every id as one LSB-first bit stream of
    ``ceil(n*(b-8)/8)`` bytes. The total equals :class:`BitPack`'s ``ceil(n*b/8)``, so the length
    cannot tell the two apart. Ids of at most 8 bits were one bit stream, as in :class:`BitPack`.
    Never registered and never written; the container uses it for ``legacy_bitpack="planes"``.
    """

    def _encode_rows(self, rows: np.ndarray, num_experts: int) -> bytes:
        raise RouteFormatError("the format version 1 planes layout of bitpack is read-only; encode writes version 2")

    def _decode_rows(self, buf: Buffer, n_rows: int, top_k: int, dtype: np.dtype[Any], num_experts: int) -> np.ndarray:
        self._check_size(buf, n_rows, top_k, dtype, num_experts)
        n, b = n_rows * top_k, id_bits(num_experts)
        if b <= 8:
            return super()._decode_rows(buf, n_rows, top_k, dtype, num_experts)
        mv = memoryview(buf)
        lo = np.frombuffer(mv[:n], dtype=np.uint8).astype(np.uint16)
        flat = lo | (_unpack_small_v1(mv[n:], n, b - 8) << np.uint16(8))
        return flat.astype(dtype, copy=False).reshape(n_rows, top_k)


def v1_coder(coder: IdCodec, stage_ids: Iterable[str], num_experts: int, legacy_bitpack: str | None) -> IdCodec:
    """The id codec that reads a format version 1 payload exactly, or a RouteFormatError saying why none can."""
    unknown = sorted({coder.codec_id, *stage_ids} - V1_CODEC_IDS)
    if unknown:
        raise RouteFormatError(
            f"format version 1 buffer names codec {unknown[0]!r}, which version 1 did not have "
            f"(it knew {sorted(V1_CODEC_IDS)}); refusing to guess its layout"
        )
    if coder.codec_id != BitPack.codec_id or id_bits(num_experts) <= 8:
        return coder  # layouts that never changed
    b = id_bits(num_experts)
    if legacy_bitpack is None:
        raise RouteFormatError(
            f"format version 1 bitpack buffer with {b}-bit ids (num_experts={num_experts}) is ambiguous: "
            "r3lab cf15985 wrote a low-byte plane plus a high-bit plane, 9956a86 and later one bit stream, "
            "both as version 1 with the same codec config and length, so the bytes cannot tell which. "
            "If you know the writer, pass decode(..., legacy_bitpack='planes') for cf15985 "
            "or legacy_bitpack='stream' for 9956a86 and later"
        )
    return BitPackPlanesV1(getattr(coder, "order", "token")) if legacy_bitpack == "planes" else coder
