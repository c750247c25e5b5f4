"""The library's exceptions: one base class, and one type for every malformed input."""

from __future__ import annotations


class R3LabError(Exception):
    """Base class of every error r3lab raises on purpose."""


class RouteFormatError(R3LabError, ValueError):
    """Routes or their encoded/JSON form are malformed.

    Raised for: bad magic or format version, unknown codec or dtype, truncated or trailing bytes,
    checksum mismatch, a shape that disagrees with the bytes, negative or non-integer dims, expert
    ids out of range, cu_seqlens that are not monotone or do not end at the token count, repeated
    ids inside a top-k row, and payloads over the size cap. The message names what is wrong.
    """


class ConfigError(R3LabError, ValueError):
    """An experiment's configuration is invalid (a field out of range, an unknown mode or dtype); names the field."""
