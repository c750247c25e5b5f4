"""Staging: routes from the driver to every trainer rank, one encoded chunk per (DP rank, mini-batch), bounded waits.

Why: a process that holds the whole batch's routes is the failure users hit most at scale (slime #2384:
every Megatron rank got the full ``rollout_routed_experts`` and ran out of host memory; SkyRL #1376:
~30 GB through Ray's object store, every worker deserializing everything, ranks skewed by minutes until
NCCL's 600 s timeout tripped). Here the driver slices the batch by the index plan of
:mod:`r3lab.slicing` and puts one r3lab-encoded bytes object per chunk; each rank fetches only its own
chunk, decodes it (zero-copy for the ``raw`` codec on Ray: the routes are a view of the object store's
shared memory) and hands it to :func:`~r3lab.slicing.shard_local`::

    plan = StagingPlan.build(len(routes), layout, mini_batches=2)           # driver
    staged, stats = stage(routes, plan, RayBackend(), codec="raw")          # one object per chunk
    share, rstats = receive(staged, RankCoords(dp=1, pp=0), mini_batch=0, timeout=60)   # on a rank
    arrays = shard_local(share, layout, pp_rank=0, cp_rank=0, tp_rank=0, micro_batch=0)

**Chunks.** Chunk ``(dp_rank, mini_batch)`` holds the sequences DP rank ``dp_rank`` trains on in that
mini-batch, in micro-batch order (exactly :func:`~r3lab.slicing.dp_share` of the mini-batch). Every
PP/CP/TP rank of that DP rank fetches the same chunk, or, with ``split_stages=True``, one chunk per
``(dp_rank, pp_rank, mini_batch)`` holding only the layers that pipeline stage builds.

**Bytes of a chunk** (format version :data:`CHUNK_VERSION`; integers little-endian)::

    0     magic b"R3SC"
    4     chunk format version (u8), 3 reserved zero bytes
    8     header length H (u32)
    12    header: UTF-8 JSON {"stage_id", "dp_rank", "mini_batch", "pp_rank", "seq_ids": [...],
          "num_tokens", "layer_ids": [...]}
    12+H  CRC-32 of bytes [0, 12+H)
    16+H  the routes: an r3lab.compaction container (its own version, header and CRC-32)

No pickled Python objects of routes travel (on Ray the chunk is a uint8 numpy array, stored out of
band). A receiving rank checks both checksums *and* that the chunk is the one it expects (stage id,
DP rank, mini-batch, stage, sequence ids, token count, layer ids), so a mix-up is caught, not trained on.

**All or none.** Every rank's wait has a deadline. Each rank reports to a coordinator (a thread-safe
object locally, a threaded Ray actor on Ray) whether it got a good chunk; :func:`barrier` passes only
when every rank of the layout reported success. If any rank cannot get its chunk in time, gets a
corrupt or wrong one, or never reports, every rank raises the same :class:`StagingError` naming the
rank and chunk, before any rank could enter a collective and hang. A rank returns or raises within
``timeout + grace`` seconds.

**Backends.** :class:`LocalBackend` (a dict in this process, for CPU notebooks and tests; ranks are
threads, or one thread calling :func:`fetch` for every rank, then :func:`barrier`) and
:class:`RayBackend` (Ray's object store; ``ray`` is imported only there). Code written against one
runs unchanged on the other.

**GPU to GPU (documented path, not built here).** On GPU nodes the routes can skip the object store:
the driver-side process that holds them (DP rank 0 of the trainer, or a rollout worker in the trainer's
process group) encodes each chunk as here, sends its length and then the bytes as a ``torch.uint8``
CUDA tensor with ``torch.distributed.send``/``isend`` (NCCL) or ``scatter`` (one chunk per DP group
leader), and each rank decodes with :func:`decode_chunk` on the host (``tensor.cpu().numpy()``) or,
for ``raw``, views the uint8 tensor as ``[T, L, K]`` directly on the device. The same checks apply;
the deadline comes from the process group's timeout (``init_process_group(timeout=...)``), and the
coordinator's all-or-none rule becomes an ``all_reduce`` of a success flag before the first collective
that uses the routes. On CPU the same code runs over gloo.
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
from tqdm.auto import tqdm

from r3lab.compaction import decode, encode
from r3lab.errors import R3LabError, RouteFormatError
from r3lab.routes import Routes
from r3lab.slicing import ParallelLayout, SlicingError, dp_sequence_ids, gather

__all__ = [
    "StagingError",
    "RankCoords",
    "ChunkSpec",
    "StagingPlan",
    "StageStats",
    "ReceiveStats",
    "StagedBatch",
    "Coordinator",
    "LocalBackend",
    "RayBackend",
    "stage",
    "fetch",
    "barrier",
    "receive",
    "encode_chunk",
    "decode_chunk",
    "CHUNK_MAGIC",
    "CHUNK_VERSION",
]

CHUNK_MAGIC = b"R3SC"
#: the chunk frame version :func:`encode_chunk` writes and :func:`decode_chunk` reads
CHUNK_VERSION = 1
_FIXED = struct.Struct("<4sB3xI")
_CRC = struct.Struct("<I")


class StagingError(R3LabError):
    """Staging failed: a rank could not get its chunk in time, got a corrupt or wrong one, or never reported.

    Raised on every rank of the layout with the same message, which names the failing rank and chunk.
    """


# ---- plan ---------------------------------------------------------------------------------------
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


# ---- chunk bytes --------------------------------------------------------------------------------
def _gather(routes: Routes, seq_ids: Sequence[int], layer_ids: Sequence[int]) -> Routes:
    """The sequences ``seq_ids`` (in that order) and layers ``layer_ids``; reads only their rows (memory maps)."""
    try:
        return gather(routes, seq_ids, layer_ids)
    except SlicingError as e:
        raise StagingError(str(e)) from e


def encode_chunk(share: Routes, spec: ChunkSpec, stage_id: str, codec: Any = "raw") -> bytes:
    """The bytes of one chunk: a versioned frame naming the chunk, then ``share`` encoded with an r3lab codec."""
    if len(share) != len(spec.seq_ids):
        raise StagingError(f"chunk {spec.name}: {len(share)} sequences for {len(spec.seq_ids)} sequence ids")
    header = orjson.dumps(
        {
            "stage_id": stage_id,
            "dp_rank": spec.dp_rank,
            "mini_batch": spec.mini_batch,
            "pp_rank": spec.pp_rank,
            "seq_ids": list(spec.seq_ids),
            "num_tokens": share.total_tokens,
            "layer_ids": share.layer_ids.tolist(),
        }
    )
    head = _FIXED.pack(CHUNK_MAGIC, CHUNK_VERSION, len(header)) + header
    return b"".join((head, _CRC.pack(zlib.crc32(head)), encode(share, codec)))


def decode_chunk(buf: Any, spec: ChunkSpec, stage_id: str, *, layer_ids: Sequence[int] | None = None) -> Routes:
    """Check a chunk's frame and identity against ``spec`` and decode its routes (zero-copy for ``raw``).

    Raises :class:`StagingError` naming the chunk and the problem: bad magic, version or checksum, or a
    chunk other than the expected one (stage id, ranks, mini-batch, sequence ids, token count, layers).
    """
    where = f"chunk {spec.name}"
    mv = memoryview(buf)
    mv = mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    if len(mv) < _FIXED.size + _CRC.size:
        raise StagingError(f"{where}: truncated, {len(mv)} bytes")
    magic, version, hlen = _FIXED.unpack_from(mv, 0)
    if magic != CHUNK_MAGIC:
        raise StagingError(f"{where}: bad magic {bytes(magic)!r}, not a staged chunk (expected {CHUNK_MAGIC!r})")
    if version != CHUNK_VERSION:
        raise StagingError(f"{where}: unsupported chunk format version {version}; this r3lab reads {CHUNK_VERSION}")
    end = _FIXED.size + hlen
    if end + _CRC.size > len(mv):
        raise StagingError(f"{where}: truncated, the header runs past the end of {len(mv)} bytes")
    (crc,) = _CRC.unpack_from(mv, end)
    if zlib.crc32(mv[:end]) != crc:
        raise StagingError(f"{where}: checksum mismatch in the chunk header: the chunk was corrupted")
    try:
        h = orjson.loads(mv[_FIXED.size : end])
    except orjson.JSONDecodeError as e:
        raise StagingError(f"{where}: header is not valid JSON: {e}") from e
    got = (h.get("stage_id"), h.get("dp_rank"), h.get("mini_batch"), h.get("pp_rank"))
    want = (stage_id, spec.dp_rank, spec.mini_batch, spec.pp_rank)
    if got != want:
        raise StagingError(f"{where}: got the chunk of (stage_id, dp_rank, mini_batch, pp_rank)={got}, expected {want}")
    if tuple(h.get("seq_ids") or ()) != spec.seq_ids:
        raise StagingError(f"{where}: the chunk holds other sequences than the plan says")
    try:
        share = decode(mv[end + _CRC.size :])
    except RouteFormatError as e:
        raise StagingError(f"{where}: {e}") from e
    if len(share) != len(spec.seq_ids) or share.total_tokens != h.get("num_tokens"):
        raise StagingError(
            f"{where}: {len(share)} sequences / {share.total_tokens} tokens, the header says "
            f"{len(spec.seq_ids)} / {h.get('num_tokens')}"
        )
    if share.layer_ids.tolist() != h.get("layer_ids") or (
        layer_ids is not None and share.layer_ids.tolist() != list(layer_ids)
    ):
        raise StagingError(f"{where}: layers {share.layer_ids.tolist()}, expected {list(layer_ids or h['layer_ids'])}")
    return share


# ---- coordinator: all or none -------------------------------------------------------------------
class Coordinator:
    """The tally of staged batches: per (stage id, mini-batch), each rank reports success or a failure.

    Thread-safe; on Ray it runs as one long-lived threaded actor shared by every staged batch.
    :meth:`wait` returns ``("ok", "")`` once every rank reported success, ``("failed", message)`` as soon
    as any rank reported a failure, and ``("pending", ranks)``, the ranks not heard from, when
    ``timeout`` runs out.
    """

    def __init__(self) -> None:
        self._ranks: dict[str, list[str]] = {}
        self._ok: dict[tuple[str, int], set[str]] = {}
        self._failure: dict[tuple[str, int], str] = {}
        self._cond = threading.Condition()

    def open(self, stage_id: str, ranks: Sequence[str]) -> None:
        with self._cond:
            self._ranks[stage_id] = list(ranks)

    def close(self, stage_id: str) -> None:
        with self._cond:
            self._ranks.pop(stage_id, None)
            for d in (self._ok, self._failure):
                for key in [k for k in d if k[0] == stage_id]:
                    del d[key]

    def report(self, stage_id: str, mini_batch: int, rank: str, failure: str | None = None) -> None:
        with self._cond:
            ok = self._ok.setdefault((stage_id, mini_batch), set())
            if stage_id not in self._ranks:
                failure = f"staging {stage_id}: unknown or released staged batch"
            elif rank not in self._ranks[stage_id]:
                failure = f"staging {stage_id} mini-batch {mini_batch}: unknown {rank} reported"
            elif rank in ok:
                failure = f"staging {stage_id} mini-batch {mini_batch}: {rank} reported twice"
            if failure is not None:
                self._failure.setdefault((stage_id, mini_batch), failure)
            else:
                ok.add(rank)
            self._cond.notify_all()

    def wait(self, stage_id: str, mini_batch: int, timeout: float) -> tuple[str, str | list[str]]:
        deadline = time.monotonic() + max(timeout, 0.0)
        key = (stage_id, mini_batch)
        with self._cond:
            while True:
                if key in self._failure:
                    return "failed", self._failure[key]
                ranks = self._ranks.get(stage_id)
                if ranks is None:
                    return "failed", f"staging {stage_id}: unknown or released staged batch"
                ok = self._ok.get(key, set())
                if len(ok) == len(ranks):
                    return "ok", ""
                left = deadline - time.monotonic()
                if left <= 0:
                    return "pending", [r for r in ranks if r not in ok]
                self._cond.wait(left)


# ---- backends -----------------------------------------------------------------------------------
class LocalBackend:
    """Chunks in a dict of this process; ranks are threads of it. For CPU notebooks and tests."""

    name = "local"

    def __init__(self) -> None:
        self._store: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._coordinator = Coordinator()

    def put(self, key: str, data: bytes) -> str:
        with self._cond:
            self._store[key] = data
            self._cond.notify_all()
        return key

    def get(self, ref: str, timeout: float) -> memoryview:
        with self._cond:
            if not self._cond.wait_for(lambda: ref in self._store, timeout=max(timeout, 0.0)):
                raise TimeoutError(f"not put within {timeout:.1f} s")
            return memoryview(self._store[ref])

    def release(self, stage_id: str, refs: Sequence[str]) -> None:
        with self._cond:
            for r in refs:
                self._store.pop(r, None)
        self._coordinator.close(stage_id)

    def open(self, stage_id: str, ranks: Sequence[str]) -> Coordinator:
        self._coordinator.open(stage_id, ranks)
        return self._coordinator

    def report(
        self, coord: Coordinator, stage_id: str, mb: int, rank: str, failure: str | None, timeout: float
    ) -> None:
        coord.report(stage_id, mb, rank, failure)

    def wait(self, coord: Coordinator, stage_id: str, mb: int, timeout: float) -> tuple[str, Any]:
        return coord.wait(stage_id, mb, timeout)


#: the driver's coordinator actors, by (Ray job id, name)
_RAY_COORDINATORS: dict[tuple[str, str], Any] = {}


class RayBackend:
    """Chunks in Ray's object store as uint8 numpy arrays (out of band: a rank's ``ray.get`` maps shared
    memory, no copy). The coordinator is one named, threaded Ray actor (``coordinator_name``), created on
    first use and shared by every staged batch; ``max_concurrency`` bounds the ranks that can wait in
    :func:`barrier` at once, so it must exceed the world size. Needs ``ray.init()`` first; picklable.
    ``rpc_timeout``: seconds allowed for a report to the coordinator (on top of the ranks' deadline).
    """

    name = "ray"

    def __init__(self, coordinator_name: str = "r3lab-staging", max_concurrency: int = 256, rpc_timeout: float = 30.0):
        self.coordinator_name, self.max_concurrency, self.rpc_timeout = coordinator_name, max_concurrency, rpc_timeout

    @staticmethod
    def _ray():
        try:
            import ray
        except ImportError as e:  # pragma: no cover - ray is in the `ray` extra
            raise StagingError("RayBackend needs Ray: pip install 'r3lab[ray]'") from e
        if not ray.is_initialized():
            raise StagingError("RayBackend needs a running Ray: call ray.init() (or ray.init(address=...)) first")
        return ray

    def put(self, key: str, data: bytes) -> Any:
        return self._ray().put(np.frombuffer(data, dtype=np.uint8))

    def get(self, ref: Any, timeout: float) -> np.ndarray:
        ray = self._ray()
        try:
            return ray.get(ref, timeout=max(timeout, 0.0))
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(f"not in the object store within {timeout:.1f} s") from e

    def open(self, stage_id: str, ranks: Sequence[str]) -> Any:
        """The coordinator actor (created and awaited here, on the driver, so ranks never wait for its start)."""
        ray = self._ray()
        if len(ranks) + 4 > self.max_concurrency:
            raise StagingError(
                f"{len(ranks)} ranks need a coordinator with max_concurrency >= {len(ranks) + 4}, "
                f"this RayBackend has {self.max_concurrency}: pass RayBackend(max_concurrency=...)"
            )
        key = (ray.get_runtime_context().get_job_id(), self.coordinator_name)
        actor = _RAY_COORDINATORS.get(key)
        if actor is None:  # held here for the driver's lifetime: Ray ends an actor once no handle to it is left
            actor = (
                ray.remote(Coordinator)
                .options(
                    name=self.coordinator_name, get_if_exists=True, num_cpus=0, max_concurrency=self.max_concurrency
                )
                .remote()
            )
            _RAY_COORDINATORS[key] = actor
        ray.get(actor.open.remote(stage_id, list(ranks)), timeout=max(self.rpc_timeout, 120.0))
        return actor

    def release(self, stage_id: str, refs: Sequence[Any]) -> None:
        """Forget the stage on the coordinator; Ray frees each chunk once no one holds its reference."""
        ray = self._ray()
        actor = _RAY_COORDINATORS.get((ray.get_runtime_context().get_job_id(), self.coordinator_name))
        if actor is not None:
            ray.get(actor.close.remote(stage_id), timeout=self.rpc_timeout)

    def report(self, coord: Any, stage_id: str, mb: int, rank: str, failure: str | None, timeout: float) -> None:
        self._ray().get(coord.report.remote(stage_id, mb, rank, failure), timeout=self.rpc_timeout)

    def wait(self, coord: Any, stage_id: str, mb: int, timeout: float) -> tuple[str, Any]:
        return tuple(self._ray().get(coord.wait.remote(stage_id, mb, timeout), timeout=timeout + self.rpc_timeout))


# ---- driver and ranks ---------------------------------------------------------------------------
@dataclasses.dataclass
class StageStats:
    """What :func:`stage` did: chunks put, compact bytes sliced, encoded bytes put, seconds per phase."""

    chunks: int = 0
    compact_bytes: int = 0
    bytes_put: int = 0
    slice_s: float = 0.0
    encode_s: float = 0.0
    put_s: float = 0.0


@dataclasses.dataclass
class ReceiveStats:
    """What one rank's :func:`fetch`/:func:`receive` did: its chunk, bytes read, seconds per phase."""

    chunk: str = ""
    bytes_read: int = 0
    wait_s: float = 0.0
    decode_s: float = 0.0
    barrier_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class StagedBatch:
    """The handle ranks receive from: the plan, a reference per chunk, the backend and the coordinator.
    Picklable with :class:`RayBackend` (send it to Ray actors)."""

    stage_id: str
    plan: StagingPlan
    refs: dict[str, Any]
    backend: Any
    coordinator: Any
    layer_ids: tuple[int, ...]

    def release(self) -> None:
        """Forget this batch: its chunks (local: at once; Ray: once no rank holds them) and its tally."""
        self.backend.release(self.stage_id, list(self.refs.values()))


def stage(
    routes: Routes, plan: StagingPlan, backend: Any, *, codec: Any = "raw", stage_id: str | None = None
) -> tuple[StagedBatch, StageStats]:
    """On the driver: slice ``routes`` by ``plan``, encode one chunk per (DP rank[, stage], mini-batch), put each.

    ``routes`` may be memory-mapped: only one chunk's rows are in memory at a time. Returns the handle
    to pass to the ranks and the timings (slice, encode and put reported separately).
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
    coord = backend.open(sid, [str(r) for r in plan.ranks()])
    return StagedBatch(sid, plan, refs, backend, coord, tuple(map(int, routes.layer_ids))), stats


def _reason(e: BaseException) -> str:
    """One line for an error: its type and the last line of its text (Ray's task errors carry tracebacks)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"


def _fail(staged: StagedBatch, rank: RankCoords, mini_batch: int, message: str, timeout: float) -> StagingError:
    """Report a failure for everyone to see, and return the error this rank raises."""
    try:
        staged.backend.report(staged.coordinator, staged.stage_id, mini_batch, str(rank), message, timeout)
    except Exception as e:  # the coordinator is gone: the others time out in barrier() and raise too
        message += f" (and the coordinator could not be told: {type(e).__name__}: {e})"
    return StagingError(message)


def fetch(
    staged: StagedBatch, rank: RankCoords, mini_batch: int = 0, *, timeout: float = 60.0
) -> tuple[Routes, ReceiveStats]:
    """On a rank: get, check and decode this rank's chunk within ``timeout`` s, and report the outcome.

    Does not wait for the other ranks (call :func:`barrier`, or use :func:`receive` for both).
    Returns the rank's DP share for :func:`~r3lab.slicing.shard_local`.
    """
    if rank not in staged.plan.ranks():
        raise StagingError(f"{rank} is not a rank of the layout ({staged.plan.layout.world_size} ranks)")
    spec = staged.plan.chunk_for(rank, mini_batch)
    stats = ReceiveStats(chunk=spec.name)
    where = f"staging {staged.stage_id} mini-batch {mini_batch}: {rank} could not get chunk {spec.name}"
    t0 = time.perf_counter()
    if spec.name not in staged.refs:
        raise _fail(staged, rank, mini_batch, f"{where}: no such chunk was staged", timeout)
    try:
        buf = staged.backend.get(staged.refs[spec.name], timeout)
    except Exception as e:  # timeout, a lost object, a failed producer: all mean this rank has no share
        raise _fail(staged, rank, mini_batch, f"{where}: {_reason(e)}", timeout) from e
    t1 = time.perf_counter()
    try:
        share = decode_chunk(
            buf, spec, staged.stage_id, layer_ids=staged.plan.layer_ids(staged.layer_ids, spec.pp_rank)
        )
    except StagingError as e:
        raise _fail(staged, rank, mini_batch, f"{where}: {e}", timeout) from e
    stats.bytes_read = memoryview(buf).nbytes
    stats.wait_s, stats.decode_s = t1 - t0, time.perf_counter() - t1
    try:
        staged.backend.report(staged.coordinator, staged.stage_id, mini_batch, str(rank), None, timeout)
    except Exception as e:
        raise StagingError(f"{where}: the coordinator is unreachable: {type(e).__name__}: {e}") from e
    return share, stats


def barrier(staged: StagedBatch, rank: RankCoords, mini_batch: int = 0, *, timeout: float = 60.0) -> float:
    """Wait until every rank got its chunk of ``mini_batch``; raise :class:`StagingError` if any did not.

    Returns the seconds waited. The error names the failing rank and chunk (or the ranks not heard from).
    """
    t0 = time.perf_counter()
    try:
        state, msg = staged.backend.wait(staged.coordinator, staged.stage_id, mini_batch, timeout)
    except Exception as e:
        raise StagingError(
            f"staging {staged.stage_id} mini-batch {mini_batch}: {rank} cannot reach the coordinator: "
            f"{type(e).__name__}: {e}"
        ) from e
    if state == "failed":
        raise StagingError(msg)
    if state == "pending":
        by_name = {str(r): r for r in staged.plan.ranks()}
        who = [f"{r} (chunk {staged.plan.chunk_for(by_name[r], mini_batch).name})" for r in msg[:4]]
        more = f" and {len(msg) - 4} more ranks" if len(msg) > 4 else ""
        raise StagingError(
            f"staging {staged.stage_id} mini-batch {mini_batch}: {', '.join(who)}{more} did not report "
            f"within {timeout:.1f} s "
            "(a rank died or is stuck before staging); every rank stops here instead of entering a collective"
        )
    return time.perf_counter() - t0


def receive(
    staged: StagedBatch, rank: RankCoords, mini_batch: int = 0, *, timeout: float = 60.0, grace: float | None = None
) -> tuple[Routes, ReceiveStats]:
    """:func:`fetch` then :func:`barrier`: this rank's share, returned only if every rank got its own.

    The fetch may take ``timeout`` s; the barrier waits ``grace`` s more (default ``max(1, timeout / 10)``)
    so the reason a late rank gives reaches everyone. Raises :class:`StagingError` on every rank otherwise.
    """
    deadline = time.monotonic() + timeout
    share, stats = fetch(staged, rank, mini_batch, timeout=timeout)
    grace = max(1.0, timeout / 10) if grace is None else grace
    stats.barrier_s = barrier(staged, rank, mini_batch, timeout=max(deadline - time.monotonic(), 0.0) + grace)
    return share, stats
