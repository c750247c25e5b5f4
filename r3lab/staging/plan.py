"""The staging plan: which sequences each chunk holds, and the trainer ranks that read them."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from r3lab.errors import SlicingError, StagingError
from r3lab.slicing import ParallelLayout, dp_sequence_ids


@dataclasses.dataclass(frozen=True, order=True)
class RankCoords:
    """A trainer rank's coordinates in a :class:`~r3lab.slicing.ParallelLayout`."""

    dp: int
    pp: int = 0
    cp: int = 0
    tp: int = 0

    def __str__(self) -> str:
        return f"rank (dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp})"


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """One staged object: the global sequence ids (micro-batch order) of a DP rank in a mini-batch."""

    dp_rank: int
    mini_batch: int
    pp_rank: int | None
    seq_ids: tuple[int, ...]

    @property
    def name(self) -> str:
        stage = "" if self.pp_rank is None else f"/pp{self.pp_rank}"
        return f"dp{self.dp_rank}{stage}/mb{self.mini_batch}"


@dataclasses.dataclass(frozen=True)
class StagingPlan:
    """Which sequences each chunk holds: the layout, the mini-batches (global sequence ids each), and
    whether chunks are split per pipeline stage. Validated on construction; build one with :meth:`build`."""

    layout: ParallelLayout
    num_seqs: int
    mini_batches: tuple[tuple[int, ...], ...]
    split_stages: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.layout, ParallelLayout):
            raise StagingError(f"layout must be a ParallelLayout, got {type(self.layout).__name__}")
        seen: set[int] = set()
        for m, ids in enumerate(self.mini_batches):
            if not ids:
                raise StagingError(f"mini-batch {m} is empty")
            bad = [i for i in ids if not 0 <= i < self.num_seqs]
            if bad:
                raise StagingError(f"mini-batch {m} names sequences {bad[:5]} outside [0, {self.num_seqs})")
            dup = seen.intersection(ids) or (len(set(ids)) != len(ids))
            if dup:
                raise StagingError(f"mini-batch {m} repeats a sequence (each sequence belongs to one chunk)")
            seen.update(ids)
            try:
                dp_sequence_ids(len(ids), self.layout, 0)
            except SlicingError as e:
                raise StagingError(f"mini-batch {m} of {len(ids)} sequences does not fit the layout: {e}") from e

    @classmethod
    def build(
        cls,
        num_seqs: int,
        layout: ParallelLayout,
        *,
        mini_batches: int | Sequence[Sequence[int]] = 1,
        split_stages: bool = False,
    ) -> StagingPlan:
        """A plan over ``num_seqs`` sequences: ``mini_batches`` equal consecutive blocks, or explicit id lists."""
        if isinstance(mini_batches, (int, np.integer)) and not isinstance(mini_batches, bool):
            if mini_batches < 1 or num_seqs % mini_batches:
                raise StagingError(f"{num_seqs} sequences do not split into {mini_batches} equal mini-batches")
            per = num_seqs // int(mini_batches)
            mbs = tuple(tuple(range(m * per, (m + 1) * per)) for m in range(int(mini_batches)))
        else:
            mbs = tuple(tuple(int(i) for i in ids) for ids in mini_batches)
        return cls(layout, int(num_seqs), mbs, bool(split_stages))

    def ranks(self) -> list[RankCoords]:
        """Every rank of the layout (the coordinator waits for all of them)."""
        L = self.layout
        return [
            RankCoords(d, p, c, t)
            for d, p, c, t in itertools.product(range(L.dp), range(L.pp), range(L.cp), range(L.tp))
        ]

    def chunk(self, dp_rank: int, mini_batch: int, pp_rank: int | None = None) -> ChunkSpec:
        """The chunk DP rank ``dp_rank`` (and, with ``split_stages``, pipeline rank ``pp_rank``) reads."""
        if not 0 <= mini_batch < len(self.mini_batches):
            raise StagingError(f"mini_batch={mini_batch} out of range [0, {len(self.mini_batches)})")
        ids = np.asarray(self.mini_batches[mini_batch], dtype=np.int64)
        local = np.concatenate(dp_sequence_ids(ids.size, self.layout, dp_rank))
        return ChunkSpec(dp_rank, mini_batch, pp_rank if self.split_stages else None, tuple(ids[local].tolist()))

    def chunks(self) -> list[ChunkSpec]:
        """Every chunk the driver puts."""
        stages = range(self.layout.pp) if self.split_stages else [None]
        return [
            self.chunk(d, m, p) for m in range(len(self.mini_batches)) for d in range(self.layout.dp) for p in stages
        ]

    def chunk_for(self, rank: RankCoords, mini_batch: int) -> ChunkSpec:
        return self.chunk(rank.dp, mini_batch, rank.pp)

    def layer_ids(self, routes_layer_ids: Sequence[int], pp_rank: int | None) -> list[int]:
        """Global layer ids a chunk carries: all the routes' layers, or the stage's routers with ``split_stages``."""
        return list(map(int, routes_layer_ids)) if pp_rank is None else self.layout.router_layer_ids(pp_rank)

    def to_dict(self) -> dict:
        """JSON-ready form (the torch.distributed backend publishes it to the ranks); :meth:`from_dict` inverts it."""
        return {
            "layout": dataclasses.asdict(self.layout),
            "num_seqs": self.num_seqs,
            "mini_batches": [list(ids) for ids in self.mini_batches],
            "split_stages": self.split_stages,
        }

    @classmethod
    def from_dict(cls, d: dict) -> StagingPlan:
        """The plan :meth:`to_dict` wrote; raises :class:`StagingError` naming what is malformed."""
        try:
            lay = dict(d["layout"])
            if lay.get("moe_layer_ids") is not None:
                lay["moe_layer_ids"] = tuple(lay["moe_layer_ids"])
            layout = ParallelLayout(**lay)
            mbs = tuple(tuple(int(i) for i in ids) for ids in d["mini_batches"])
            return cls(layout, int(d["num_seqs"]), mbs, bool(d["split_stages"]))
        except StagingError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise StagingError(f"malformed staging plan: {type(e).__name__}: {e}") from e
