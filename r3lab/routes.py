"""Routes: the expert ids a set of sequences was routed to, packed without padding.

One ``[total_tokens, num_layers, top_k]`` array in the compact dtype holds every sequence back to
back; ``cu_seqlens`` marks where each starts (the packed-ragged layout of varlen attention), and
``layer_ids`` names the global layer number of each entry of the layer axis, so dense layers can be
absent without shifting any MoE layer. ``weights`` (optional, float32, the same shape as ``values``) holds the
routing weight the router gave each chosen expert (what the engine's MoE block multiplied that expert's output
by), for replaying the engine's weights beside its ids (R3W). This module knows no codec, engine or trainer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from r3lab.errors import RouteFormatError

__all__ = ["Routes", "compact_dtype", "check_cu_seqlens", "check_distinct_rows", "check_weights", "SENTINEL"]

SENTINEL = -1
"""What producers write in every slot of a route row they did not capture (tunix #2046, NeMo-RL #3113): such a row
means "no route here", never an expert id (a cast to uint8 would make it expert 255). Readers of the wire
(:mod:`r3lab.compaction`) and importers (:mod:`r3lab.importers`) keep it signed and leave the row out."""


def compact_dtype(num_experts: int) -> np.dtype:
    """Smallest unsigned dtype that holds ids in ``[0, num_experts)``: uint8 up to 256, uint16 up to 65536.

    Unsigned on purpose: models with 384 and 512 routed experts exist, and int8/int16 would wrap.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
        raise RouteFormatError(f"num_experts must be an integer, got {num_experts!r}")
    if num_experts < 1:
        raise RouteFormatError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    raise RouteFormatError(f"num_experts={num_experts} exceeds 65536; no compact dtype holds its ids")


def check_cu_seqlens(cu_seqlens: Any, total_tokens: int) -> np.ndarray:
    """Validate cumulative sequence offsets and return them as a read-only int64 array."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1:
        raise RouteFormatError(f"cu_seqlens must be 1-D with at least one entry, got shape {cu.shape}")
    if cu.dtype.kind not in "iu":
        raise RouteFormatError(f"cu_seqlens must hold integers, got dtype {cu.dtype}")
    cu = cu.astype(np.int64, copy=True)
    if cu[0] != 0:
        raise RouteFormatError(f"cu_seqlens must start at 0, starts at {cu[0]}")
    if cu.size > 1 and np.any(np.diff(cu) < 0):
        bad = int(np.argmax(np.diff(cu) < 0))
        raise RouteFormatError(
            f"cu_seqlens not monotone: cu_seqlens[{bad}]={cu[bad]} > cu_seqlens[{bad + 1}]={cu[bad + 1]}"
        )
    if cu[-1] != total_tokens:
        raise RouteFormatError(f"cu_seqlens ends at {cu[-1]} but there are {total_tokens} token rows")
    cu.setflags(write=False)
    return cu


def check_distinct_rows(rows: np.ndarray) -> None:
    """Raise if any top-k row (last axis) repeats an expert id; duplicates break MoE dispatch."""
    if rows.shape[-1] < 2 or rows.size == 0:
        return
    k = rows.shape[-1]
    flat = rows.reshape(-1, k)
    if k <= 16:  # k(k-1)/2 contiguous comparisons beat a per-row sort for the usual top-k
        cols = np.ascontiguousarray(flat.T)
        dup = np.zeros(flat.shape[0], dtype=bool)
        for i in range(k - 1):
            for j in range(i + 1, k):
                dup |= cols[i] == cols[j]
    else:
        srt = np.sort(flat, axis=1)
        dup = np.any(srt[:, 1:] == srt[:, :-1], axis=1)
    if dup.any():
        i = int(np.argmax(dup))
        raise RouteFormatError(f"repeated expert id inside a top-k row: row {i} is {flat[i].tolist()}")


def check_weights(weights: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Validate routing weights for ids of ``shape``: floats, the same shape, finite; a frozen float32 copy."""
    w = np.asarray(weights)
    if w.dtype.kind != "f" and not (w.size == 0 and w.dtype.kind in "iu"):
        raise RouteFormatError(f"routing weights must be floats, got dtype {w.dtype}")
    if w.shape != tuple(shape):
        raise RouteFormatError(f"routing weights have shape {w.shape}, the ids {tuple(shape)}")
    w = np.array(w, dtype=np.float32, order="C")
    if w.size and not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0].tolist()
        raise RouteFormatError(f"routing weight at [token, layer, k]={bad} is not finite ({w[tuple(bad)]})")
    w.setflags(write=False)
    return w


