"""A trainer-rank stand-in for staging tests and benchmarks: receive a share, slice it, measure memory.

:class:`RankWorker` runs in-process (local backend, one thread per rank), as a Ray actor
(``ray.remote(RankWorker)``) or in a torch.distributed rank process (given the batch from ``attach``).
Memory is measured inside the worker around the receive (fetch + decode):
the tracemalloc peak (Python and numpy allocations) and the growth of the process's resident high-water
mark (``VmHWM``, reset through ``/proc/self/clear_refs`` where Linux allows; it also counts object-store
pages the rank touches). Measure with one rank per process: both numbers are per process.
"""

from __future__ import annotations

import dataclasses
import os
import time
import tracemalloc
from typing import Any

import numpy as np

from r3lab.compaction import decode, encode
from r3lab.errors import StagingError
from r3lab.routes import Routes
from r3lab.slicing import dp_sequence_ids, dp_share, shard_local
from r3lab.staging import RankCoords, StagedBatch, decode_chunk, receive

__all__ = ["RankWorker", "rss_hwm_reset", "rss_hwm", "late_bytes", "lost_bytes"]


def rss_hwm_reset() -> bool:
    """Reset this process's resident high-water mark; False where the kernel does not let us."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_hwm() -> int:
    """This process's resident high-water mark in bytes (VmHWM), or -1 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


class RankWorker:
    """One trainer rank: :meth:`receive` its share of a staged batch, or :meth:`receive_whole` the whole batch
    and slice it (the anti-pattern staging replaces). Returns plain dicts (picklable over Ray)."""

    def pid(self) -> int:
        return os.getpid()

    def warm_up(self, codec: Any = "raw", num_experts: int = 64, top_k: int = 4) -> None:
        """Compile the codec's kernels (numba) in this process, so measurements see steady state."""
        rng = np.random.default_rng(0)
        vals = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(64)]).reshape(16, 4, top_k)
        decode(encode(Routes(vals, [0, 16], num_experts), codec))

    def receive(
        self,
        staged: StagedBatch,
        rank: RankCoords,
        mini_batch: int = 0,
        *,
        timeout: float = 30.0,
        grace: float | None = None,
        measure: bool = False,
        return_arrays: bool = True,
    ) -> dict[str, Any]:
        """This rank's share and its arrays per micro-batch, or the error it raised, with timings and memory."""
        t0 = time.perf_counter()
        mem = _Meter(measure)
        try:
            with mem:
                share, stats = receive(staged, rank, mini_batch, timeout=timeout, grace=grace)
        except StagingError as e:
            return {"ok": False, "error": type(e).__name__, "message": str(e), "elapsed": time.perf_counter() - t0}
        out: dict[str, Any] = {
            "ok": True,
            "elapsed": time.perf_counter() - t0,
            "stats": dataclasses.asdict(stats),
            "share_bytes": share.values.nbytes + share.cu_seqlens.nbytes,
            **mem.result(),
        }
        if return_arrays:
            layout = staged.plan.layout
            n_mb = len(dp_sequence_ids(len(staged.plan.mini_batches[mini_batch]), layout, rank.dp))
            out["share"] = (np.array(share.values), np.array(share.cu_seqlens), share.layer_ids.tolist())
            out["micro_batches"] = [
                shard_local(share, layout, pp_rank=rank.pp, cp_rank=rank.cp, tp_rank=rank.tp, micro_batch=i)
                for i in range(n_mb)
            ]
        return out

    def receive_whole(self, whole: StagedBatch, layout: Any, rank: RankCoords, *, timeout: float = 30.0) -> dict:
        """Whole-batch put (SkyRL before #1376): get every byte, decode everything, then keep this rank's share.

        ``whole`` is the batch staged as one chunk (a plan with one DP rank and one mini-batch).
        """
        spec = whole.plan.chunk(0, 0)
        mem = _Meter(True)
        with mem:
            t0 = time.perf_counter()
            buf = whole.backend.get(whole.refs[spec.name], timeout)
            t1 = time.perf_counter()
            batch = decode_chunk(buf, spec, whole.stage_id)
            t2 = time.perf_counter()
            share = dp_share(batch, layout, rank.dp)
            del batch
        return {
            "ok": True,
            "bytes_read": memoryview(buf).nbytes,
            "wait_s": t1 - t0,
            "decode_s": t2 - t1,
            "slice_s": time.perf_counter() - t2,
            "share_bytes": share.values.nbytes + share.cu_seqlens.nbytes,
            **mem.result(),
        }


class _Meter:
    """tracemalloc peak and resident high-water growth across a ``with`` block (both 0 when off)."""

    def __init__(self, on: bool):
        self.on, self.peak, self.rss = on, 0, 0

    def __enter__(self) -> _Meter:
        if self.on:
            self._hwm = rss_hwm_reset()
            self._rss0 = _rss() if self._hwm else -1
            tracemalloc.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            _, self.peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            self.rss = rss_hwm() - self._rss0 if self._hwm else -1

    def result(self) -> dict[str, int]:
        return {"peak_heap": self.peak, "rss_growth": self.rss}


def share_of(routes: Routes, seq_ids: Any) -> Routes:
    """The oracle share: sequences ``seq_ids`` of ``routes``, straight from the whole batch."""
    return routes.take(seq_ids)


def late_bytes(data: bytes, delay: float) -> np.ndarray:
    """A chunk producer that is late (run as a Ray task): its bytes after ``delay`` seconds."""
    time.sleep(delay)
    return np.frombuffer(data, dtype=np.uint8)


def lost_bytes() -> np.ndarray:
    """A chunk producer that dies before its chunk exists (run as a Ray task)."""
    raise RuntimeError("chunk producer lost")
