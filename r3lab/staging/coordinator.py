"""All or none: the tally of which ranks got their chunk, shared by every rank of a staged batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from r3lab.errors import StagingTimeoutError


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

    def report(
        self, stage_id: str, mini_batch: int, rank: str, failure: str | None = None, timeout: float | None = None
    ) -> None:
        """Record ``rank``'s outcome; the first failure of a mini-batch wins. Raises
        :class:`~r3lab.errors.StagingTimeoutError` (a :class:`TimeoutError`) if the tally cannot be reached within
        ``timeout`` s (None: wait as long as it takes)."""
        if not self._cond.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise StagingTimeoutError(f"the coordinator was busy for {timeout:.1f} s")
        try:
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
        finally:
            self._cond.release()

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