def _as_layer_ids(layer_ids: Any, num_layers: int) -> np.ndarray:
    if layer_ids is None:
        ids = np.arange(num_layers, dtype=np.int64)
    else:
        raw = np.asarray(layer_ids)
        if raw.ndim != 1:
            raise RouteFormatError(f"layer_ids must be 1-D, got shape {raw.shape}")
        if raw.size and raw.dtype.kind not in "iu":
            raise RouteFormatError(f"layer_ids must be integers, got dtype {raw.dtype}")
        ids = raw.astype(np.int64)
        if ids.size != num_layers:
            raise RouteFormatError(f"{ids.size} layer_ids for a layer axis of size {num_layers}")
        if ids.size and ids.min() < 0:
            raise RouteFormatError(f"layer_ids must be >= 0, got {ids.tolist()}")
        if ids.size > 1 and np.any(np.diff(ids) <= 0):
            raise RouteFormatError(f"layer_ids must be strictly increasing, got {ids.tolist()}")
    ids.setflags(write=False)
    return ids


class Routes:
    """Routed expert ids of a batch of sequences, packed: ``values[cu_seqlens[i]:cu_seqlens[i+1]]`` is sequence i.

    ``values`` is ``[total_tokens, num_layers, top_k]`` and is stored in :func:`compact_dtype`; every id
    lies in ``[0, num_experts)`` and no row repeats an id. Construction validates all of it and raises
    :class:`~r3lab.errors.RouteFormatError` naming the problem. Instances are immutable.

    ``weights`` (optional): float32 ``[total_tokens, num_layers, top_k]``, the router's weight for each id
    (``weights[t, l, j]`` goes with ``values[t, l, j]``); every view below carries them along with the ids.
    """

    __slots__ = ("values", "cu_seqlens", "num_experts", "layer_ids", "weights")
    __hash__ = None  # type: ignore[assignment]

    values: np.ndarray
    cu_seqlens: np.ndarray
    num_experts: int
    layer_ids: np.ndarray
    weights: np.ndarray | None

    def __init__(self, values: Any, cu_seqlens: Any, num_experts: int, layer_ids: Any = None, *, validate: bool = True,
                 weights: Any = None):
        dtype = compact_dtype(num_experts)
        arr = np.asarray(values)
        if arr.ndim != 3:
            raise RouteFormatError(f"values must be [total_tokens, num_layers, top_k], got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise RouteFormatError(f"values must hold integers, got dtype {arr.dtype}")
        if arr.shape[2] < 1:
            raise RouteFormatError("top_k must be >= 1")
        if arr.shape[2] > num_experts:
            raise RouteFormatError(f"top_k={arr.shape[2]} exceeds num_experts={num_experts}")
        if validate and arr.size:
            lo, hi = arr.min(), arr.max()
            if lo < 0 or hi >= num_experts:
                bad = lo if lo < 0 else hi
                raise RouteFormatError(f"expert id {int(bad)} out of range [0, {num_experts})")
        if arr.dtype != dtype:
            arr = arr.astype(dtype)
        elif arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, dtype=dtype, order="C")  # own a frozen copy; callers may mutate theirs
        if validate:
            check_distinct_rows(arr)
        arr.setflags(write=False)
        object.__setattr__(self, "values", arr)
        object.__setattr__(self, "cu_seqlens", check_cu_seqlens(cu_seqlens, arr.shape[0]))
        object.__setattr__(self, "num_experts", int(num_experts))
        object.__setattr__(self, "layer_ids", _as_layer_ids(layer_ids, arr.shape[1]))
        object.__setattr__(self, "weights", None if weights is None else check_weights(weights, arr.shape))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Routes is immutable")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle through the constructor (Ray's object store carries an engine actor's routes to the driver):
        pickle's default sets the slots one by one, which an immutable instance refuses. The ids were checked when
        these routes were built; shapes, offsets, layer ids and weights are checked again on load."""
        return (_unpickle_routes, (self.values, self.cu_seqlens, self.num_experts, self.layer_ids, self.weights))

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def from_padded(
        cls,
        array: Any,
        lengths: Sequence[int] | np.ndarray,
        *,
        num_experts: int,
        left_padded: bool = False,
        layer_ids: Any = None,
    ) -> Routes:
        """Pack a padded ``[B, S, L, K]`` array; ``lengths[b]`` valid rows per sequence, padding dropped."""
        arr = np.asarray(array)
        if arr.ndim != 4:
            raise RouteFormatError(f"padded routes must be [B, S, L, K], got shape {arr.shape}")
        lens = _as_lengths(lengths)
        if lens.size != arr.shape[0]:
            raise RouteFormatError(f"{lens.size} lengths for a batch of {arr.shape[0]}")
        if lens.size and lens.max() > arr.shape[1]:
            raise RouteFormatError(f"length {int(lens.max())} exceeds the padded length {arr.shape[1]}")
        S = arr.shape[1]
        pos = np.arange(S)
        mask = pos[None, :] >= (S - lens)[:, None] if left_padded else pos[None, :] < lens[:, None]
        cu = np.concatenate([[0], np.cumsum(lens)])
        return cls(arr[mask], cu, num_experts, layer_ids)

    @classmethod
    def from_list(cls, arrays: Iterable[Any], *, num_experts: int, layer_ids: Any = None) -> Routes:
        """Pack a list of per-sequence ``[T_i, L, K]`` arrays (T_i may be 0)."""
        arrs = [np.asarray(a) for a in arrays]
        if not arrs:
            raise RouteFormatError("from_list needs at least one sequence (the layer and top-k shape is unknown)")
        for i, a in enumerate(arrs):
            if a.ndim != 3 or a.shape[1:] != arrs[0].shape[1:]:
                raise RouteFormatError(
                    f"sequence {i} has shape {a.shape}; expected [T, {arrs[0].shape[1]}, {arrs[0].shape[2]}]"
                )
        cu = np.concatenate([[0], np.cumsum([a.shape[0] for a in arrs])])
        return cls(np.concatenate(arrs, axis=0), cu, num_experts, layer_ids)

    @classmethod
    def concat(cls, parts: Sequence[Routes]) -> Routes:
        """Append the sequences of several Routes that share num_experts, layer_ids and top_k."""
        if not parts:
            raise RouteFormatError("concat needs at least one Routes")
        first = parts[0]
        for i, p in enumerate(parts):
            if (
                p.num_experts != first.num_experts
                or not np.array_equal(p.layer_ids, first.layer_ids)
                or p.top_k != first.top_k
            ):
                raise RouteFormatError(
                    f"cannot concat part {i}: num_experts/layer_ids/top_k "
                    f"{p.num_experts}/{p.layer_ids.tolist()}/{p.top_k} "
                    f"differ from {first.num_experts}/{first.layer_ids.tolist()}/{first.top_k}"
                )
        has_w = [p.weights is not None for p in parts]
        if any(has_w) and not all(has_w):
            raise RouteFormatError(f"cannot concat: parts {[i for i, h in enumerate(has_w) if not h]} have no routing "
                                   "weights and the others do (drop them with without_weights() first)")
        offsets = np.cumsum([0] + [p.total_tokens for p in parts[:-1]])
        cu = np.concatenate([[0]] + [p.cu_seqlens[1:] + off for p, off in zip(parts, offsets, strict=False)])
        w = np.concatenate([p.weights for p in parts]) if all(has_w) else None
        return cls(np.concatenate([p.values for p in parts]), cu, first.num_experts, first.layer_ids, validate=False,
                   weights=w)

    # ---- shape --------------------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sequence, int64 ``[num_seqs]``."""
        return np.diff(self.cu_seqlens)

    @property
    def total_tokens(self) -> int:
        return int(self.values.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.values.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.values.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes held: the id buffer (and weights, if any) plus the offsets and layer ids."""
        w = 0 if self.weights is None else self.weights.nbytes
        return int(self.values.nbytes + w + self.cu_seqlens.nbytes + self.layer_ids.nbytes)

    def __len__(self) -> int:
        return int(self.cu_seqlens.size - 1)

    def __repr__(self) -> str:
        return (
            f"Routes(num_seqs={len(self)}, total_tokens={self.total_tokens}, layers={self.layer_ids.tolist()}, "
            f"top_k={self.top_k}, num_experts={self.num_experts}, dtype={self.values.dtype}"
            f"{', weights' if self.weights is not None else ''})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Routes):
            return NotImplemented
        return (
            self.num_experts == other.num_experts
            and np.array_equal(self.layer_ids, other.layer_ids)
            and np.array_equal(self.cu_seqlens, other.cu_seqlens)
            and self.values.shape == other.values.shape
            and np.array_equal(self.values, other.values)
            and (self.weights is None) == (other.weights is None)
            and (self.weights is None or (other.weights is not None and np.array_equal(self.weights, other.weights)))
        )

    # ---- views and reshapes --------------------------------------------------------------------
    def with_weights(self, weights: Any) -> Routes:
        """The same ids with these routing weights (``[total_tokens, num_layers, top_k]`` floats)."""
        return Routes(self.values, self.cu_seqlens, self.num_experts, self.layer_ids, validate=False, weights=weights)

    def without_weights(self) -> Routes:
        """The same ids, no routing weights (ids-only replay and transport)."""
        if self.weights is None:
            return self
        return Routes(self.values, self.cu_seqlens, self.num_experts, self.layer_ids, validate=False)

    def _w(self, index: Any) -> np.ndarray | None:
        return None if self.weights is None else self.weights[index]

    def sequence(self, i: int) -> np.ndarray:
        """The ``[T_i, L, K]`` routes of sequence i (a read-only view)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        i %= n
        return self.values[self.cu_seqlens[i] : self.cu_seqlens[i + 1]]

    def take(self, indices: Sequence[int] | np.ndarray) -> Routes:
        """The sequences at ``indices``, in that order."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"sequence index out of range for {len(self)} sequences: {idx.tolist()}")
        idx %= max(len(self), 1)
        lens = self.lengths[idx]
        starts = self.cu_seqlens[idx]
        rows = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(lens.sum())
        return Routes(
            self.values[rows], np.concatenate([[0], np.cumsum(lens)]), self.num_experts, self.layer_ids, validate=False,
            weights=self._w(rows),
        )

    def split(self, sections: int | Sequence[int]) -> list[Routes]:
        """Split the sequences like ``np.array_split``: n near-equal parts, or at the given sequence indices."""
        bounds = np.array_split(np.arange(len(self)), sections)
        out = []
        for b in bounds:
            lo = int(b[0]) if b.size else 0
            hi = int(b[-1]) + 1 if b.size else 0
            if not b.size:
                out.append(Routes(self.values[:0], [0], self.num_experts, self.layer_ids, validate=False,
                                  weights=self._w(slice(0, 0))))
                continue
            t0, t1 = self.cu_seqlens[lo], self.cu_seqlens[hi]
            out.append(
                Routes(
                    self.values[t0:t1],
                    self.cu_seqlens[lo : hi + 1] - t0,
                    self.num_experts,
                    self.layer_ids,
                    validate=False,
                    weights=self._w(slice(t0, t1)),
                )
            )
        return out

    def select_layers(self, ids: Iterable[int]) -> Routes:
        """Keep the layers with these global ids (in increasing order); unknown ids raise."""
        want = np.asarray(list(ids), dtype=np.int64)
        pos = {int(g): j for j, g in enumerate(self.layer_ids)}
        missing = [int(g) for g in want if int(g) not in pos]
        if missing:
            raise RouteFormatError(f"layers {missing} not in these routes (have {self.layer_ids.tolist()})")
        want = np.unique(want)
        cols = [pos[int(g)] for g in want]
        return Routes(self.values[:, cols, :], self.cu_seqlens, self.num_experts, want, validate=False,
                      weights=self._w((slice(None), cols, slice(None))))

    def sorted_rows(self) -> Routes:
        """The same routes with each top-k row sorted ascending (the canonical form of a route set); weights follow
        their ids."""
        order = np.argsort(self.values, axis=2, kind="stable")
        w = None if self.weights is None else np.take_along_axis(self.weights, order, axis=2)
        return Routes(np.take_along_axis(self.values, order, axis=2), self.cu_seqlens, self.num_experts,
                      self.layer_ids, validate=False, weights=w)

    def to_padded(
        self, max_len: int | None = None, *, left_padded: bool = False, fill: int | None = None
    ) -> np.ndarray:
        """Unpack to ``[B, S, L, K]``; padding rows hold ``arange(top_k)`` (distinct ids) unless ``fill`` is given."""
        lens = self.lengths
        S = int(lens.max()) if max_len is None and lens.size else int(max_len or 0)
        if lens.size and lens.max() > S:
            raise RouteFormatError(f"max_len={S} is shorter than the longest sequence ({int(lens.max())})")
        out = np.empty((len(self), S, self.num_layers, self.top_k), dtype=self.values.dtype)
        out[...] = np.arange(self.top_k, dtype=out.dtype) if fill is None else fill
        pos = np.arange(S)
        mask = pos[None, :] >= (S - lens)[:, None] if left_padded else pos[None, :] < lens[:, None]
        out[mask] = self.values
        return out


def _unpickle_routes(values: Any, cu_seqlens: Any, num_experts: int, layer_ids: Any, weights: Any) -> Routes:
    """:meth:`Routes.__reduce__`'s inverse."""
    return Routes(values, cu_seqlens, num_experts, layer_ids, validate=False, weights=weights)


def _as_lengths(lengths: Any) -> np.ndarray:
    lens = np.asarray(lengths)
    if lens.ndim != 1 or (lens.size and lens.dtype.kind not in "iu"):
        raise RouteFormatError(f"lengths must be a 1-D integer sequence, got {lens!r}")
    lens = lens.astype(np.int64)
    if lens.size and lens.min() < 0:
        raise RouteFormatError(f"lengths must be >= 0, got {lens.tolist()}")
    return lens
