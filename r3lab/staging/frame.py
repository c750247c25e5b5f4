"""The bytes of one staged chunk: a versioned frame naming the chunk, then an r3lab.compaction container.

Layout (format version :data:`CHUNK_VERSION`; integers little-endian)::

    0     magic b"R3SC"
    4     chunk format version (u8), 3 reserved zero bytes
    8     header length H (u32)
    12    header: UTF-8 JSON {"stage_id", "dp_rank", "mini_batch", "pp_rank", "seq_ids": [...],
          "num_tokens", "layer_ids": [...]}
    12+H  CRC-32 of bytes [0, 12+H)
    16+H  the routes: an r3lab.compaction container (its own version, header and CRC-32)
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Any

import orjson

from r3lab.compaction import decode, encode
from r3lab.compaction.framing import byte_view
from r3lab.errors import RouteFormatError
from r3lab.routes import Routes
from r3lab.staging.plan import ChunkSpec, StagingError

CHUNK_MAGIC = b"R3SC"
#: the chunk frame version :func:`encode_chunk` writes and :func:`decode_chunk` reads
CHUNK_VERSION = 1
_FIXED = struct.Struct("<4sB3xI")
_CRC = struct.Struct("<I")


def encode_chunk(share: Routes, spec: ChunkSpec, stage_id: str, codec: Any = "raw") -> bytes:
    """The bytes of one chunk: a versioned frame naming the chunk, then ``share`` encoded with an r3lab codec."""
    if len(share) != len(spec.seq_ids):
        raise StagingError(f"chunk {spec.name}: {len(share)} sequences for {len(spec.seq_ids)} sequence ids")
    header = orjson.dumps(
        {
            "stage_id": stage_id,
            "dp_rank": spec.dp_rank,
            "mini_batch": spec.mini_batch,
            "pp_rank": spec.pp_rank,
            "seq_ids": list(spec.seq_ids),
            "num_tokens": share.total_tokens,
            "layer_ids": share.layer_ids.tolist(),
        }
    )
    head = _FIXED.pack(CHUNK_MAGIC, CHUNK_VERSION, len(header)) + header
    return b"".join((head, _CRC.pack(zlib.crc32(head)), encode(share, codec)))


def decode_chunk(buf: Any, spec: ChunkSpec, stage_id: str, *, layer_ids: Sequence[int] | None = None) -> Routes:
    """Check a chunk's frame and identity against ``spec`` and decode its routes (zero-copy for ``raw``).

    Raises :class:`StagingError` naming the chunk and the problem: bad magic, version or checksum, or a
    chunk other than the expected one (stage id, ranks, mini-batch, sequence ids, token count, layers).
    """
    where = f"chunk {spec.name}"
    mv = byte_view(buf)
    if len(mv) < _FIXED.size + _CRC.size:
        raise StagingError(f"{where}: truncated, {len(mv)} bytes")
    magic, version, hlen = _FIXED.unpack_from(mv, 0)
    if magic != CHUNK_MAGIC:
        raise StagingError(f"{where}: bad magic {bytes(magic)!r}, not a staged chunk (expected {CHUNK_MAGIC!r})")
    if version != CHUNK_VERSION:
        raise StagingError(f"{where}: unsupported chunk format version {version}; this r3lab reads {CHUNK_VERSION}")
    end = _FIXED.size + hlen
    if end + _CRC.size > len(mv):
        raise StagingError(f"{where}: truncated, the header runs past the end of {len(mv)} bytes")
    (crc,) = _CRC.unpack_from(mv, end)
    if zlib.crc32(mv[:end]) != crc:
        raise StagingError(f"{where}: checksum mismatch in the chunk header: the chunk was corrupted")
    try:
        h = orjson.loads(mv[_FIXED.size : end])
    except orjson.JSONDecodeError as e:
        raise StagingError(f"{where}: header is not valid JSON: {e}") from e
    got = (h.get("stage_id"), h.get("dp_rank"), h.get("mini_batch"), h.get("pp_rank"))
    want = (stage_id, spec.dp_rank, spec.mini_batch, spec.pp_rank)
    if got != want:
        raise StagingError(f"{where}: got the chunk of (stage_id, dp_rank, mini_batch, pp_rank)={got}, expected {want}")
    if tuple(h.get("seq_ids") or ()) != spec.seq_ids:
        raise StagingError(f"{where}: the chunk holds other sequences than the plan says")
    try:
        share = decode(mv[end + _CRC.size :])
    except RouteFormatError as e:
        raise StagingError(f"{where}: {e}") from e
    if len(share) != len(spec.seq_ids) or share.total_tokens != h.get("num_tokens"):
        raise StagingError(
            f"{where}: {len(share)} sequences / {share.total_tokens} tokens, the header says "
            f"{len(spec.seq_ids)} / {h.get('num_tokens')}"
        )
    if share.layer_ids.tolist() != h.get("layer_ids") or (
        layer_ids is not None and share.layer_ids.tolist() != list(layer_ids)
    ):
        raise StagingError(f"{where}: layers {share.layer_ids.tolist()}, expected {list(layer_ids or h['layer_ids'])}")
    return share
