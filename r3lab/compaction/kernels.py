"""Inner loops of the codecs: compiled (numba) row checks and bit packing, and multi-limb (bigint) arithmetic.

Numpy needs several passes over the ids for each of these; one compiled pass runs at memory speed.
Compiled once per machine (``cache=True`` keeps the machine code beside this file). Numbers wider than
64 bits (``topk-set`` ranks of e.g. 512 experts top-22) are held as little-endian 64-bit limbs and
handled by the numpy limb helpers at the end of this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache, lru_cache
from typing import Any, TypeVar, cast

import numba
import numpy as np

__all__ = [
    "first_bad_row", "pack_ids", "unpack_ids", "pack_wide", "unpack_wide", "set_ranks", "unrank_sets",
    "binomial_table", "limbs_le", "limbs_add", "limbs_sub", "pack_limbs", "unpack_limbs",
]

#: a buffer the unpackers read (``np.frombuffer`` accepts any of these)
Buffer = bytes | bytearray | memoryview

_F = TypeVar("_F", bound=Callable[..., Any])


def _njit(fn: _F, *, cache: bool = True) -> _F:
    """``numba.njit(nogil=True)`` that keeps ``fn``'s signature for the type checker (numba ships no types)."""
    return cast(_F, numba.njit(cache=cache, nogil=True)(fn))


def _compiled(fn: _F) -> _F:
    """Decorator: compile ``fn`` once per machine (``cache=True``), without the GIL."""
    return _njit(fn)


@_compiled
def _any_bad_small(rows: np.ndarray, num_experts: int) -> bool:  # pragma: no cover - compiled
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
    return bool(bad != 0)


@_compiled
def _first_bad_row(rows: np.ndarray, num_experts: int) -> tuple[int, int]:  # pragma: no cover - compiled
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
    if rows.dtype == np.uint8 and rows.ndim == 2 and rows.shape[1] == 8 and (num_experts <= 128 or num_experts == 256):
        if not _any_bad_rows8(rows.view("<u8").reshape(-1), num_experts):  # the common top-8 case, 8 ids per word
            return -1, -1
    elif num_experts <= 64 and not _any_bad_small(rows, num_experts):
        return -1, -1
    return _first_bad_row(rows, num_experts)


@_compiled
def _pack_wide(vals: np.ndarray, bits: int, out32: np.ndarray) -> None:  # pragma: no cover - compiled
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


@_compiled
def _unpack_wide(words: np.ndarray, n: int, bits: int, out: np.ndarray) -> None:  # pragma: no cover - compiled
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


