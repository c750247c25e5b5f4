"""``topk-set``: each top-k row as one number of the combinatorial number system."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from r3lab.compaction.codecs.base import Buffer, RowCodec
from r3lab.compaction.codecs.registry import register_codec
from r3lab.compaction.kernels import (
    binomial_table,
    limbs_add,
    limbs_le,
    limbs_sub,
    pack_limbs,
    pack_wide,
    set_ranks,
    unpack_limbs,
    unpack_wide,
    unrank_sets,
)
from r3lab.errors import RouteFormatError


@register_codec
class TopKSet(RowCodec):
    """Each top-k row as one number in the combinatorial number system: ceil(log2 C(E, k)) bits per row.

    The row {c_1 < ... < c_k} becomes sum_i C(c_i, i). Replay does not depend on the order inside a
    top-k set, so **decode returns every row sorted ascending**. Numbers wider than 64 bits (e.g.
    512 experts top-22: 128 bits) are held as 64-bit limbs and written at their exact bit width,
    so splitting the number loses no information.

    Layout (format versions 1 and 2): with ``w = bit_length(C(E, k) - 1)`` bits per row, row ``i``'s
    number holds bits ``[i*w, (i+1)*w)`` of one LSB-first bit stream, laid out as in
    :class:`~r3lab.compaction.codecs.bitpack.BitPack`.
    """

    codec_id = "topk-set"
    sorts_rows = True
    checks_rows = True  # a rank below C(E, k) decodes to k distinct ids below E
    before_byte_stage: ClassVar[dict[str, Any]] = {"order": "layer"}

    def _rows_size(self, n_rows: int, top_k: int, dtype: np.dtype[Any], num_experts: int) -> int:
        nbits = binomial_table(num_experts, top_k)[3]
        return -(-n_rows * nbits // 8)

    def _encode_rows(self, rows: np.ndarray, num_experts: int) -> bytes:
        n, k = rows.shape
        limbs, _, W, nbits = binomial_table(num_experts, k)
        if W == 1:  # compiled fast path: the number fits one 64-bit word
            return pack_wide(set_ranks(rows, np.ascontiguousarray(limbs[:, :, 0])), nbits) if nbits else b""
        srt = np.sort(rows, axis=1).astype(np.intp)
        acc = [np.zeros(n, dtype=np.uint64) for _ in range(W)]
        for i in range(k):
            t = limbs[srt[:, i], i + 1]
            limbs_add(acc, [t[:, w] for w in range(W)])
        return pack_limbs(np.stack(acc, axis=1), nbits)

    def _decode_rows(self, buf: Buffer, n_rows: int, top_k: int, dtype: np.dtype[Any], num_experts: int) -> np.ndarray:
        self._check_size(buf, n_rows, top_k, dtype, num_experts)
        limbs, approx, W, nbits = binomial_table(num_experts, top_k)
        E, k = num_experts, top_k
        if W == 1:
            ranks = unpack_wide(buf, n_rows, nbits) if nbits else np.zeros(n_rows, dtype=np.uint64)
            out = np.empty((n_rows, k), dtype=dtype)
            bad = unrank_sets(ranks, np.ascontiguousarray(limbs[:, :, 0]), E, k, out)
            if bad >= 0:
                raise RouteFormatError(f"topk-set row {bad} holds a number >= C({E}, {k}); the payload is corrupt")
            return out
        words = unpack_limbs(buf, n_rows, nbits, W)
        rank = [words[:, w].copy() for w in range(W)]
        total = [np.full(n_rows, limbs[E, k, w], dtype=np.uint64) for w in range(W)]
        if n_rows and (limbs_le(total, rank)).any():
            bad = int(np.argmax(limbs_le(total, rank)))
            raise RouteFormatError(f"topk-set row {bad} holds a number >= C({E}, {k}); the payload is corrupt")
        wide = np.empty((n_rows, k), dtype=np.int64)
        for i in range(k, 0, -1):
            # largest c with C(c, i) <= rank: float guess, then exact correction by one step either way
            rf = sum(rank[w].astype(np.float64) * 2.0 ** (64 * w) for w in range(W))
            c = np.searchsorted(approx[:E, i], rf, side="right") - 1
            c = np.clip(c, i - 1, E - 1)
            for _ in range(4):
                up = np.minimum(c + 1, E - 1)
                step_up = (c + 1 < E) & limbs_le([limbs[up, i, w] for w in range(W)], rank)
                step_down = ~limbs_le([limbs[c, i, w] for w in range(W)], rank)
                if not (step_up.any() or step_down.any()):
                    break
                c = c + step_up - step_down
            else:
                raise RouteFormatError(f"topk-set decode did not converge for C(c, {i}); the payload is corrupt")
            limbs_sub(rank, [limbs[c, i, w] for w in range(W)])
            wide[:, i - 1] = c
        return wide.astype(dtype)
