"""On the driver: slice the batch by the plan, encode one chunk each, put them with a backend."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from r3lab.errors import SlicingError
from r3lab.routes import Routes
from r3lab.slicing import gather
from r3lab.staging.backend import Backend
from r3lab.staging.frame import encode_chunk
from r3lab.staging.plan import StagingError, StagingPlan


@dataclasses.dataclass
class StageStats:
    """What :func:`stage` did: chunks put, compact bytes sliced, encoded bytes put, seconds per phase."""

    chunks: int = 0
    compact_bytes: int = 0
    bytes_put: int = 0
    slice_s: float = 0.0
    encode_s: float = 0.0
    put_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class StagedBatch:
    """The handle ranks receive from: the plan, a reference per chunk, the backend and the coordinator.
    Picklable with :class:`~r3lab.staging.RayBackend` (send it to Ray actors); on torch.distributed each
    rank gets its own from :meth:`~r3lab.staging.TorchDistBackend.attach`."""

    stage_id: str
    plan: StagingPlan
    refs: dict[str, Any]
    backend: Backend
    coordinator: Any
    layer_ids: tuple[int, ...]

    def release(self) -> None:
        """Forget this batch: its chunks (local: at once; Ray: once no rank holds them) and its tally."""
        self.backend.release(self.stage_id, list(self.refs.values()))


def _gather(routes: Routes, seq_ids: Sequence[int], layer_ids: Sequence[int]) -> Routes:
    """The sequences ``seq_ids`` (in that order) and layers ``layer_ids``; reads only their rows (memory maps)."""
    try:
        return gather(routes, seq_ids, layer_ids)
    except SlicingError as e:
        raise StagingError(str(e)) from e


def stage(
    routes: Routes, plan: StagingPlan, backend: Backend, *, codec: Any = "raw", stage_id: str | None = None
) -> tuple[StagedBatch, StageStats]:
    """On the driver: slice ``routes`` by ``plan``, encode one chunk per (DP rank[, stage], mini-batch), put each.

    ``routes`` may be memory-mapped: only one chunk's rows are in memory at a time (with backends that
    keep the bytes, not the share). Returns the handle to pass to the ranks and the timings (slice,
    encode and put reported separately; a backend that pushes chunks, torch.distributed, starts its
    sends in ``open``, counted in ``put_s``).
    """
    if not isinstance(routes, Routes):
        raise StagingError(f"stage needs r3lab Routes, got {type(routes).__name__}")
    if len(routes) != plan.num_seqs:
        raise StagingError(f"the plan is for {plan.num_seqs} sequences, the routes have {len(routes)}")
    sid = stage_id or uuid.uuid4().hex[:12]
    stats, refs = StageStats(), {}
    for spec in tqdm(plan.chunks(), desc="staging routes", unit="chunk", leave=False, disable=None):
        t0 = time.perf_counter()
        share = _gather(routes, spec.seq_ids, plan.layer_ids(routes.layer_ids, spec.pp_rank))
        t1 = time.perf_counter()
        buf = encode_chunk(share, spec, sid, codec)
        t2 = time.perf_counter()
        refs[spec.name] = backend.put(f"{sid}/{spec.name}", buf)
        t3 = time.perf_counter()
        stats.chunks += 1
        stats.compact_bytes += share.values.nbytes
        stats.bytes_put += len(buf)
        stats.slice_s += t1 - t0
        stats.encode_s += t2 - t1
        stats.put_s += t3 - t2
        del share, buf
    layer_ids = tuple(map(int, routes.layer_ids))
    t0 = time.perf_counter()
    coord = backend.open(sid, plan, refs, layer_ids)
    stats.put_s += time.perf_counter() - t0
    return StagedBatch(sid, plan, refs, backend, coord, layer_ids), stats
