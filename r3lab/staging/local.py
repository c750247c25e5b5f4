"""The in-process backend: chunks in a dict, ranks are threads. For CPU notebooks and tests."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from r3lab.errors import StagingTimeoutError
from r3lab.staging.backend import WaitResult
from r3lab.staging.coordinator import Coordinator
from r3lab.staging.plan import StagingPlan


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
                raise StagingTimeoutError(f"not put within {timeout:.1f} s")
            return memoryview(self._store[ref])

    def release(self, stage_id: str, refs: Sequence[str]) -> None:
        with self._cond:
            for r in refs:
                self._store.pop(r, None)
        self._coordinator.close(stage_id)

    def open(self, stage_id: str, plan: StagingPlan, refs: Mapping[str, Any], layer_ids: Sequence[int]) -> Coordinator:
        self._coordinator.open(stage_id, [str(r) for r in plan.ranks()])
        return self._coordinator

    def report(
        self, coordinator: Coordinator, stage_id: str, mini_batch: int, rank: str, failure: str | None, timeout: float
    ) -> None:
        coordinator.report(stage_id, mini_batch, rank, failure, timeout=timeout)

    def wait(self, coordinator: Coordinator, stage_id: str, mini_batch: int, timeout: float) -> WaitResult:
        return coordinator.wait(stage_id, mini_batch, timeout)