def pack_ids(flat: np.ndarray, bits: int) -> bytes:
    """Write each id in ``bits`` bits (1..16), little-endian bit order, into ceil(n * bits / 8) bytes."""
    flat = np.ascontiguousarray(flat).reshape(-1)
    n8 = flat.size // 8 * 8
    head = np.empty(n8 // 8 * bits, dtype=np.uint8)
    _group_kernels(bits)[0](flat, head)
    if n8 == flat.size:
        return head.tobytes()
    return head.tobytes() + pack_wide(flat[n8:], bits)  # the tail group starts on a byte boundary


def unpack_ids(buf: Buffer | np.ndarray, n: int, bits: int, dtype: np.dtype[Any]) -> np.ndarray:
    """Inverse of :func:`pack_ids`; the caller checks ``len(buf) == ceil(n * bits / 8)``."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    n_groups = n // 8
    out = np.empty(n, dtype=dtype)
    _group_kernels(bits)[1](raw, n_groups, out)
    if n_groups * 8 < n:
        out[n_groups * 8 :] = unpack_wide(raw[n_groups * bits :], n - n_groups * 8, bits)
    return out


def pack_wide(vals: np.ndarray, bits: int) -> bytes:
    """Write unsigned values in ``bits`` bits each (1..64) as one LSB-first bit stream of ceil(n * bits / 8) bytes."""
    nbytes = -(-vals.size * bits // 8)
    out32 = np.zeros(nbytes // 4 + 1, dtype="<u4")
    _pack_wide(np.ascontiguousarray(vals).reshape(-1), bits, out32)
    return out32.view(np.uint8)[:nbytes].tobytes()


def unpack_wide(buf: Buffer | np.ndarray, n: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_wide`: ``n`` values of ``bits`` bits each as uint64."""
    words = np.zeros(len(buf) // 4 + 2, dtype="<u4")
    words.view(np.uint8)[: len(buf)] = np.frombuffer(buf, dtype=np.uint8)
    out = np.empty(n, dtype=np.uint64)
    _unpack_wide(words, n, bits, out)
    return out


@_compiled
def set_ranks(rows: np.ndarray, table: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """Combinatorial-number-system rank of each row (any order inside a row), for C(E, k) < 2**64.

    An id's place in the sorted row is the count of smaller ids, so no sort (and no branch) is needed.
    """
    n, k = rows.shape
    out = np.empty(n, dtype=np.uint64)
    for r in range(n):
        acc = np.uint64(0)
        for a in range(k):
            x = rows[r, a]
            place = 0
            for b in range(k):
                place += rows[r, b] < x
            acc += table[np.int64(x), place + 1]
        out[r] = acc
    return out


@_compiled
def unrank_sets(  # pragma: no cover - compiled
    ranks: np.ndarray, table: np.ndarray, num_experts: int, k: int, out: np.ndarray
) -> int:
    """Inverse of :func:`set_ranks` into sorted rows; returns the first row whose rank is >= C(E, k), or -1."""
    total = table[num_experts, k]
    for r in range(ranks.size):
        rank = ranks[r]
        if rank >= total:
            return r
        top = num_experts - 1
        for i in range(k, 0, -1):
            # largest c in [i - 1, top] with C(c, i) <= rank (c_i < c_(i+1)); branch-free halving
            base: Any = i - 1  # an int64 once the loop adds to it (Any: numba ignores the annotation)
            size = top - base + 1
            while size > 1:
                half = size // 2
                base += half * np.int64(table[base + half, i] <= rank)
                size -= half
            rank -= table[base, i]
            out[r, i - 1] = base
            top = base - 1
    return -1


@cache
def _group_kernels(bits: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """Pack/unpack kernels for one id width (<= 16 bits), compiled with the width as a constant.

    8 ids of ``bits`` bits fill exactly ``bits`` bytes, so whole groups pack without branches; with
    the width known at compile time the inner loops unroll (about 3x faster than a runtime width).
    """
    B = bits
    NLO = min(B, 8)

    def pack(flat: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
        for g in range(flat.size // 8):
            lo = np.uint64(0)
            hi = np.uint64(0)
            for j in range(8):
                v = np.uint64(flat[8 * g + j])
                s = j * B
                if s < 64:
                    lo |= v << np.uint64(s)
                    if s + B > 64:
                        hi |= v >> np.uint64(64 - s)
                else:
                    hi |= v << np.uint64(s - 64)
            base = g * B
            for m in range(NLO):
                out[base + m] = np.uint8((lo >> np.uint64(8 * m)) & np.uint64(255))
            for m in range(8, B):
                out[base + m] = np.uint8((hi >> np.uint64(8 * (m - 8))) & np.uint64(255))

    def unpack(buf: np.ndarray, n_groups: int, out: np.ndarray) -> None:  # pragma: no cover - compiled
        mask = np.uint64((1 << B) - 1)
        for g in range(n_groups):
            base = g * B
            lo = np.uint64(0)
            hi = np.uint64(0)
            for m in range(NLO):
                lo |= np.uint64(buf[base + m]) << np.uint64(8 * m)
            for m in range(8, B):
                hi |= np.uint64(buf[base + m]) << np.uint64(8 * (m - 8))
            for j in range(8):
                s = j * B
                if s + B <= 64:
                    v = lo >> np.uint64(s)
                elif s >= 64:
                    v = hi >> np.uint64(s - 64)
                else:
                    v = (lo >> np.uint64(s)) | (hi << np.uint64(64 - s))
                out[8 * g + j] = v & mask

    return _njit(pack, cache=False), _njit(unpack, cache=False)


@_compiled
def _any_bad_rows8(words: np.ndarray, num_experts: int) -> bool:  # pragma: no cover - compiled
    """SWAR check of top-8 uint8 rows held as one uint64 each: a repeated byte, or a byte >= E (E <= 128)."""
    ones = np.uint64(0x0101010101010101)
    highs = np.uint64(0x8080808080808080)
    add = ones * np.uint64(128 - num_experts) if num_experts <= 128 else np.uint64(0)
    bad = np.uint64(0)
    for i in range(words.size):
        x = words[i]
        for r in range(1, 5):  # byte rotations 1..4 pair every two of the 8 bytes
            sh = np.uint64(8 * r)
            y = x ^ ((x >> sh) | (x << (np.uint64(64) - sh)))
            bad |= (y - ones) & ~y & highs  # high bit where y has a zero byte
        if num_experts <= 128:
            bad |= ((x + add) | x) & highs  # high bit where a byte > E - 1
    return bool(bad != 0)


# ---- multi-limb unsigned integers (numpy), for numbers wider than one 64-bit word -------------------------


@lru_cache(maxsize=64)
def binomial_table(num_experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """C(c, i) for c in [0, E], i in [0, k] as little-endian 64-bit limbs, a float64 copy, limbs W, and bits.

    ``bits`` is the width of a rank below C(E, k): ``bit_length(C(E, k) - 1)``; ``W`` limbs hold it.
    """
    total = math.comb(num_experts, top_k)
    nbits = (total - 1).bit_length()
    W = max(1, -(-nbits // 64))
    limbs = np.zeros((num_experts + 1, top_k + 1, W), dtype=np.uint64)
    approx = np.zeros((num_experts + 1, top_k + 1), dtype=np.float64)
    for c in range(num_experts + 1):
        for i in range(top_k + 1):
            x = math.comb(c, i)
            approx[c, i] = float(x)
            for w in range(W):
                limbs[c, i, w] = (x >> (64 * w)) & 0xFFFFFFFFFFFFFFFF
    limbs.setflags(write=False)
    approx.setflags(write=False)
    return limbs, approx, W, nbits


def limbs_le(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """Elementwise a <= b for multi-limb unsigned numbers (lists of limb arrays, least significant first)."""
    lt: np.ndarray = np.zeros(a[0].shape, dtype=bool)
    eq: np.ndarray = np.ones(a[0].shape, dtype=bool)
    for w in range(len(a) - 1, -1, -1):
        lt |= eq & (a[w] < b[w])
        eq &= a[w] == b[w]
    le: np.ndarray = lt | eq
    return le


def limbs_add(acc: list[np.ndarray], t: list[np.ndarray]) -> None:
    """``acc += t`` in place, limb by limb with carry (the sum must fit ``len(acc)`` limbs)."""
    carry = np.zeros(acc[0].shape, dtype=np.uint64)
    for w in range(len(acc)):
        s1 = acc[w] + t[w]
        c1 = s1 < acc[w]
        s2 = s1 + carry
        carry = (c1 | (s2 < s1)).astype(np.uint64)
        acc[w] = s2


def limbs_sub(acc: list[np.ndarray], t: list[np.ndarray]) -> None:
    """``acc -= t`` in place, limb by limb with borrow (``t <= acc`` elementwise)."""
    borrow = np.zeros(acc[0].shape, dtype=np.uint64)
    for w in range(len(acc)):
        d1 = acc[w] - t[w]
        b1 = acc[w] < t[w]
        d2 = d1 - borrow
        borrow = (b1 | (d1 < borrow)).astype(np.uint64)
        acc[w] = d2


def pack_limbs(words: np.ndarray, nbits: int) -> bytes:
    """Pack the low ``nbits`` of each row of little-endian uint64 limbs ``[N, W]`` into one LSB-first bit stream."""
    if nbits == 0 or words.shape[0] == 0:
        return b""
    bits = np.unpackbits(words.astype("<u8", copy=False).view(np.uint8), axis=1, bitorder="little")[:, :nbits]
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def unpack_limbs(buf: Buffer, n: int, nbits: int, W: int) -> np.ndarray:
    """Inverse of :func:`pack_limbs`: ``n`` numbers of ``nbits`` bits as ``[n, W]`` uint64 limbs."""
    out = np.zeros((n, 64 * W), dtype=np.uint8)
    if nbits and n:
        bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little", count=n * nbits)
        out[:, :nbits] = bits.reshape(n, nbits)
    return np.packbits(out, axis=1, bitorder="little").view("<u8").astype(np.uint64).reshape(n, W)
