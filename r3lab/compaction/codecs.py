"""Route codecs, numcodecs-style: small classes that turn routes into bytes and back.

Every codec has a ``codec_id``, a JSON-safe ``get_config()``, and is rebuilt from that config by
:func:`get_codec`, which looks the id up in a registry that :func:`register_codec` extends. There
are two kinds, each one interface (abstract ``encode``/``decode``):

- :class:`IdCodec`: ``[T, L, K]`` expert ids <-> bytes (``raw``, ``bitpack``, ``topk-set``,
  ``topk-gaps``). It opens every pipeline.
- :class:`ByteCodec`: bytes <-> bytes (``zstd``). At most one follows the id codec.

Pipelines are checked by these interfaces, never by concrete class, so a registered codec of
either kind takes part in :func:`~r3lab.compaction.encode` / :func:`~r3lab.compaction.decode` by name.

A row is one (token, layer) router decision. Row codecs take ``order``: ``"token"`` keeps the rows
token-major as stored; ``"layer"`` writes each layer's rows together, which lets a byte stage see
one layer's (skewed) expert popularity at a time.

What the bytes of each codec mean is fixed per container format version (see
:mod:`r3lab.compaction.container`); each codec's docstring describes the current version's layout.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
import zstandard

from r3lab.compaction.kernels import pack_ids, pack_wide, set_ranks, unpack_ids, unpack_wide, unrank_sets
from r3lab.errors import RouteFormatError

__all__ = [
    "Codec", "IdCodec", "ByteCodec", "RowCodec", "Raw", "BitPack", "TopKSet", "TopKGaps", "Zstd",
    "IdCoder", "SetGaps", "register_codec", "get_codec", "parse_pipeline", "CODECS", "ALIASES", "id_bits",
]


class Codec(ABC):
    """Base of every codec: an id, a JSON-safe config that rebuilds it, and ``encode``/``decode``.

    The arguments of ``encode``/``decode`` are fixed by the codec's kind: :class:`IdCodec` (ids to
    bytes) or :class:`ByteCodec` (bytes to bytes). Subclass one of those, not this class.
    """

    codec_id: ClassVar[str]

    @abstractmethod
    def encode(self, *args: Any, **kwargs: Any) -> bytes:
        """Encode; the signature is the kind's (:meth:`IdCodec.encode`, :meth:`ByteCodec.encode`)."""

    @abstractmethod
    def decode(self, *args: Any, **kwargs: Any) -> Any:
        """Decode; the signature is the kind's (:meth:`IdCodec.decode`, :meth:`ByteCodec.decode`)."""

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, **self._params()}

    def _params(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        params = {k: v for k, v in config.items() if k != "id"}
        try:
            return cls(**params)
        except TypeError as e:
            raise RouteFormatError(f"bad config for codec {cls.codec_id!r}: {config}") from e

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({params})"


class IdCodec(Codec):
    """Interface of the codecs that open a pipeline: ``[T, L, K]`` expert ids <-> bytes.

    ``decode`` gets exactly ``encoded_size(shape, ...)`` bytes (the container checks that first for
    byte stages) and returns a ``[T, L, K]`` array of ``dtype``.
    """

    #: whether decode returns each row sorted (set semantics) rather than in the stored order
    sorts_rows: ClassVar[bool] = False
    #: whether decode itself guarantees ids in range and distinct within each row (else the container checks)
    checks_rows: ClassVar[bool] = False

    @abstractmethod
    def encode(self, values: np.ndarray, num_experts: int) -> bytes:
        """Bytes for a ``[T, L, K]`` array of valid ids (each row distinct, all below ``num_experts``)."""

    @abstractmethod
    def decode(self, buf: memoryview, shape: tuple[int, int, int], dtype: np.dtype, num_experts: int) -> np.ndarray:
        """The ``[T, L, K]`` ids of ``dtype`` back from ``buf``; malformed bytes raise :class:`RouteFormatError`."""

    @abstractmethod
    def encoded_size(self, shape: tuple[int, int, int], dtype: np.dtype, num_experts: int) -> int:
        """Bytes this codec writes for routes of ``shape`` ([T, L, K]); decode refuses any other length."""


class ByteCodec(Codec):
    """Interface of the stages that follow the id codec: bytes <-> bytes."""

    @abstractmethod
    def encode(self, data: bytes | memoryview) -> bytes:
        """Transform the bytes of the stage before."""

    @abstractmethod
    def decode(self, buf: memoryview, expected_size: int) -> bytes | memoryview:
        """Invert :meth:`encode`, producing exactly ``expected_size`` bytes (refuse before inflating more)."""


class RowCodec(IdCodec):
    """An id codec that codes ``[rows, top_k]`` rows in token or layer order; subclasses code the rows."""

    def __init__(self, order: str = "token"):
        if order not in ("token", "layer"):
            raise RouteFormatError(f"codec order must be 'token' or 'layer', got {order!r}")
        self.order = order

    def _params(self) -> dict[str, Any]:
        return {"order": self.order}

    def encode(self, values: np.ndarray, num_experts: int) -> bytes:
        rows = values.transpose(1, 0, 2) if self.order == "layer" else values
        return self._encode_rows(np.ascontiguousarray(rows).reshape(-1, values.shape[2]), num_experts)

    def decode(self, buf: memoryview, shape: tuple[int, int, int], dtype: np.dtype, num_experts: int) -> np.ndarray:
        T, L, K = shape
        rows = self._decode_rows(buf, T * L, K, dtype, num_experts)
        if self.order == "layer":
            return np.ascontiguousarray(rows.reshape(L, T, K).transpose(1, 0, 2))
        return rows.reshape(T, L, K)

    def encoded_size(self, shape: tuple[int, int, int], dtype: np.dtype, num_experts: int) -> int:
        return self._rows_size(shape[0] * shape[1], shape[2], dtype, num_experts)

    @abstractmethod
    def _rows_size(self, n_rows: int, top_k: int, dtype: np.dtype, num_experts: int) -> int: ...

    @abstractmethod
    def _encode_rows(self, rows: np.ndarray, num_experts: int) -> bytes: ...

    @abstractmethod
    def _decode_rows(
        self, buf: memoryview, n_rows: int, top_k: int, dtype: np.dtype, num_experts: int
    ) -> np.ndarray: ...

    def _check_size(self, buf: memoryview, n_rows: int, top_k: int, dtype: np.dtype, num_experts: int) -> None:
        want = self._rows_size(n_rows, top_k, dtype, num_experts)
        if len(buf) != want:
            raise RouteFormatError(
                f"{self.codec_id} payload holds {len(buf)} bytes but shape [{n_rows} rows, top_k={top_k}] needs {want}"
            )


#: former name of :class:`IdCodec`
IdCoder = IdCodec


class Raw(RowCodec):
    """The compact buffer as it is: one uint8/uint16 per id, little-endian (format versions 1 and 2)."""

    codec_id = "raw"

    def _rows_size(self, n_rows, top_k, dtype, num_experts):
        return n_rows * top_k * np.dtype(dtype).itemsize

    def _encode_rows(self, rows, num_experts):
        return rows.astype(rows.dtype.newbyteorder("<"), copy=False).tobytes()

    def _decode_rows(self, buf, n_rows, top_k, dtype, num_experts):
        self._check_size(buf, n_rows, top_k, dtype, num_experts)
        le = np.dtype(dtype).newbyteorder("<")
        return np.frombuffer(buf, dtype=le).astype(dtype, copy=False).reshape(n_rows, top_k)


def id_bits(num_experts: int) -> int:
    """Bits per expert id: ceil(log2 E), at least 1."""
    return max(1, (num_experts - 1).bit_length())


class BitPack(RowCodec):
    """ceil(log2 E) bits per id, one little-endian bit stream (least significant bit first).

    Layout (format version 2; also version 1 for ids of at most 8 bits): with ``b`` bits per id,
    id number ``i`` (rows in ``order``, ids within a row in their stored order) holds bits
    ``[i*b, (i+1)*b)`` of the stream, its least significant bit first; stream bit ``j`` is bit
    ``j % 8`` of byte ``j // 8``. The last byte is zero-padded; the payload is ``ceil(n*b/8)`` bytes.
    So 16 experts (4 bits) put ids ``1, 2`` in byte ``0x21``, and 65536 experts (16 bits) write each
    id as a little-endian uint16.

    Version 1 buffers with ids wider than 8 bits (E > 256) are ambiguous: the first writer
    (r3lab cf15985) used :class:`BitPackPlanesV1`'s layout, later ones this layout, both under the
    same version and config. The container refuses them unless told which (``legacy_bitpack=``).
    """

    codec_id = "bitpack"

    def _rows_size(self, n_rows, top_k, dtype, num_experts):
        return -(-n_rows * top_k * id_bits(num_experts) // 8)

    def _encode_rows(self, rows, num_experts):
        return pack_ids(rows, id_bits(num_experts))

    def _decode_rows(self, buf, n_rows, top_k, dtype, num_experts):
        self._check_size(buf, n_rows, top_k, dtype, num_experts)
        return unpack_ids(buf, n_rows * top_k, id_bits(num_experts), dtype).reshape(n_rows, top_k)


def _unpack_small_v1(buf: memoryview | bytes, n: int, b: int) -> np.ndarray:
    """cf15985's reader of ``n`` values of ``b <= 8`` bits packed LSB first (a plain bit stream)."""
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
    """Read-only: ``bitpack`` as the first writer (r3lab cf15985, format version 1) laid out ids wider than 8 bits.

    Two planes, for ``n`` ids of ``b`` bits (8 < b <= 16): first the low byte of every id (``n``
    bytes), then the high ``b - 8`` bits of every id as one LSB-first bit stream of
    ``ceil(n*(b-8)/8)`` bytes. The total equals :class:`BitPack`'s ``ceil(n*b/8)``, so the length
    cannot tell the two apart. Ids of at most 8 bits were one bit stream, as in :class:`BitPack`.
    Never registered and never written; the container uses it for ``legacy_bitpack="planes"``.
    """

    def _encode_rows(self, rows, num_experts):
        raise RouteFormatError("the format version 1 planes layout of bitpack is read-only; encode writes version 2")

    def _decode_rows(self, buf, n_rows, top_k, dtype, num_experts):
        self._check_size(buf, n_rows, top_k, dtype, num_experts)
        n, b = n_rows * top_k, id_bits(num_experts)
        if b <= 8:
            return super()._decode_rows(buf, n_rows, top_k, dtype, num_experts)
        lo = np.frombuffer(buf[:n], dtype=np.uint8).astype(np.uint16)
        flat = lo | (_unpack_small_v1(buf[n:], n, b - 8) << np.uint16(8))
        return flat.astype(dtype, copy=False).reshape(n_rows, top_k)


@lru_cache(maxsize=64)
def _binomial_table(num_experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """C(c, i) for c in [0, E], i in [0, k] as little-endian 64-bit limbs, a float64 copy, limbs W, and bits."""
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


def _limbs_le(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """Elementwise a <= b for multi-limb unsigned numbers (lists of limb arrays, least significant first)."""
    lt = np.zeros(a[0].shape, dtype=bool)
    eq = np.ones(a[0].shape, dtype=bool)
    for w in range(len(a) - 1, -1, -1):
        lt |= eq & (a[w] < b[w])
        eq &= a[w] == b[w]
    return lt | eq


def _limbs_add(acc: list[np.ndarray], t: list[np.ndarray]) -> None:
    carry = np.zeros(acc[0].shape, dtype=np.uint64)
    for w in range(len(acc)):
        s1 = acc[w] + t[w]
        c1 = s1 < acc[w]
        s2 = s1 + carry
        carry = (c1 | (s2 < s1)).astype(np.uint64)
        acc[w] = s2


def _limbs_sub(acc: list[np.ndarray], t: list[np.ndarray]) -> None:
    borrow = np.zeros(acc[0].shape, dtype=np.uint64)
    for w in range(len(acc)):
        d1 = acc[w] - t[w]
        b1 = acc[w] < t[w]
        d2 = d1 - borrow
        borrow = (b1 | (d1 < borrow)).astype(np.uint64)
        acc[w] = d2


def _pack_bits(words: np.ndarray, nbits: int) -> bytes:
    """Pack the low ``nbits`` of each row of little-endian uint64 limbs ``[N, W]`` into one bit stream."""
    if nbits == 0 or words.shape[0] == 0:
        return b""
    bits = np.unpackbits(words.astype("<u8", copy=False).view(np.uint8), axis=1, bitorder="little")[:, :nbits]
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def _unpack_bits(buf: memoryview | bytes, n: int, nbits: int, W: int) -> np.ndarray:
    out = np.zeros((n, 64 * W), dtype=np.uint8)
    if nbits and n:
        bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little", count=n * nbits)
        out[:, :nbits] = bits.reshape(n, nbits)
    return np.packbits(out, axis=1, bitorder="little").view("<u8").astype(np.uint64).reshape(n, W)


class TopKSet(RowCodec):
    """Each top-k row as one number in the combinatorial number system: ceil(log2 C(E, k)) bits per row.

    The row {c_1 < ... < c_k} becomes sum_i C(c_i, i). Replay does not depend on the order inside a
    top-k set, so **decode returns every row sorted ascending**. Numbers wider than 64 bits (e.g.
    512 experts top-22: 128 bits) are held as 64-bit limbs and written at their exact bit width,
    so splitting the number loses no information.

    Layout (format versions 1 and 2): with ``w = bit_length(C(E, k) - 1)`` bits per row, row ``i``'s
    number holds bits ``[i*w, (i+1)*w)`` of one LSB-first bit stream, laid out as in :class:`BitPack`.
    """

    codec_id = "topk-set"
    sorts_rows = True
    checks_rows = True  # a rank below C(E, k) decodes to k distinct ids below E

    def _rows_size(self, n_rows, top_k, dtype, num_experts):
        nbits = _binomial_table(num_experts, top_k)[3]
        return -(-n_rows * nbits // 8)

    def _encode_rows(self, rows, num_experts):
        n, k = rows.shape
        limbs, _, W, nbits = _binomial_table(num_experts, k)
        if W == 1:  # compiled fast path: the number fits one 64-bit word
            return pack_wide(set_ranks(rows, np.ascontiguousarray(limbs[:, :, 0])), nbits) if nbits else b""
        srt = np.sort(rows, axis=1).astype(np.intp)
        acc = [np.zeros(n, dtype=np.uint64) for _ in range(W)]
        for i in range(k):
            t = limbs[srt[:, i], i + 1]
            _limbs_add(acc, [t[:, w] for w in range(W)])
        return _pack_bits(np.stack(acc, axis=1), nbits)

    def _decode_rows(self, buf, n_rows, top_k, dtype, num_experts):
        self._check_size(buf, n_rows, top_k, dtype, num_experts)
        limbs, approx, W, nbits = _binomial_table(num_experts, top_k)
        E, k = num_experts, top_k
        if W == 1:
            ranks = unpack_wide(buf, n_rows, nbits) if nbits else np.zeros(n_rows, dtype=np.uint64)
            out = np.empty((n_rows, k), dtype=dtype)
            bad = unrank_sets(ranks, np.ascontiguousarray(limbs[:, :, 0]), E, k, out)
            if bad >= 0:
                raise RouteFormatError(f"topk-set row {bad} holds a number >= C({E}, {k}); the payload is corrupt")
            return out
        words = _unpack_bits(buf, n_rows, nbits, W)
        rank = [words[:, w].copy() for w in range(W)]
        total = [np.full(n_rows, limbs[E, k, w], dtype=np.uint64) for w in range(W)]
        if n_rows and (_limbs_le(total, rank)).any():
            bad = int(np.argmax(_limbs_le(total, rank)))
            raise RouteFormatError(f"topk-set row {bad} holds a number >= C({E}, {k}); the payload is corrupt")
        out = np.empty((n_rows, k), dtype=np.int64)
        for i in range(k, 0, -1):
            # largest c with C(c, i) <= rank: float guess, then exact correction by one step either way
            rf = sum(rank[w].astype(np.float64) * 2.0 ** (64 * w) for w in range(W))
            c = np.searchsorted(approx[:E, i], rf, side="right") - 1
            c = np.clip(c, i - 1, E - 1)
            for _ in range(4):
                up = np.minimum(c + 1, E - 1)
                step_up = (c + 1 < E) & _limbs_le([limbs[up, i, w] for w in range(W)], rank)
                step_down = ~_limbs_le([limbs[c, i, w] for w in range(W)], rank)
                if not (step_up.any() or step_down.any()):
                    break
                c = c + step_up - step_down
            else:
                raise RouteFormatError(f"topk-set decode did not converge for C(c, {i}); the payload is corrupt")
            _limbs_sub(rank, [limbs[c, i, w] for w in range(W)])
            out[:, i - 1] = c
        return out.astype(dtype)


class TopKGaps(IdCodec):
    """Top-k sets as gaps between sorted, popularity-relabelled ids: a transform for a byte stage (zstd).

    Per layer, experts are relabelled by how often they were chosen (most popular -> 0; the
    ``[L, E]`` relabelling is stored up front), each row is sorted and written as the gaps
    ``c_0, c_1 - c_0 - 1, ...``, slot-major. Skewed popularity turns into many small gaps, which a
    byte stage codes in a few bits. Always layer-major; **decode returns every row sorted**.

    Layout (format versions 1 and 2), every number one little-endian element of the compact dtype:
    ``perm[L, E]`` (``perm[j, r]`` is the expert with rank ``r`` in layer ``j``), then
    ``gaps[L, K, T]``.
    """

    codec_id = "topk-gaps"
    sorts_rows = True

    def __init__(self, order: str = "layer"):
        if order != "layer":
            raise RouteFormatError(f"topk-gaps is always layer-major, got order={order!r}")
        self.order = order

    def _params(self) -> dict[str, Any]:
        return {"order": self.order}

    def encoded_size(self, shape, dtype, num_experts):
        T, L, K = shape
        return (L * num_experts + T * L * K) * np.dtype(dtype).itemsize

    def encode(self, values, num_experts):
        T, L, K = values.shape
        dt = values.dtype
        perms = np.empty((L, num_experts), dtype=dt)
        gaps = np.empty((L, K, T), dtype=dt)
        for j in range(L):
            counts = np.bincount(values[:, j].reshape(-1), minlength=num_experts)
            order = np.argsort(-counts, kind="stable")  # new label -> expert
            relabel = np.empty(num_experts, dtype=np.int64)
            relabel[order] = np.arange(num_experts)
            srt = np.sort(relabel[values[:, j]], axis=1)
            g = np.diff(srt, axis=1, prepend=-1) - 1
            perms[j] = order
            gaps[j] = g.T
        le = dt.newbyteorder("<")
        return perms.astype(le, copy=False).tobytes() + gaps.astype(le, copy=False).tobytes()

    def decode(self, buf, shape, dtype, num_experts):
        T, L, K = shape
        dt = np.dtype(dtype)
        want = self.encoded_size(shape, dt, num_experts)
        if len(buf) != want:
            raise RouteFormatError(f"topk-gaps payload holds {len(buf)} bytes but shape {list(shape)} needs {want}")
        flat = np.frombuffer(buf, dtype=dt.newbyteorder("<"))
        perms = flat[: L * num_experts].reshape(L, num_experts).astype(np.int64)
        gaps = flat[L * num_experts :].reshape(L, K, T).astype(np.int64)
        out = np.empty((T, L, K), dtype=dt)
        for j in range(L):
            if (
                perms[j].max(initial=0) >= num_experts
                or np.bincount(perms[j], minlength=num_experts).max(initial=1) != 1
            ):
                raise RouteFormatError(
                    f"topk-gaps: the relabelling of layer {j} is not a permutation of {num_experts} experts"
                )
            ids = np.cumsum(gaps[j] + 1, axis=0) - 1  # [K, T], strictly increasing along K
            if ids.size and ids[-1].max() >= num_experts:
                raise RouteFormatError(f"topk-gaps: expert id out of range [0, {num_experts}) in layer {j}")
            out[:, j] = np.sort(perms[j][ids.T], axis=1)
        return out


#: former name of :class:`TopKGaps`
SetGaps = TopKGaps


class Zstd(ByteCodec):
    """Zstandard over the bytes of the stage before it; pays where expert popularity is skewed."""

    codec_id = "zstd"

    def __init__(self, level: int = 3):
        if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22:
            raise RouteFormatError(f"zstd level must be an integer in [-7, 22], got {level!r}")
        self.level = level

    def _params(self):
        return {"level": self.level}

    def encode(self, data: bytes | memoryview) -> bytes:
        return zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(data)

    def decode(self, buf: memoryview, expected_size: int) -> memoryview:
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


#: the codec registry, id -> class (numcodecs' ``codec_registry``); extend it with :func:`register_codec`
CODECS: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec], *, replace: bool = False) -> type[Codec]:
    """Make ``cls`` buildable from its config (and usable by name in encode/decode); returns ``cls``.

    ``cls`` must subclass :class:`IdCodec` or :class:`ByteCodec` and set a ``codec_id`` string
    without ``+`` (which joins pipeline names). Another class already registered under that id
    is replaced only with ``replace=True``. Usable as a class decorator.
    """
    if not (isinstance(cls, type) and issubclass(cls, (IdCodec, ByteCodec))):
        raise TypeError(f"register_codec expects a subclass of IdCodec or ByteCodec, got {cls!r}")
    cid = cls.__dict__.get("codec_id")
    if not isinstance(cid, str) or not cid or "+" in cid or cid != cid.strip():
        raise ValueError(f"{cls.__name__} must define its own codec_id: a non-empty string without '+', got {cid!r}")
    held = CODECS.get(cid)
    if held is not None and held is not cls and not replace:
        raise ValueError(f"codec id {cid!r} is already registered to {held.__module__}.{held.__qualname__}")
    CODECS[cid] = cls
    return cls


#: short names accepted by ``encode(..., codec=...)``; ``+zstd`` variants write layer-major rows
ALIASES: dict[str, list[dict[str, Any]]] = {
    "raw": [{"id": "raw", "order": "token"}],
    "bitpack": [{"id": "bitpack", "order": "token"}],
    "topk-set": [{"id": "topk-set", "order": "token"}],
    "raw+zstd": [{"id": "raw", "order": "layer"}, {"id": "zstd", "level": 3}],
    "bitpack+zstd": [{"id": "bitpack", "order": "layer"}, {"id": "zstd", "level": 3}],
    "topk-set+zstd": [{"id": "topk-set", "order": "layer"}, {"id": "zstd", "level": 3}],
    "topk-gaps+zstd": [{"id": "topk-gaps", "order": "layer"}, {"id": "zstd", "level": 3}],
}

for _cls in (Raw, BitPack, TopKSet, TopKGaps, Zstd):
    register_codec(_cls)


def get_codec(config: dict[str, Any] | str | Codec) -> Codec:
    """Build a codec from its JSON config ``{"id": ..., **params}``, or from a registered id with default params."""
    if isinstance(config, Codec):
        return config
    if isinstance(config, str):
        config = {"id": config}
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise RouteFormatError(f"codec config must be a dict with a string 'id', got {config!r}")
    cls = CODECS.get(config["id"])
    if cls is None:
        raise RouteFormatError(f"unknown codec {config['id']!r}; known: {sorted(CODECS)}")
    return cls.from_config(config)


def parse_pipeline(spec: Any) -> tuple[IdCodec, list[ByteCodec]]:
    """An id codec followed by at most one byte codec.

    ``spec`` is an alias of :data:`ALIASES`, a registered codec id, ids joined by ``+`` (e.g.
    ``"mycodec+zstd"``), a codec object, or a list of codec objects/configs.
    """
    if isinstance(spec, str):
        if spec in ALIASES:
            spec = ALIASES[spec]
        else:
            names = spec.split("+")
            unknown = [n for n in names if n not in CODECS]
            if unknown:
                raise RouteFormatError(
                    f"unknown codec {spec!r}; known: aliases {sorted(ALIASES)} and registered ids {sorted(CODECS)}"
                )
            spec = names
    if isinstance(spec, Codec):
        spec = [spec]
    if not isinstance(spec, (list, tuple)) or not spec:
        raise RouteFormatError(f"codec pipeline must be a non-empty list, got {spec!r}")
    stages = [get_codec(s) for s in spec]
    first, rest = stages[0], stages[1:]
    if not isinstance(first, IdCodec):
        raise RouteFormatError(
            f"a pipeline starts with an id codec (raw, bitpack, topk-set, topk-gaps, ...), not {first.codec_id!r}"
        )
    if len(rest) > 1:
        raise RouteFormatError(f"at most one byte stage may follow the id codec, got {[s.codec_id for s in rest]}")
    for s in rest:
        if not isinstance(s, ByteCodec):
            raise RouteFormatError(f"stage {s.codec_id!r} cannot follow an id codec; only byte codecs can")
    return first, rest
