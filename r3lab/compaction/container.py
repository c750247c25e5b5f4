"""The self-describing binary form of Routes: ``encode(routes, codec) -> bytes`` and ``decode(buf) -> Routes``.

Layout (all integers little-endian)::

    0   magic  b"R3RT"
    4   format version (u8), 3 reserved zero bytes
    8   header length H (u32)
    12  payload length P (u64)
    20  header: UTF-8 JSON {"codec": [stage configs], "shape": [T, L, K], "dtype", "num_experts",
        "layer_ids": [...], "num_seqs": n}
    20+H        cu_seqlens, int64 [n + 1]
    20+H+8(n+1) payload: the codec pipeline's bytes (P of them)
    (version 3, header "weights" set) the routing weights: W bytes, ``WeightCodec`` of the header's dtype
    end-4       CRC-32 of everything before it

``decode`` needs nothing else, checks every field and raises :class:`RouteFormatError` naming the
problem. Nothing here unpickles.

**The versioning rule.** The format version names what every byte means: this frame *and* the
payload layout of every codec in the pipeline. Any change to what bytes mean, in the frame or in
any codec, bumps :data:`FORMAT_VERSION` (a faster kernel that writes the same bytes does not), and
the reader keeps a path for every older version: it decodes it exactly, or refuses it with a
:class:`RouteFormatError` naming the version and why. It never guesses. A golden fixture of every
released layout stays in ``tests/fixtures/`` forever (one folder per version, never rewritten;
``make_golden.py`` will not overwrite), and the tests encode to those exact bytes and decode them.

Why one container version rather than a version per codec config: the version byte is read before
anything else, so one number selects the table of layouts below; a reader never has to know which
codec configs changed when, and an older reader refuses a newer buffer at once ("unsupported
format version") instead of misreading it. The cost, that a reader of version 1 also refuses
version 2 ``raw`` buffers whose bytes did not change, is the safe side to err on.

Versions:

- **3** (current, written for Routes that carry routing weights): version 2's frame, header and id payload,
  plus a header field ``"weights": {"id": "weights", "dtype": "float32" | "float16" | "bfloat16"}`` and, after the
  id payload, the weights block (:mod:`r3lab.compaction.codecs.weights`; its length follows from the shape and
  dtype). Ids-only Routes are still written as version 2: those bytes did not change meaning, so every version 2
  reader keeps reading them, and a version 2 reader refuses a buffer with weights at its version byte.
- **2** (ids only): every codec as its class docstring in :mod:`r3lab.compaction.codecs` says;
  the version 1 reader is :mod:`r3lab.compaction.legacy`.
- **1** (the first writers; CHANGELOG.md's format table names them): the same frame, and the same layouts for
  ``raw``, ``topk-set``, ``topk-gaps``, ``zstd``, and ``bitpack`` with ids of at most 8 bits
  (``num_experts <= 256``). ``bitpack`` with wider ids had *two* layouts under the same version and config:
  the first writer wrote a low-byte plane then a high-bit plane
  (:class:`~r3lab.compaction.legacy.BitPackPlanesV1`), the later ones one bit stream
  (:class:`~r3lab.compaction.codecs.BitPack`'s layout). Same length, no marker: such a buffer is refused
  unless the caller says which writer made it, ``decode(buf, legacy_bitpack="planes")`` or
  ``legacy_bitpack="stream"``. Version 1 knew only the codec ids raw, bitpack, topk-set, topk-gaps and zstd;
  any other id in a version 1 header is refused.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np
import orjson

from r3lab.compaction.codecs import PipelineSpec, parse_pipeline
from r3lab.compaction.codecs.base import Buffer
from r3lab.compaction.codecs.weights import WeightCodec, from_block, to_block
from r3lab.compaction.framing import byte_view as _byte_view
from r3lab.compaction.kernels import first_bad_row
from r3lab.compaction.legacy import LEGACY_BITPACK, v1_coder
from r3lab.errors import RouteFormatError
from r3lab.routes import Routes, check_cu_seqlens, compact_dtype

MAGIC = b"R3RT"
#: the version :func:`encode` writes for ids-only Routes (see the versioning rule above)
FORMAT_VERSION = 2
#: the version :func:`encode` writes for Routes with routing weights
WEIGHTS_FORMAT_VERSION = 3
#: every version :func:`decode` reads
READ_VERSIONS = (1, 2, 3)
_FIXED = struct.Struct("<4sB3xIQ")
_CRC = struct.Struct("<I")
#: default cap on decoded route bytes and on the encoded buffer (no decompression bombs)
DEFAULT_MAX_BYTES = 8 << 30


def encode(routes: Routes, codec: PipelineSpec = "raw", *, weights: str = "float32") -> bytes:
    """Encode Routes with a pipeline name (``"raw"``, ``"bitpack"``, ``"topk-set"``, ``"topk-set+zstd"``, ...),
    a codec object, or a list of codec configs. The result decodes with :func:`decode` alone.

    Routes with routing weights (``routes.weights``) are written as format version 3 with the weights in
    ``weights`` (``"float32"``, ``"float16"``, ``"bfloat16"``); ``routes.without_weights()`` sends ids only."""
    if not isinstance(routes, Routes):
        raise RouteFormatError(f"encode expects Routes, got {type(routes).__name__}")
    coder, stages = parse_pipeline(codec)
    wcodec = WeightCodec(weights)
    payload = coder.encode(routes.values, routes.num_experts)
    for stage in stages:
        payload = stage.encode(payload)
    extra: dict[str, Any] = {}
    wbytes = b""
    if routes.weights is not None:
        extra["weights"] = wcodec.get_config()
        wbytes = wcodec.encode(to_block(routes.values, routes.weights))
    header = orjson.dumps(
        {
            "codec": [coder.get_config()] + [s.get_config() for s in stages],
            "shape": list(routes.values.shape),
            "dtype": routes.values.dtype.name,
            "num_experts": routes.num_experts,
            "layer_ids": routes.layer_ids.tolist(),
            "num_seqs": len(routes),
            **extra,
        }
    )
    version = FORMAT_VERSION if routes.weights is None else WEIGHTS_FORMAT_VERSION
    body = b"".join(
        (
            _FIXED.pack(MAGIC, version, len(header), len(payload)),
            header,
            routes.cu_seqlens.astype("<i8").tobytes(),
            payload,
            wbytes,
        )
    )
    return body + _CRC.pack(zlib.crc32(body))


def _int(header: dict[str, Any], key: str, *, minimum: int = 0) -> int:
    v = header.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise RouteFormatError(f"header field {key!r} must be an integer, got {v!r}")
    if v < minimum:
        raise RouteFormatError(f"header field {key!r} must be >= {minimum}, got {v}")
    return v


def _parse_header(raw: memoryview, max_bytes: int) -> dict[str, Any]:
    try:
        h = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RouteFormatError(f"header is not valid JSON: {e}") from e
    if not isinstance(h, dict):
        raise RouteFormatError("header must be a JSON object")
    shape = h.get("shape")
    if not isinstance(shape, list) or len(shape) != 3:
        raise RouteFormatError(f"header shape must be [tokens, layers, top_k], got {shape!r}")
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int):
            raise RouteFormatError(f"header shape has a non-integer dim: {shape!r}")
        if d < 0:
            raise RouteFormatError(f"header shape has a negative dim: {shape!r}")
    num_experts = _int(h, "num_experts", minimum=1)
    dtype = compact_dtype(num_experts)
    if h.get("dtype") not in ("uint8", "uint16"):
        raise RouteFormatError(f"unknown dtype {h.get('dtype')!r}; routes are uint8 or uint16")
    if np.dtype(h["dtype"]) != dtype:
        raise RouteFormatError(
            f"dtype {h['dtype']} is not the compact dtype {dtype.name} of num_experts={num_experts}"
        )
    T, L, K = shape
    if K < 1 or K > num_experts:
        raise RouteFormatError(f"top_k={K} must be in [1, num_experts={num_experts}]")
    if T * L * K * dtype.itemsize > max_bytes:
        raise RouteFormatError(
            f"routes of shape {shape} need {T * L * K * dtype.itemsize} bytes, over the cap of {max_bytes}"
        )
    _int(h, "num_seqs")
    if not isinstance(h.get("layer_ids"), list) or len(h["layer_ids"]) != L:
        raise RouteFormatError(f"header layer_ids must be a list of {L} integers, got {h.get('layer_ids')!r}")
    if not isinstance(h.get("codec"), list):
        raise RouteFormatError(f"header codec must be a list of stage configs, got {h.get('codec')!r}")
    return h


def read_header(buf: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """Check the framing and checksum of an encoded buffer and return its header.

    Besides the JSON fields, the dict holds ``format_version`` (from the frame) and byte offsets.
    """
    mv = _byte_view(buf)
    if len(mv) > max_bytes:
        raise RouteFormatError(f"encoded buffer of {len(mv)} bytes is over the cap of {max_bytes}")
    if len(mv) < _FIXED.size + _CRC.size:
        raise RouteFormatError(f"truncated: {len(mv)} bytes is shorter than the {_FIXED.size + _CRC.size}-byte frame")
    magic, version, hlen, plen = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise RouteFormatError(f"bad magic {bytes(magic)!r}; not an r3lab routes buffer (expected {MAGIC!r})")
    if version not in READ_VERSIONS:
        raise RouteFormatError(
            f"unsupported format version {version}; this r3lab reads versions {', '.join(map(str, READ_VERSIONS))}"
        )
    if _FIXED.size + hlen > len(mv):
        raise RouteFormatError(f"truncated: header of {hlen} bytes runs past the end of a {len(mv)}-byte buffer")
    h = _parse_header(mv[_FIXED.size : _FIXED.size + hlen], max_bytes)
    wlen = 0
    if "weights" in h:
        if version < WEIGHTS_FORMAT_VERSION:
            raise RouteFormatError(f"a format version {version} header has a 'weights' field; routing weights "
                                   f"exist from version {WEIGHTS_FORMAT_VERSION}")
        wlen = WeightCodec.from_config(h["weights"]).encoded_size(tuple(h["shape"]))
        if wlen > max_bytes:
            raise RouteFormatError(f"routing weights of {wlen} bytes are over the cap of {max_bytes}")
    elif version >= WEIGHTS_FORMAT_VERSION:
        raise RouteFormatError(f"a format version {version} buffer without a 'weights' header field "
                               f"(ids-only routes are version {FORMAT_VERSION})")
    cu_off = _FIXED.size + hlen
    pay_off = cu_off + 8 * (h["num_seqs"] + 1)
    want = pay_off + plen + wlen + _CRC.size
    if len(mv) < want:
        raise RouteFormatError(f"truncated: the header describes {want} bytes, the buffer has {len(mv)}")
    if len(mv) > want:
        raise RouteFormatError(f"{len(mv) - want} trailing bytes after the end of the encoded routes")
    (crc,) = _CRC.unpack_from(mv, want - _CRC.size)
    if zlib.crc32(mv[: want - _CRC.size]) != crc:
        raise RouteFormatError("checksum mismatch: the encoded routes were corrupted")
    return {**h, "format_version": version, "_cu_offset": cu_off, "_payload_offset": pay_off, "_payload_length": plen,
            "_weights_length": wlen}


def decode(
    buf: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES, legacy_bitpack: str | None = None
) -> Routes:
    """Decode what :func:`encode` wrote, in any version of :data:`READ_VERSIONS`.

    Rows come back sorted for set codecs (``topk-set``, ``topk-gaps``). ``legacy_bitpack`` names
    the writer of a format version 1 ``bitpack`` buffer with ids wider than 8 bits, which is
    otherwise refused as ambiguous: ``"planes"`` (the first version 1 writer) or ``"stream"`` (the
    later ones); see :data:`LEGACY_BITPACK`. Every other buffer ignores it.
    """
    if legacy_bitpack is not None and legacy_bitpack not in LEGACY_BITPACK:
        raise RouteFormatError(
            f"legacy_bitpack must be one of {sorted(LEGACY_BITPACK)} or None, got {legacy_bitpack!r}"
        )
    h = read_header(buf, max_bytes=max_bytes)
    mv = _byte_view(buf)
    coder, stages = parse_pipeline(h["codec"])
    T, L, K = h["shape"]
    E = h["num_experts"]
    if h["format_version"] == 1:
        coder = v1_coder(coder, [s.codec_id for s in stages], E, legacy_bitpack)
    dtype = compact_dtype(E)
    cu = np.frombuffer(mv[h["_cu_offset"] : h["_payload_offset"]], dtype="<i8")
    cu = check_cu_seqlens(cu, T)
    payload: Buffer = mv[h["_payload_offset"] : h["_payload_offset"] + h["_payload_length"]]
    for stage in stages:  # at most one byte stage; it must inflate to exactly what the id coder reads
        payload = stage.decode(payload, coder.encoded_size((T, L, K), dtype, E))
    values = coder.decode(payload, (T, L, K), dtype, E)
    row, problem = (-1, -1) if coder.checks_rows else first_bad_row(values.reshape(-1, K), E)
    if row >= 0:
        bad = values.reshape(-1, K)[row].tolist()
        what = f"expert id out of range [0, {E})" if problem == 0 else "repeated expert id inside a top-k row"
        where = f"row {row} (token {row // max(L, 1)}, layer {h['layer_ids'][row % L]})"
        raise RouteFormatError(f"{what}: {where} is {bad}")
    w = None
    if "weights" in h:
        w_off = h["_payload_offset"] + h["_payload_length"]
        block = WeightCodec.from_config(h["weights"]).decode(mv[w_off : w_off + h["_weights_length"]], (T, L, K))
        w = from_block(values, block)
    return Routes(values, cu, E, h["layer_ids"], validate=False, weights=w)
