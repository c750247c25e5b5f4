"""The interface every staging backend implements: where chunks are put, how a rank gets one, and the tally."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from r3lab.staging.plan import StagingPlan

#: what :meth:`Backend.wait` returns: ``("ok", "")``, ``("failed", message)`` or ``("pending", ranks not heard from)``
WaitResult = tuple[str, str | list[str]]


@runtime_checkable
class Backend(Protocol):
    """Moves chunk bytes from the driver to the ranks and keeps the all-or-none tally.

    The driver calls :meth:`put` once per chunk, then :meth:`open`; each rank calls :meth:`get` for its
    chunk, :meth:`report` once, and :meth:`wait`. Every call that waits takes a timeout in seconds and
    returns or raises within it (plus the transport's round trip). Ranks are named by ``str(RankCoords)``.
    """

    #: short name for tables and messages ("local", "ray", "torch.distributed")
    name: str

    def put(self, key: str, data: bytes) -> Any:
        """Hold one chunk's bytes; returns the reference a rank passes to :meth:`get`."""
        ...

    def open(self, stage_id: str, plan: StagingPlan, refs: Mapping[str, Any], layer_ids: Sequence[int]) -> Any:
        """Start the tally of a staged batch (and deliver its chunks where the backend pushes them);
        returns the coordinator handle ranks report to."""
        ...

    def get(self, ref: Any, timeout: float) -> Any:
        """The chunk's bytes (any buffer), within ``timeout`` s, or raise (:class:`~r3lab.errors.StagingTimeoutError`,
        a :class:`TimeoutError`, when late)."""
        ...

    def report(
        self, coordinator: Any, stage_id: str, mini_batch: int, rank: str, failure: str | None, timeout: float
    ) -> None:
        """Tell the tally ``rank`` got its chunk (``failure`` None) or why not; raise if not done within ``timeout``."""
        ...

    def wait(self, coordinator: Any, stage_id: str, mini_batch: int, timeout: float) -> WaitResult:
        """Block until every rank reported success, any reported a failure, or ``timeout`` s passed."""
        ...

    def release(self, stage_id: str, refs: Sequence[Any]) -> None:
        """Forget a staged batch: its chunks and its tally."""
        ...
