"""Compiled inner loops (numba) for the hot paths of transport: row checks and bit packing.

Numpy needs several passes over the ids for each of these; one compiled pass runs at memory speed.
Compiled once per machine (``cache=True`` keeps the machine code beside this file).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["first_bad_row", "pack_ids", "unpack_ids"]


@numba.njit(cache=True, nogil=True)
def _any_bad_small(rows, num_experts):  # pragma: no cover - compiled
    """Branch-free pass for E <= 64: nonzero when some row has an id >= E or a repeated id."""
    n, k = rows.shape
    bad = np.uint64(0)
    for r in range(n):
        mask = np.uint64(0)
        for j in range(k):
            v = np.uint64(rows[r, j])
            bit = np.uint64(1) << (v & np.uint64(63))
            bad |= (mask & bit) | np.uint64(v >= num_experts)
            mask |= bit
    return bad != 0


@numba.njit(cache=True, nogil=True)
def _first_bad_row(rows, num_experts):  # pragma: no cover - compiled
    """(row, 0) for an id out of range, (row, 1) for a repeated id, (-1, -1) when every row is fine."""
    n, k = rows.shape
    stamp = np.full(max(num_experts, 1), -1, dtype=np.int64)
    for r in range(n):
        for j in range(k):
            v = np.int64(rows[r, j])
            if v >= num_experts:
                return r, 0
            if stamp[v] == r:
                return r, 1
            stamp[v] = r
    return -1, -1


def first_bad_row(rows: np.ndarray, num_experts: int) -> tuple[int, int]:
    """Check every ``[rows, top_k]`` row in one pass: ids below ``num_experts`` and distinct."""
    rows = np.ascontiguousarray(rows)
    if num_experts <= 64 and not _any_bad_small(rows, num_experts):
        return -1, -1
    return _first_bad_row(rows, num_experts)


@numba.njit(cache=True, nogil=True)
def _pack(flat, bits, out):  # pragma: no cover - compiled
    acc = np.uint64(0)
    nacc = 0
    j = 0
    for i in range(flat.size):
        acc |= np.uint64(flat[i]) << np.uint64(nacc)
        nacc += bits
        if nacc >= 32:
            out[j] = np.uint8(acc & np.uint64(255))
            out[j + 1] = np.uint8((acc >> np.uint64(8)) & np.uint64(255))
            out[j + 2] = np.uint8((acc >> np.uint64(16)) & np.uint64(255))
            out[j + 3] = np.uint8((acc >> np.uint64(24)) & np.uint64(255))
            j += 4
            acc >>= np.uint64(32)
            nacc -= 32
    while nacc > 0:
        out[j] = np.uint8(acc & np.uint64(255))
        j += 1
        acc >>= np.uint64(8)
        nacc -= 8
    return j


@numba.njit(cache=True, nogil=True)
def _unpack(buf, n, bits, out):  # pragma: no cover - compiled
    acc = np.uint64(0)
    nacc = 0
    j = 0
    mask = np.uint64((1 << bits) - 1)
    for i in range(n):
        while nacc < bits:
            acc |= np.uint64(buf[j]) << np.uint64(nacc)
            j += 1
            nacc += 8
        out[i] = acc & mask
        acc >>= np.uint64(bits)
        nacc -= bits


def pack_ids(flat: np.ndarray, bits: int) -> bytes:
    """Write each id in ``bits`` bits (1..16), little-endian bit order, into ceil(n * bits / 8) bytes."""
    out = np.empty(-(-flat.size * bits // 8) + 4, dtype=np.uint8)
    used = _pack(np.ascontiguousarray(flat).reshape(-1), bits, out)
    return out[:used].tobytes()


def unpack_ids(buf, n: int, bits: int, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`pack_ids`; the caller checks ``len(buf) == ceil(n * bits / 8)``."""
    out = np.empty(n, dtype=dtype)
    _unpack(np.frombuffer(buf, dtype=np.uint8), n, bits, out)
    return out
