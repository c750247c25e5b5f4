"""Slicing: cut packed :class:`~r3lab.routes.Routes` into what each Megatron trainer rank's routers see.

For one rank ``(dp, pp, cp, tp)`` and one micro-batch, :func:`shard` returns one int64
``[tokens_seen_by_that_router, top_k]`` array per router the rank builds, in construction order,
ready for ``RouterReplay.set_replay_data``. What each parallelism does to a router's token set:

* DP: the global batch of sequences is split across DP ranks (``dp_split``), then into micro-batches.
* Micro-batch form: ``packed`` (THD, B=1): each sequence padded to a multiple of
  :attr:`ParallelLayout.seq_alignment`, concatenated; ``padded`` (BSHD): B sequences right-padded to a
  common length S. Megatron's hidden states are ``[S, B, H]``, so token ``(b, s)`` is row ``s * B + b``.
* CP ``zigzag`` (load balanced): a sequence (packed: each sequence; padded: the S axis) is cut into
  ``2 * cp`` chunks and rank r keeps chunks r and ``2*cp - 1 - r`` (``get_batch_on_this_cp_rank`` and
  Transformer Engine's THD partitioning). ``contiguous``: rank r keeps the r-th of cp equal pieces of
  the (packed) sequence axis.
* TP with sequence parallelism: a contiguous 1/tp slice of the (CP-local) sequence axis. Without
  sequence parallelism every TP rank routes all tokens.
* PP/VPP: a stage (virtual chunk) builds the layers Megatron's offset logic gives it (uneven first and
  last stages included); routers are matched by *global* layer id (0-based, Megatron's
  ``layer_number - 1``), never by position, so leading dense layers shift nothing.
* EP: nothing; ids are global and routing happens before dispatch.

Padding rows hold ``arange(top_k)`` (distinct ids; repeated ids break MoE dispatch). Nothing here
imports torch or megatron.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from r3lab.errors import LayoutError, SlicingError
from r3lab.routes import Routes

__all__ = [
    "ParallelLayout",
    "shard",
    "shard_local",
    "dp_sequence_ids",
    "dp_share",
    "gather",
    "token_rows",
    "padded_cu_seqlens",
    "micro_batch_input_rows",
]

CP_MODES = ("zigzag", "contiguous")
DP_SPLITS = ("contiguous", "strided")


# SlicingError: routes and a layout or rank coordinates do not fit together, or the layout itself is invalid
# (LayoutError is the same type); defined with the library's other errors in r3lab.errors


def _pos_int(name: str, v: Any, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise LayoutError(f"{name} must be an integer, got {v!r}")
    if v < minimum:
        raise LayoutError(f"{name} must be >= {minimum}, got {v}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How a Megatron trainer splits the model and the batch. Validated on construction; immutable.

    ``moe_layer_ids``: 0-based global ids of the decoder layers that have a router (None: all layers).
    Dense and MTP layers are not listed. ``first_stage_layers``/``last_stage_layers``: Megatron's
    ``num_layers_in_first/last_pipeline_stage``. ``vpp``: virtual chunks per pipeline rank (1: none).
    ``micro_batch_size``: sequences per micro-batch (None: a DP rank's whole share is one micro-batch).
    ``seq_length``: padded form only, the fixed S (None: the micro-batch's longest sequence, rounded up
    to :attr:`seq_alignment`). ``extra_alignment``: an extra multiple every padded length must have
    (e.g. FP8). ``dp_split``: ``contiguous`` (DP rank d holds the d-th block of sequences, as
    verl/slime chunk a batch) or ``strided`` (Megatron's pretraining sampler: micro-batch m of rank d is
    sequences ``[(m*dp + d)*mbs, (m*dp + d + 1)*mbs)``).
    """

    num_layers: int
    moe_layer_ids: tuple[int, ...] | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    cp_mode: str = "zigzag"
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    packed: bool = True
    micro_batch_size: int | None = None
    seq_length: int | None = None
    extra_alignment: int = 1
    dp_split: str = "contiguous"

    def __post_init__(self) -> None:
        L = _pos_int("num_layers", self.num_layers)
        for f in ("tp", "pp", "cp", "dp", "ep", "vpp", "extra_alignment"):
            _pos_int(f, getattr(self, f))
        for f in ("sequence_parallel", "packed"):
            if not isinstance(getattr(self, f), bool):
                raise LayoutError(f"{f} must be a bool, got {getattr(self, f)!r}")
        if self.cp_mode not in CP_MODES:
            raise LayoutError(f"cp_mode must be one of {CP_MODES}, got {self.cp_mode!r}")
        if self.dp_split not in DP_SPLITS:
            raise LayoutError(f"dp_split must be one of {DP_SPLITS}, got {self.dp_split!r}")
        ids = tuple(range(L)) if self.moe_layer_ids is None else self.moe_layer_ids
        try:
            ids = tuple(_pos_int("moe_layer_ids[i]", i, 0) for i in ids)
        except TypeError as e:
            raise LayoutError(f"moe_layer_ids must be a sequence of integers, got {self.moe_layer_ids!r}") from e
        if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            raise LayoutError(f"moe_layer_ids must be strictly increasing, got {list(ids)}")
        if ids and ids[-1] >= L:
            raise LayoutError(f"moe_layer_ids {list(ids)} reach beyond num_layers={L}")
        object.__setattr__(self, "moe_layer_ids", ids)
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"vpp={self.vpp} (virtual pipeline chunks) needs pp > 1")
        for f in ("first_stage_layers", "last_stage_layers"):
            v = getattr(self, f)
            if v is not None:
                _pos_int(f, v)
                if self.pp == 1:
                    raise LayoutError(f"{f} needs pp > 1")
                if v % self.vpp:
                    raise LayoutError(f"{f}={v} must be divisible by vpp={self.vpp}")
        if (self.tp * self.cp * self.dp) % self.ep:
            raise LayoutError(f"ep={self.ep} must divide tp*cp*dp={self.tp * self.cp * self.dp}")
        if self.micro_batch_size is not None:
            _pos_int("micro_batch_size", self.micro_batch_size)
        if self.dp_split == "strided" and self.micro_batch_size is None:
            raise LayoutError("dp_split='strided' needs micro_batch_size")
        if self.seq_length is not None:
            if self.packed:
                raise LayoutError("seq_length applies to padded micro-batches only (packed=False)")
            _pos_int("seq_length", self.seq_length)
            if self.seq_length % self.seq_alignment:
                raise LayoutError(
                    f"seq_length={self.seq_length} must be a multiple of seq_alignment={self.seq_alignment}"
                )
        self._check_stages()

    # ---- derived ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def seq_alignment(self) -> int:
        """Multiple every padded sequence length has: tp * 2cp (zigzag, cp > 1), tp * cp (contiguous),
        lcm'd with extra_alignment."""
        base = self.tp * (2 * self.cp if self.cp > 1 and self.cp_mode == "zigzag" else self.cp)
        return math.lcm(base, self.extra_alignment)

    def _stage_count_offset(self, pp_rank: int, vp: int) -> tuple[int, int]:
        """Megatron 0.16's get_num_layers_to_build / get_transformer_layer_offset, without the asserts."""
        L, pp, vpp, first, last = self.num_layers, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers
        if pp == 1:
            return L, 0
        if first is not None or last is not None:
            f, l = first or 0, last or 0
            middle_num, middle_stages = L - f - l, pp - (first is not None) - (last is not None)
            per = middle_num // middle_stages if middle_stages > 0 else 0
            if pp_rank == 0 and first is not None:
                per = first
            if pp_rank == pp - 1 and last is not None:
                per = last
            mid_rank = pp_rank if first is None else pp_rank - 1
            if vpp > 1:
                fc, lc, mc = f // vpp, l // vpp, middle_num // vpp
                total = fc + mc + lc
                step = mc // middle_stages if middle_stages > 0 else 0
                offset = vp * total if pp_rank == 0 else vp * total + fc + mid_rank * step
            else:
                per_mid = middle_num // middle_stages if middle_stages > 0 else 0
                offset = 0 if pp_rank == 0 else mid_rank * per_mid + f
        else:
            per = L // pp
            offset = vp * (L // vpp) + pp_rank * (per // vpp) if vpp > 1 else pp_rank * per
        return per // vpp, offset

    def _check_stages(self) -> None:
        L, pp, vpp = self.num_layers, self.pp, self.vpp
        if pp == 1:
            return
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            if L % pp:
                raise LayoutError(f"num_layers={L} must be divisible by pp={pp} (or give first/last_stage_layers)")
            if (L // pp) % vpp:
                raise LayoutError(f"layers per pipeline rank {L // pp} must be divisible by vpp={vpp}")
        else:
            rest = L - (first or 0) - (last or 0)
            left = pp - (first is not None) - (last is not None)
            if rest < 0 or (left == 0 and rest != 0):
                raise LayoutError(f"first/last_stage_layers={first}/{last} do not fit num_layers={L} with pp={pp}")
            if left and (rest % left or (rest // left) % vpp or rest // left == 0):
                raise LayoutError(
                    f"the {rest} layers left after the first/last stages must split evenly over {left} middle stages, "
                    f"each a positive multiple of vpp={vpp}"
                )
        owned: list[int] = []
        for vp in range(vpp):
            for r in range(pp):
                n, off = self._stage_count_offset(r, vp)
                owned.extend(range(off, off + n))
        if sorted(owned) != list(range(L)):
            raise LayoutError(
                f"stage layout pp={pp} vpp={vpp} first={first} last={last} does not partition {L} layers exactly"
            )

    def stage_layers(self, pp_rank: int, vpp_chunk: int = 0) -> range:
        """0-based global ids of the decoder layers that pipeline rank ``pp_rank`` builds in ``vpp_chunk``."""
        self._check_rank("pp_rank", pp_rank, self.pp)
        self._check_rank("vpp_chunk", vpp_chunk, self.vpp)
        n, off = self._stage_count_offset(pp_rank, vpp_chunk)
        return range(off, off + n)

    def router_layer_ids(self, pp_rank: int, vpp_chunk: int | None = None) -> list[int]:
        """Global ids of the MoE layers this pipeline rank builds, in construction order (chunk by chunk)."""
        chunks = range(self.vpp) if vpp_chunk is None else [vpp_chunk]
        moe = set(self.router_layers)
        return [g for c in chunks for g in self.stage_layers(pp_rank, c) if g in moe]

    @property
    def router_layers(self) -> tuple[int, ...]:
        """The 0-based global ids of the layers with a router (``moe_layer_ids`` resolved: ``None`` is every layer)."""
        return cast(tuple[int, ...], self.moe_layer_ids)  # __post_init__ always stores a tuple

    @staticmethod
    def _check_rank(name: str, v: Any, size: int) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < size:
            raise SlicingError(f"{name}={v!r} out of range [0, {size})")
        return int(v)

    # ---- config round trip ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moe_layer_ids"] = list(self.router_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParallelLayout:
        if not isinstance(d, dict):
            raise LayoutError(f"from_dict needs a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise LayoutError(f"unknown ParallelLayout fields {unknown}")
        if "num_layers" not in d:
            raise LayoutError("ParallelLayout dict lacks num_layers")
        kw = dict(d)
        if kw.get("moe_layer_ids") is not None:
            kw["moe_layer_ids"] = tuple(kw["moe_layer_ids"])
        return cls(**kw)


# ---- data-parallel plan -------------------------------------------------------------------------
def dp_sequence_ids(num_seqs: int, layout: ParallelLayout, dp_rank: int) -> list[np.ndarray]:
    """The index plan of one DP rank: global sequence ids of each of its micro-batches, in order."""
    ParallelLayout._check_rank("dp_rank", dp_rank, layout.dp)
    n, dp, mbs = int(num_seqs), layout.dp, layout.micro_batch_size
    if layout.dp_split == "contiguous":
        if n % dp:
            raise SlicingError(f"{n} sequences do not split evenly over dp={dp}")
        share = np.arange(dp_rank * (n // dp), (dp_rank + 1) * (n // dp), dtype=np.int64)
        if mbs is None:
            return [share]
        return [share[i : i + mbs] for i in range(0, share.size, mbs)] or [share]
    if mbs is None:  # the layout refuses this on construction; checked again for a layout built around it
        raise LayoutError("dp_split='strided' needs micro_batch_size")
    if n % (dp * mbs):
        raise SlicingError(f"dp_split='strided' needs num_seqs divisible by dp*micro_batch_size={dp * mbs}, got {n}")
    return [
        np.arange((m * dp + dp_rank) * mbs, (m * dp + dp_rank + 1) * mbs, dtype=np.int64)
        for m in range(n // (dp * mbs))
    ]


def dp_share(routes: Routes, layout: ParallelLayout, dp_rank: int, *, pp_rank: int | None = None) -> Routes:
    """The sequences of one DP rank, in micro-batch order (what :func:`shard_local` takes).

    With ``pp_rank`` only the layers that pipeline stage builds are kept. Copies just those rows, so a
    memory-mapped global ``routes`` is read only where this rank needs it.
    """
    seqs = np.concatenate(dp_sequence_ids(len(routes), layout, dp_rank))
    return gather(routes, seqs, None if pp_rank is None else layout.router_layer_ids(pp_rank))


def gather(routes: Routes, seq_ids: Sequence[int] | np.ndarray, layer_ids: Sequence[int] | None = None) -> Routes:
    """The sequences ``seq_ids`` (in that order) and the global layers ``layer_ids`` (default: all) as new Routes.

    Copies only those rows, one sequence at a time, so a memory-mapped ``routes`` is read only where needed.
    Raises :class:`SlicingError` if a layer is missing.
    """
    seqs = np.asarray(seq_ids, dtype=np.int64)
    cols = np.arange(routes.num_layers) if layer_ids is None else _layer_columns(routes, layer_ids)
    lens = routes.lengths[seqs]
    out = np.empty((int(lens.sum()), cols.size, routes.top_k), dtype=routes.values.dtype)
    csel = _as_slice(cols)
    o = 0
    for s, n in zip(routes.cu_seqlens[seqs].tolist(), lens.tolist(), strict=True):
        out[o : o + n] = routes.values[s : s + n, csel]
        o += n
    cu = np.concatenate([[0], np.cumsum(lens)])
    out.setflags(write=False)  # Routes copies writeable buffers; this one is ours
    return Routes(out, cu, routes.num_experts, routes.layer_ids[cols], validate=False)


# ---- token order inside one micro-batch --------------------------------------------------------
def padded_cu_seqlens(lengths: Sequence[int] | np.ndarray, layout: ParallelLayout) -> np.ndarray:
    """Packed form: offsets of each sequence after padding it to a multiple of ``seq_alignment``."""
    lens = np.asarray(lengths, dtype=np.int64)
    a = layout.seq_alignment
    return np.concatenate([[0], np.cumsum(-(-lens // a) * a)]).astype(np.int64)


def micro_batch_input_rows(lengths: Sequence[int] | np.ndarray, layout: ParallelLayout) -> np.ndarray:
    """The micro-batch as Megatron's input ``[B, S]`` (before CP and SP): token index or -1 for padding.

    Token indices count the micro-batch's packed tokens (sequence i starts at ``sum(lengths[:i])``).
    Packed: ``B == 1``, sequences padded per :func:`padded_cu_seqlens`. Padded: right padding.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    if layout.packed:
        cu = padded_cu_seqlens(lens, layout)
        rows = np.full(int(cu[-1]), -1, dtype=np.int64)
        for st, c, n in zip(starts.tolist(), cu[:-1].tolist(), lens.tolist(), strict=True):
            rows[c : c + n] = np.arange(st, st + n)
        return rows[None, :]
    pos = np.arange(_padded_len(lens, layout), dtype=np.int64)
    return np.where(pos[None, :] < lens[:, None], starts[:, None] + pos[None, :], -1)


def _padded_len(lens: np.ndarray, layout: ParallelLayout) -> int:
    """Padded form: S, the fixed seq_length or the longest sequence rounded up to seq_alignment."""
    a = layout.seq_alignment
    longest = int(lens.max()) if lens.size else 0
    S = layout.seq_length if layout.seq_length is not None else -(-longest // a) * a
    if longest > S:
        raise SlicingError(f"a sequence of {longest} tokens does not fit seq_length={S}")
    return S


def _cp_ranges(length: int, layout: ParallelLayout, cp_rank: int) -> list[tuple[int, int]]:
    """Positions ``[0, length)`` CP rank ``cp_rank`` keeps, as ordered (start, stop) ranges."""
    cp = layout.cp
    if cp == 1:
        return [(0, length)]
    if layout.cp_mode == "zigzag":
        c = length // (2 * cp)
        return [(cp_rank * c, (cp_rank + 1) * c), ((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)]
    c = length // cp
    return [(cp_rank * c, (cp_rank + 1) * c)]


def _local_ranges(lens: np.ndarray, layout: ParallelLayout, cp_rank: int, tp_rank: int) -> list[tuple[int, int]]:
    """Positions on the (padded) sequence axis a router on this rank sees, in order: CP cut, then the SP slice."""
    if layout.packed:
        cu = padded_cu_seqlens(lens, layout)
        if layout.cp > 1 and layout.cp_mode == "zigzag":  # THD: every sequence is split on its own
            ranges = [
                (c + a, c + b)
                for c, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
                for a, b in _cp_ranges(e - c, layout, cp_rank)
            ]
        else:
            ranges = [(a, b) for a, b in _cp_ranges(int(cu[-1]), layout, cp_rank)]
    else:
        ranges = _cp_ranges(_padded_len(lens, layout), layout, cp_rank)
    if layout.sequence_parallel and layout.tp > 1:
        n = sum(b - a for a, b in ranges) // layout.tp
        lo, hi, out, o = tp_rank * n, (tp_rank + 1) * n, [], 0
        for a, b in ranges:  # keep the window [lo, hi) of the concatenated ranges
            x, y = max(a, a + lo - o), min(b, a + hi - o)
            if x < y:
                out.append((x, y))
            o += b - a
        ranges = out
    return [(a, b) for a, b in ranges if b > a]


def _segments(
    lens: np.ndarray, layout: ParallelLayout, cp_rank: int, tp_rank: int
) -> tuple[int, list[tuple[int, int, int, int, int]]]:
    """The rank's router rows as runs of real tokens: (num_rows, [(out_start, stride, seq, offset, n), ...]).

    Row ``out_start + i * stride`` holds token ``offset + i`` of the micro-batch's sequence ``seq``;
    rows in no run are padding. Nothing proportional to the token count is allocated.
    """
    ParallelLayout._check_rank("cp_rank", cp_rank, layout.cp)
    ParallelLayout._check_rank("tp_rank", tp_rank, layout.tp)
    ranges = _local_ranges(lens, layout, cp_rank, tp_rank)
    segs, o = [], 0
    if layout.packed:
        cu = padded_cu_seqlens(lens, layout).tolist()
        ln = lens.tolist()
        for a, b in ranges:
            q = int(np.searchsorted(cu, a, side="right")) - 1
            while q < len(ln) and cu[q] < b:
                x, y = max(a, cu[q]), min(b, cu[q] + ln[q])
                if x < y:
                    segs.append((o + x - a, 1, q, x - cu[q], y - x))
                q += 1
            o += b - a
        return o, segs
    B = len(lens)
    for a, b in ranges:
        for col, n in enumerate(lens.tolist()):
            if min(b, n) > a:
                segs.append((o * B + col, B, col, a, min(b, n) - a))
        o += b - a
    return o * B, segs


def token_rows(
    lengths: Sequence[int] | np.ndarray, layout: ParallelLayout, *, cp_rank: int = 0, tp_rank: int = 0
) -> np.ndarray:
    """Rows a router on rank ``(cp_rank, tp_rank)`` sees for a micro-batch, in Megatron's order.

    Entry j is the micro-batch token index behind the router's row j, or -1 for a padding row:
    :func:`micro_batch_input_rows` cut by CP, transposed to ``[S, B]``, cut by SP, flattened.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    n_rows, segs = _segments(lens, layout, cp_rank, tp_rank)
    rows = np.full(n_rows, -1, dtype=np.int64)
    for o, st, q, off, n in segs:
        rows[o : o + (n - 1) * st + 1 : st] = np.arange(starts[q] + off, starts[q] + off + n)
    return rows


# ---- shard ------------------------------------------------------------------------------------
def shard(
    routes: Routes,
    layout: ParallelLayout,
    *,
    dp_rank: int,
    pp_rank: int,
    cp_rank: int,
    tp_rank: int,
    vpp_chunk: int | None = None,
    micro_batch: int | None = None,
) -> list[np.ndarray]:
    """Replay data for one rank and micro-batch, from the *global* batch ``routes``.

    One int64 ``[rows, top_k]`` array per router this rank builds (all virtual chunks in order, or only
    ``vpp_chunk``), rows in Megatron's token order (:func:`token_rows`), padding rows ``arange(top_k)``.
    ``micro_batch`` may be omitted when the DP rank's share is a single micro-batch. Only the selected
    sequences are read; see :func:`dp_share` / :func:`shard_local` to stage per-DP-rank shares instead.
    The arrays are C-contiguous views of one buffer (``torch.from_numpy`` each for ``set_replay_data``).
    Raises :class:`SlicingError` on ranks out of range, a missing micro-batch or layers absent from routes.
    """
    plan = dp_sequence_ids(len(routes), layout, dp_rank)
    return _shard_seqs(routes, layout, _pick(plan, micro_batch), pp_rank, cp_rank, tp_rank, vpp_chunk)


def shard_local(
    share: Routes,
    layout: ParallelLayout,
    *,
    pp_rank: int,
    cp_rank: int,
    tp_rank: int,
    vpp_chunk: int | None = None,
    micro_batch: int | None = None,
) -> list[np.ndarray]:
    """Like :func:`shard`, from a DP rank's own share (:func:`dp_share`: its sequences in micro-batch order)."""
    n, mbs = len(share), layout.micro_batch_size
    plan = (
        [np.arange(n, dtype=np.int64)]
        if mbs is None
        else [np.arange(i, min(i + mbs, n), dtype=np.int64) for i in range(0, n, mbs)]
    )
    return _shard_seqs(share, layout, _pick(plan or [np.arange(0)], micro_batch), pp_rank, cp_rank, tp_rank, vpp_chunk)


def _pick(plan: list[np.ndarray], micro_batch: int | None) -> np.ndarray:
    if micro_batch is None:
        if len(plan) != 1:
            raise SlicingError(f"this DP rank has {len(plan)} micro-batches; pass micro_batch=0..{len(plan) - 1}")
        return plan[0]
    return plan[ParallelLayout._check_rank("micro_batch", micro_batch, len(plan))]


def _layer_columns(routes: Routes, layer_ids: Sequence[int]) -> np.ndarray:
    pos = {int(g): j for j, g in enumerate(routes.layer_ids.tolist())}
    missing = [g for g in layer_ids if g not in pos]
    if missing:
        raise SlicingError(
            f"routes lack the global layers {missing} this rank's routers need "
            f"(routes have {routes.layer_ids.tolist()})"
        )
    return np.asarray([pos[g] for g in layer_ids], dtype=np.int64)


def _as_slice(cols: np.ndarray) -> slice | np.ndarray:
    if cols.size and np.all(np.diff(cols) == 1):
        return slice(int(cols[0]), int(cols[-1]) + 1)
    return cols


def _shard_seqs(
    routes: Routes,
    layout: ParallelLayout,
    seqs: Sequence[int] | np.ndarray,
    pp_rank: int,
    cp_rank: int,
    tp_rank: int,
    vpp_chunk: int | None,
) -> list[np.ndarray]:
    if not isinstance(routes, Routes):
        raise SlicingError(f"routes must be r3lab.routes.Routes, got {type(routes).__name__}")
    if not isinstance(layout, ParallelLayout):
        raise SlicingError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
    ParallelLayout._check_rank("pp_rank", pp_rank, layout.pp)
    if vpp_chunk is not None:
        ParallelLayout._check_rank("vpp_chunk", vpp_chunk, layout.vpp)
    layers = layout.router_layer_ids(pp_rank, vpp_chunk)
    cols = _layer_columns(routes, layers)
    seqs = np.asarray(seqs, dtype=np.int64)
    n_rows, segs = _segments(routes.lengths[seqs], layout, cp_rank, tp_rank)
    k = routes.top_k
    buf = np.empty((len(layers), n_rows, k), dtype=np.int64)
    buf[...] = np.arange(k, dtype=np.int64)  # padding rows: k distinct ids
    if len(layers):
        csel = _as_slice(cols)
        starts = routes.cu_seqlens[seqs].tolist()
        vals = routes.values
        for o, st, q, off, n in segs:
            g = starts[q] + off
            buf[:, o : o + (n - 1) * st + 1 : st, :] = vals[g : g + n, csel, :].transpose(1, 0, 2)
    return [buf[j] for j in range(len(layers))]
