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
def _pack(flat, bits, out32):  # pragma: no cover - compiled
    """LSB-first bit stream of ``bits``-wide values (bits <= 32), written 32 bits at a time."""
    acc = np.uint64(0)
    nacc = 0
    j = 0
    for i in range(flat.size):
        acc |= np.uint64(flat[i]) << np.uint64(nacc)
        nacc += bits
        if nacc >= 32:
            out32[j] = np.uint32(acc & np.uint64(0xFFFFFFFF))
            j += 1
            acc >>= np.uint64(32)
            nacc -= 32
    if nacc > 0:
        out32[j] = np.uint32(acc & np.uint64(0xFFFFFFFF))


@numba.njit(cache=True, nogil=True)
def _unpack(words, n, bits, out):  # pragma: no cover - compiled
    acc = np.uint64(0)
    nacc = 0
    j = 0
    mask = np.uint64((1 << bits) - 1)
    for i in range(n):
        if nacc < bits:
            acc |= np.uint64(words[j]) << np.uint64(nacc)
            j += 1
            nacc += 32
        out[i] = acc & mask
        acc >>= np.uint64(bits)
        nacc -= bits


def pack_ids(flat: np.ndarray, bits: int) -> bytes:
    """Write each id in ``bits`` bits (1..16), little-endian bit order, into ceil(n * bits / 8) bytes."""
    nbytes = -(-flat.size * bits // 8)
    out32 = np.zeros(nbytes // 4 + 1, dtype="<u4")
    _pack(np.ascontiguousarray(flat).reshape(-1), bits, out32)
    return out32.view(np.uint8)[:nbytes].tobytes()


def unpack_ids(buf, n: int, bits: int, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`pack_ids`; the caller checks ``len(buf) == ceil(n * bits / 8)``."""
    words = np.zeros(len(buf) // 4 + 1, dtype="<u4")
    words.view(np.uint8)[: len(buf)] = np.frombuffer(buf, dtype=np.uint8)
    out = np.empty(n, dtype=dtype)
    _unpack(words, n, bits, out)
    return out


@numba.njit(cache=True, nogil=True)
def _pack_wide(vals, bits, out32):  # pragma: no cover - compiled
    """LSB-first bit stream of ``bits``-wide uint64 values (bits <= 64), each written as two halves."""
    acc = np.uint64(0)
    nacc = 0
    j = 0
    lo_bits = min(bits, 32)
    for i in range(vals.size):
        v = vals[i]
        for part in range(2):
            w = lo_bits if part == 0 else bits - lo_bits
            if w == 0:
                continue
            x = (v & np.uint64(0xFFFFFFFF)) if part == 0 else (v >> np.uint64(32))
            acc |= x << np.uint64(nacc)
            nacc += w
            if nacc >= 32:
                out32[j] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                j += 1
                acc >>= np.uint64(32)
                nacc -= 32
    if nacc > 0:
        out32[j] = np.uint32(acc & np.uint64(0xFFFFFFFF))


@numba.njit(cache=True, nogil=True)
def _unpack_wide(words, n, bits, out):  # pragma: no cover - compiled
    acc = np.uint64(0)
    nacc = 0
    j = 0
    lo_bits = min(bits, 32)
    for i in range(n):
        v = np.uint64(0)
        for part in range(2):
            w = lo_bits if part == 0 else bits - lo_bits
            if w == 0:
                continue
            if nacc < w:
                acc |= np.uint64(words[j]) << np.uint64(nacc)
                j += 1
                nacc += 32
            x = acc & np.uint64((1 << w) - 1)
            acc >>= np.uint64(w)
            nacc -= w
            v |= x if part == 0 else (x << np.uint64(32))
        out[i] = v


def pack_wide(vals: np.ndarray, bits: int) -> bytes:
    """Write uint64 values in ``bits`` bits each (1..64) as one bit stream of ceil(n * bits / 8) bytes."""
    nbytes = -(-vals.size * bits // 8)
    out32 = np.zeros(nbytes // 4 + 1, dtype="<u4")
    _pack_wide(np.ascontiguousarray(vals, dtype=np.uint64), bits, out32)
    return out32.view(np.uint8)[:nbytes].tobytes()


def unpack_wide(buf, n: int, bits: int) -> np.ndarray:
    words = np.zeros(len(buf) // 4 + 2, dtype="<u4")
    words.view(np.uint8)[: len(buf)] = np.frombuffer(buf, dtype=np.uint8)
    out = np.empty(n, dtype=np.uint64)
    _unpack_wide(words, n, bits, out)
    return out


@numba.njit(cache=True, nogil=True)
def set_ranks(rows, table):  # pragma: no cover - compiled
    """Combinatorial-number-system rank of each row (any order inside a row), for C(E, k) < 2**64."""
    n, k = rows.shape
    out = np.empty(n, dtype=np.uint64)
    srt = np.empty(k, dtype=np.int64)
    for r in range(n):
        for j in range(k):  # insertion sort of a short row
            v = np.int64(rows[r, j])
            m = j
            while m > 0 and srt[m - 1] > v:
                srt[m] = srt[m - 1]
                m -= 1
            srt[m] = v
        acc = np.uint64(0)
        for i in range(k):
            acc += table[srt[i], i + 1]
        out[r] = acc
    return out


@numba.njit(cache=True, nogil=True)
def unrank_sets(ranks, table, num_experts, k, out):  # pragma: no cover - compiled
    """Inverse of :func:`set_ranks` into sorted rows; returns the first row whose rank is >= C(E, k), or -1."""
    total = table[num_experts, k]
    for r in range(ranks.size):
        rank = ranks[r]
        if rank >= total:
            return r
        for i in range(k, 0, -1):
            lo, hi = i - 1, num_experts - 1  # largest c in [lo, hi] with C(c, i) <= rank
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if table[mid, i] <= rank:
                    lo = mid
                else:
                    hi = mid - 1
            rank -= table[lo, i]
            out[r, i - 1] = lo
    return -1


@numba.njit(cache=True, nogil=True)
def _unpack_rows_checked(words, n_rows, k, bits, num_experts, out):  # pragma: no cover - compiled
    """Unpack ``[n_rows, k]`` ids and check each row in the same pass; returns (row, problem) or (-1, -1)."""
    acc = np.uint64(0)
    nacc = 0
    j = 0
    valmask = np.uint64((1 << bits) - 1)
    small = num_experts <= 64
    stamp = np.full(1 if small else num_experts, -1, dtype=np.int64)
    for r in range(n_rows):
        seen = np.uint64(0)
        for c in range(k):
            if nacc < bits:
                acc |= np.uint64(words[j]) << np.uint64(nacc)
                j += 1
                nacc += 32
            v = acc & valmask
            acc >>= np.uint64(bits)
            nacc -= bits
            out[r, c] = v
            if v >= num_experts:
                return r, 0
            if small:
                bit = np.uint64(1) << v
                if seen & bit:
                    return r, 1
                seen |= bit
            else:
                if stamp[v] == r:
                    return r, 1
                stamp[v] = r
    return -1, -1


def unpack_rows_checked(buf, n_rows: int, k: int, bits: int, num_experts: int, dtype: np.dtype) -> tuple[np.ndarray, int, int]:
    """Unpack :func:`pack_ids` output into ``[n_rows, k]`` and validate every row in one pass."""
    words = np.zeros(len(buf) // 4 + 1, dtype="<u4")
    words.view(np.uint8)[: len(buf)] = np.frombuffer(buf, dtype=np.uint8)
    out = np.empty((n_rows, k), dtype=dtype)
    row, problem = _unpack_rows_checked(words, n_rows, k, bits, num_experts, out)
    return out, row, problem
