"""The Ray backend: chunks in Ray's object store, the tally in one threaded Ray actor owned by the backend."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from r3lab._extras import importing
from r3lab.errors import StagingTimeoutError
from r3lab.staging.backend import WaitResult
from r3lab.staging.coordinator import Coordinator
from r3lab.staging.plan import StagingError, StagingPlan


class RayBackend:
    """Chunks in Ray's object store as uint8 numpy arrays (out of band: a rank's ``ray.get`` maps shared
    memory, no copy). Needs ``ray.init()`` first; picklable (send the staged batch to Ray actors).

    The coordinator is one threaded Ray actor per backend, created on the first :func:`~r3lab.staging.stage`
    and shared by every batch staged with this backend: keep one ``RayBackend`` for a run, as a trainer keeps
    its process group. The backend and every staged batch hold its handle, so Ray ends the actor only once
    all of them are gone (releasing a batch does not). ``max_concurrency`` bounds the ranks that can wait in
    :func:`~r3lab.staging.barrier` at once, so it must exceed the world size. ``rpc_timeout``: seconds
    allowed for the driver's calls to the coordinator and for a barrier's round trip beyond its deadline.
    """

    name = "ray"

    def __init__(self, coordinator_name: str = "r3lab-staging", max_concurrency: int = 256, rpc_timeout: float = 30.0):
        self.coordinator_name, self.max_concurrency, self.rpc_timeout = coordinator_name, max_concurrency, rpc_timeout
        self._actor: Any = None

    @staticmethod
    def _ray():
        with importing("ray", for_="RayBackend"):
            import ray
        if not ray.is_initialized():
            raise StagingError("RayBackend needs a running Ray: call ray.init() (or ray.init(address=...)) first")
        return ray

    @property
    def coordinator(self) -> Any:
        """The coordinator actor's handle (None before the first batch is staged)."""
        return self._actor

    def put(self, key: str, data: bytes) -> Any:
        return self._ray().put(np.frombuffer(data, dtype=np.uint8))

    def get(self, ref: Any, timeout: float) -> np.ndarray:
        ray = self._ray()
        try:
            return ray.get(ref, timeout=max(timeout, 0.0))
        except ray.exceptions.GetTimeoutError as e:
            raise StagingTimeoutError(f"not in the object store within {timeout:.1f} s") from e

    def open(self, stage_id: str, plan: StagingPlan, refs: Mapping[str, Any], layer_ids: Sequence[int]) -> Any:
        """The coordinator actor (created and awaited here, on the driver, so ranks never wait for its start)."""
        ray = self._ray()
        ranks = [str(r) for r in plan.ranks()]
        if len(ranks) + 4 > self.max_concurrency:
            raise StagingError(
                f"{len(ranks)} ranks need a coordinator with max_concurrency >= {len(ranks) + 4}, "
                f"this RayBackend has {self.max_concurrency}: pass RayBackend(max_concurrency=...)"
            )
        if self._actor is None:
            self._actor = (
                ray.remote(Coordinator)
                .options(
                    name=f"{self.coordinator_name}-{uuid.uuid4().hex[:8]}",
                    num_cpus=0,
                    max_concurrency=self.max_concurrency,
                )
                .remote()
            )
        ray.get(self._actor.open.remote(stage_id, ranks), timeout=max(self.rpc_timeout, 120.0))
        return self._actor

    def release(self, stage_id: str, refs: Sequence[Any]) -> None:
        """Forget the stage on the coordinator; Ray frees each chunk once no one holds its reference."""
        if self._actor is not None:
            self._ray().get(self._actor.close.remote(stage_id), timeout=self.rpc_timeout)

    def report(
        self, coordinator: Any, stage_id: str, mini_batch: int, rank: str, failure: str | None, timeout: float
    ) -> None:
        ray = self._ray()
        try:
            ray.get(coordinator.report.remote(stage_id, mini_batch, rank, failure), timeout=max(timeout, 0.0))
        except ray.exceptions.GetTimeoutError as e:
            raise StagingTimeoutError(f"the coordinator did not take the report within {timeout:.1f} s") from e

    def wait(self, coordinator: Any, stage_id: str, mini_batch: int, timeout: float) -> WaitResult:
        ray = self._ray()
        ref = coordinator.wait.remote(stage_id, mini_batch, timeout)
        state, detail = ray.get(ref, timeout=timeout + self.rpc_timeout)
        return state, detail
