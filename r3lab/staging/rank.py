"""On a trainer rank: get, check and decode its chunk, then pass the all-or-none barrier."""

from __future__ import annotations

import dataclasses
import time

from r3lab.routes import Routes
from r3lab.staging.driver import StagedBatch
from r3lab.staging.frame import decode_chunk
from r3lab.staging.plan import RankCoords, StagingError


@dataclasses.dataclass
class ReceiveStats:
    """What one rank's :func:`fetch`/:func:`receive` did: its chunk, bytes read, seconds per phase."""

    chunk: str = ""
    bytes_read: int = 0
    wait_s: float = 0.0
    decode_s: float = 0.0
    barrier_s: float = 0.0


def default_grace(timeout: float) -> float:
    """The seconds a rank allows, past its fetch deadline, for reports and the barrier: ``max(1, timeout / 10)``."""
    return max(1.0, timeout / 10)


def _reason(e: BaseException) -> str:
    """One line for an error: its type and the last line of its text (Ray's task errors carry tracebacks)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"


def _fail(staged: StagedBatch, rank: RankCoords, mini_batch: int, message: str, timeout: float) -> StagingError:
    """Report a failure for everyone to see (within ``timeout`` s), and return the error this rank raises."""
    try:
        staged.backend.report(staged.coordinator, staged.stage_id, mini_batch, str(rank), message, timeout)
    except Exception as e:  # the coordinator is gone or stuck: the others time out in barrier() and raise too
        message += f" (and the coordinator could not be told: {_reason(e)})"
    return StagingError(message)


def fetch(
    staged: StagedBatch, rank: RankCoords, mini_batch: int = 0, *, timeout: float = 60.0, grace: float | None = None
) -> tuple[Routes, ReceiveStats]:
    """On a rank: get, check and decode this rank's chunk within ``timeout`` s, and report the outcome.

    The report may take ``grace`` s more (default :func:`default_grace`); an unreachable coordinator raises.
    Does not wait for the other ranks (call :func:`barrier`, or use :func:`receive` for both).
    Returns the rank's DP share for :func:`~r3lab.slicing.shard_local`.
    """
    grace = default_grace(timeout) if grace is None else grace
    if rank not in staged.plan.ranks():
        raise StagingError(f"{rank} is not a rank of the layout ({staged.plan.layout.world_size} ranks)")
    spec = staged.plan.chunk_for(rank, mini_batch)
    stats = ReceiveStats(chunk=spec.name)
    where = f"staging {staged.stage_id} mini-batch {mini_batch}: {rank} could not get chunk {spec.name}"
    t0 = time.perf_counter()
    if spec.name not in staged.refs:
        raise _fail(staged, rank, mini_batch, f"{where}: no such chunk was staged", grace)
    try:
        buf = staged.backend.get(staged.refs[spec.name], timeout)
    except Exception as e:  # timeout, a lost object, a failed producer: all mean this rank has no share
        raise _fail(staged, rank, mini_batch, f"{where}: {_reason(e)}", grace) from e
    t1 = time.perf_counter()
    try:
        share = decode_chunk(
            buf, spec, staged.stage_id, layer_ids=staged.plan.layer_ids(staged.layer_ids, spec.pp_rank)
        )
    except StagingError as e:
        raise _fail(staged, rank, mini_batch, f"{where}: {e}", grace) from e
    stats.bytes_read = memoryview(buf).nbytes
    stats.wait_s, stats.decode_s = t1 - t0, time.perf_counter() - t1
    try:
        staged.backend.report(staged.coordinator, staged.stage_id, mini_batch, str(rank), None, grace)
    except Exception as e:
        raise StagingError(f"{where}: the coordinator is unreachable: {_reason(e)}") from e
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
            f"staging {staged.stage_id} mini-batch {mini_batch}: {rank} cannot reach the coordinator: {_reason(e)}"
        ) from e
    if state == "failed":
        raise StagingError(msg)
    if state == "pending":
        by_name = {str(r): r for r in staged.plan.ranks()}
        who = [f"{r} (chunk {staged.plan.chunk_for(by_name[r], mini_batch).name})" for r in msg[:4]]
        more = f" and {len(msg) - 4} more ranks" if len(msg) > 4 else ""
        raise StagingError(
            f"staging {staged.stage_id} mini-batch {mini_batch}: {', '.join(who)}{more} did not report "
            "before the deadline (a rank died or is stuck before staging); "
            "every rank stops here instead of entering a collective"
        )
    return time.perf_counter() - t0


def receive(
    staged: StagedBatch, rank: RankCoords, mini_batch: int = 0, *, timeout: float = 60.0, grace: float | None = None
) -> tuple[Routes, ReceiveStats]:
    """:func:`fetch` then :func:`barrier`: this rank's share, returned only if every rank got its own.

    The fetch may take ``timeout`` s; reports and the barrier end ``grace`` s later (default
    :func:`default_grace`), so the reason a late rank gives reaches everyone: a rank returns or raises
    within ``timeout + grace`` s (plus one round trip to the coordinator). Raises :class:`StagingError`
    on every rank otherwise.
    """
    grace = default_grace(timeout) if grace is None else grace
    end = time.monotonic() + timeout + grace
    share, stats = fetch(staged, rank, mini_batch, timeout=timeout, grace=grace)
    stats.barrier_s = barrier(staged, rank, mini_batch, timeout=max(end - time.monotonic(), 0.0))
    return share, stats
