"""Byte-level helpers shared by r3lab's binary frames (the routes container and the staging chunk)."""

from __future__ import annotations

__all__ = ["byte_view"]


def byte_view(buf: bytes | bytearray | memoryview | object) -> memoryview:
    """A flat, unsigned-byte view of any buffer (bytes, numpy arrays of any dtype or shape), without copying."""
    mv = memoryview(buf)  # type: ignore[arg-type]
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
