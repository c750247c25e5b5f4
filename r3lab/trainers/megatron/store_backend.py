"""A staging backend over the torch.distributed key-value store the trainer's driver hosts (a ``TCPStore``).

Why not :class:`~r3lab.staging.TorchDistBackend`: it needs the driver inside the ranks' process group, and
Megatron's parallel state takes the whole default world as ``tp * pp * cp * dp`` trainer ranks, so a driver
rank there would be a trainer rank. Here the driver holds no model: each chunk (the frame and codec of
:func:`~r3lab.staging.stage`, checksums and identity checks as on every backend) is one key of the store,
a rank reads only its own chunk's key, and the all-or-none tally is the torch.distributed backend's own
:class:`~r3lab.staging.StoreTally`, in the same store. Every wait is bounded by the caller's timeout.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from r3lab.errors import StagingTimeoutError
from r3lab.staging import StoreTally
from r3lab.staging.backend import WaitResult
from r3lab.staging.plan import StagingPlan

__all__ = ["StoreBackend", "store_timeout_error"]


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 1e-3))


def store_timeout_error() -> type[BaseException]:
    """What a torch.distributed store's ``wait`` raises when its time runs out: ``DistStoreError`` (checked in the
    suite against the installed torch, ``tests/test_staging_dist.py``). Any other store error is not a late chunk
    and passes through as it is."""
    import torch.distributed as dist

    return dist.DistStoreError


class StoreBackend:
    """Chunks as keys of a ``torch.distributed.Store`` (driver and ranks each hold a client of the same store)."""

    name = "torch.distributed store"

    def __init__(self, store: Any, prefix: str = "r3lab-mcore"):
        self.store, self.prefix = store, prefix
        self._keys: dict[str, list[str]] = {}

    def _key(self, ref: str) -> str:
        return f"{self.prefix}/chunk/{ref}"

    def put(self, key: str, data: bytes) -> str:
        self.store.set_timeout(_td(60.0))
        self.store.set(self._key(key), bytes(data))
        self._keys.setdefault(key.split("/", 1)[0], []).append(self._key(key))
        return key

    def open(self, stage_id: str, plan: StagingPlan, refs: Mapping[str, Any], layer_ids: Sequence[int]) -> StoreTally:
        return self.tally(stage_id, plan)

    def tally(self, stage_id: str, plan: StagingPlan) -> StoreTally:
        """The batch's all-or-none tally (the same keys on the driver and on every rank)."""
        return StoreTally(self.store, f"{self.prefix}/{stage_id}", stage_id, [str(r) for r in plan.ranks()])

    def get(self, ref: str, timeout: float) -> np.ndarray:
        key = self._key(ref)
        self.store.set_timeout(_td(timeout))
        try:
            self.store.wait([key], _td(timeout))
        except store_timeout_error() as e:
            raise StagingTimeoutError(f"chunk {ref} not in the store within {timeout:.1f} s") from e
        return np.frombuffer(self.store.get(key), dtype=np.uint8)

    def report(
        self, coordinator: StoreTally, stage_id: str, mini_batch: int, rank: str, failure: str | None, timeout: float
    ) -> None:
        coordinator.report(mini_batch, rank, failure, timeout)

    def wait(self, coordinator: StoreTally, stage_id: str, mini_batch: int, timeout: float) -> WaitResult:
        return coordinator.wait(mini_batch, timeout)

    def release(self, stage_id: str, refs: Sequence[Any]) -> None:
        for key in self._keys.pop(stage_id, []):
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - best effort: a few bytes stay in the store
                pass
