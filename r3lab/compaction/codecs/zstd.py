"""``zstd``: the byte stage."""

from __future__ import annotations

from typing import Any

import zstandard

from r3lab.compaction.codecs.base import Buffer, ByteCodec
from r3lab.compaction.codecs.registry import register_codec
from r3lab.errors import RouteFormatError


@register_codec
class Zstd(ByteCodec):
    """Zstandard over the bytes of the stage before it; pays where expert popularity is skewed."""

    codec_id = "zstd"

    def __init__(self, level: int = 3):
        if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22:
            raise RouteFormatError(f"zstd level must be an integer in [-7, 22], got {level!r}")
        self.level = level

    def _params(self) -> dict[str, Any]:
        return {"level": self.level}

    def encode(self, data: Buffer) -> bytes:
        return zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(data)

    def decode(self, buf: Buffer, expected_size: int) -> memoryview:
        """Decompress exactly ``expected_size`` bytes; a frame that claims otherwise is refused before inflating."""
        try:
            size = zstandard.frame_content_size(buf)
        except zstandard.ZstdError as e:
            raise RouteFormatError(f"zstd stage: not a zstd frame ({e})") from e
        if size != expected_size:
            raise RouteFormatError(f"zstd frame declares {size} bytes, the shape needs {expected_size}")
        try:
            out = zstandard.ZstdDecompressor().decompress(buf, max_output_size=expected_size, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise RouteFormatError(f"zstd stage: corrupt or truncated frame ({e})") from e
        if len(out) != expected_size:
            raise RouteFormatError(f"zstd frame inflated to {len(out)} bytes, expected {expected_size}")
        return memoryview(out)
