"""The torch.distributed backend: the driver joins the trainer ranks' process group and sends each rank its chunk.

The seeds' GPU-based transfer. The driver is one rank of a process group with the trainer ranks (gloo
here; NCCL with ``device="cuda"`` on GPU nodes, same code). :func:`~r3lab.staging.stage` encodes each
chunk as on every backend and ``open`` sends it, as a ``uint8`` tensor with ``isend``, to exactly the ranks
that read it (every PP/CP/TP rank of its DP rank; the stage's ranks with ``split_stages``). Nothing else
travels through the group. Small metadata goes through the process group's key-value store
(``torch.distributed.Store``, e.g. the ``TCPStore`` the group was made with):

* the batch's manifest (stage id, plan, layer ids, each chunk's byte count and readers), so a rank
  calls :meth:`TorchDistBackend.attach` with the stage id (e.g. the step number) and receives with
  :func:`~r3lab.staging.receive` as on the other backends;
* the all-or-none tally: each rank's report and the first failure, polled by :func:`~r3lab.staging.barrier`.

A rank's wait for its chunk is ``irecv(...).wait(timeout)``: bounded by the rank's own timeout, not the
group's. Ranks receive their mini-batches in order (NCCL matches sends and receives by order, gloo by tag).
After a :class:`~r3lab.errors.StagingError` every rank stops; tear the group down rather than reuse it.
"""

from __future__ import annotations

import datetime
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from r3lab._extras import importing
from r3lab.errors import StagingTimeoutError
from r3lab.staging.backend import WaitResult
from r3lab.staging.driver import StagedBatch
from r3lab.staging.plan import StagingError, StagingPlan


def _tag(stage_id: str, mini_batch: int) -> int:
    """The message tag of a batch's mini-batch (gloo matches by tag, so a stale chunk never meets a later receive)."""
    return zlib.crc32(f"{stage_id}/mb{mini_batch}".encode()) & 0x7FFFFFFF


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 1e-3))


class StoreTally:
    """The all-or-none tally of one staged batch, kept in a torch.distributed store (same answers as
    :class:`~r3lab.staging.Coordinator`: the first failure wins, a rank reports once, unknown ranks fail)."""

    def __init__(self, store: Any, prefix: str, stage_id: str, ranks: Sequence[str], poll_s: float = 0.005):
        self.store, self.prefix, self.stage_id, self.ranks, self.poll_s = store, prefix, stage_id, list(ranks), poll_s

    def _key(self, mini_batch: int, what: str) -> str:
        return f"{self.prefix}/mb{mini_batch}/{what}"

    def report(self, mini_batch: int, rank: str, failure: str | None, timeout: float) -> None:
        self.store.set_timeout(_td(timeout))
        if rank not in self.ranks:
            failure = f"staging {self.stage_id} mini-batch {mini_batch}: unknown {rank} reported"
        elif self.store.add(self._key(mini_batch, f"seen/{rank}"), 1) > 1:
            failure = f"staging {self.stage_id} mini-batch {mini_batch}: {rank} reported twice"
        if failure is not None:
            self.store.compare_set(self._key(mini_batch, "failure"), "", failure)
        else:
            self.store.add(self._key(mini_batch, "ok"), 1)

    def wait(self, mini_batch: int, timeout: float) -> WaitResult:
        deadline = time.monotonic() + max(timeout, 0.0)
        fail_key, ok_key = self._key(mini_batch, "failure"), self._key(mini_batch, "ok")
        self.store.set_timeout(_td(max(timeout, 1.0) + 5.0))
        pause = self.poll_s
        while True:
            if self.store.check([fail_key]):
                return "failed", self.store.get(fail_key).decode()
            if self.store.add(ok_key, 0) >= len(self.ranks):
                return "ok", ""
            left = deadline - time.monotonic()
            if left <= 0:
                return "pending", [r for r in self.ranks if not self.store.check([self._key(mini_batch, f"seen/{r}")])]
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.05)

    def keys(self, mini_batches: int) -> list[str]:
        every = ["failure", "ok", *(f"seen/{r}" for r in self.ranks)]
        return [self._key(m, w) for m in range(mini_batches) for w in every]


class TorchDistBackend:
    """Chunks sent rank to rank over a torch.distributed process group (see the module docstring).

    ``store``: a ``torch.distributed.Store`` every rank and the driver reach (the backend talks to its own
    ``clone()``, so its timeouts are its own). ``driver``: the global rank that stages. ``ranks``: the global
    rank of each of the plan's ranks, in :meth:`~r3lab.staging.StagingPlan.ranks` order (default: every rank
    but the driver, in order). ``device``: where chunk tensors live (``"cpu"`` for gloo, ``"cuda"`` for NCCL).
    ``group``: the process group (default: the world). Build one on the driver and on every rank.
    """

    name = "torch.distributed"

    def __init__(
        self,
        store: Any,
        *,
        driver: int = 0,
        ranks: Sequence[int] | None = None,
        device: Any = "cpu",
        group: Any = None,
        prefix: str = "r3lab-staging",
    ):
        try:  # a client of its own, so the timeouts set here stay here
            self.store = store.clone()
        except (AttributeError, RuntimeError):  # stores without clone (HashStore): share it
            self.store = store
        self.driver, self.device, self.group, self.prefix = int(driver), device, group, prefix
        self._ranks = None if ranks is None else [int(r) for r in ranks]
        self._tensors: dict[str, Any] = {}
        self._sends: dict[str, list[Any]] = {}

    @staticmethod
    def _dist():
        with importing("torch", for_="TorchDistBackend"):
            import torch.distributed as dist

        if not dist.is_initialized():
            raise StagingError("TorchDistBackend needs a process group: call torch.distributed.init_process_group")
        return dist

    def _global_ranks(self, plan: StagingPlan) -> list[int]:
        dist = self._dist()
        world = dist.get_world_size(self.group)
        ranks = self._ranks if self._ranks is not None else [r for r in range(world) if r != self.driver]
        n = plan.layout.world_size
        if len(ranks) != n or self.driver in ranks or len(set(ranks)) != n or not all(0 <= r < world for r in ranks):
            raise StagingError(
                f"the plan's {n} ranks need {n} distinct global ranks other than the driver {self.driver} in a "
                f"group of {world}; this backend maps them to {ranks}"
            )
        return ranks

    def _manifest_key(self, stage_id: str) -> str:
        return f"{self.prefix}/{stage_id}/manifest"

    # ---- driver ----
    def put(self, key: str, data: bytes) -> str:
        with importing("torch", for_="TorchDistBackend"):
            import torch

        self._tensors[key] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        return key

    def open(self, stage_id: str, plan: StagingPlan, refs: Mapping[str, Any], layer_ids: Sequence[int]) -> StoreTally:
        """:meth:`publish` the manifest, then :meth:`send` every chunk to the ranks that read it."""
        tally = self.publish(stage_id, plan, refs, layer_ids)
        self.send(stage_id, plan, refs)
        return tally

    def _readers(self, plan: StagingPlan, refs: Mapping[str, Any]) -> dict[str, list[int]]:
        """The global ranks each chunk goes to (mini-batch order)."""
        ranks = self._global_ranks(plan)
        readers: dict[str, list[int]] = {name: [] for name in refs}
        for m in range(len(plan.mini_batches)):
            for g, r in zip(ranks, plan.ranks(), strict=True):
                name = plan.chunk_for(r, m).name
                if name in readers:
                    readers[name].append(g)
        return readers

    def publish(
        self, stage_id: str, plan: StagingPlan, refs: Mapping[str, Any], layer_ids: Sequence[int]
    ) -> StoreTally:
        """Put the manifest in the store (ranks :meth:`attach` to it) and return the batch's tally."""
        dist = self._dist()
        if dist.get_rank(self.group) != self.driver:
            raise StagingError(f"stage() runs on the driver, global rank {self.driver}, not on {dist.get_rank()}")
        readers = self._readers(plan, refs)
        chunks = {}
        for name, ref in refs.items():
            m = int(name.rsplit("/mb", 1)[1])
            chunks[name] = {
                "mini_batch": m,
                "tag": _tag(stage_id, m),
                "bytes": int(self._tensors[ref].numel()),
                "readers": readers[name],
            }
        manifest = {"stage_id": stage_id, "plan": plan.to_dict(), "layer_ids": list(layer_ids), "chunks": chunks}
        self.store.set_timeout(_td(60.0))
        self.store.set(self._manifest_key(stage_id), orjson.dumps(manifest))
        return StoreTally(self.store, f"{self.prefix}/{stage_id}", stage_id, [str(r) for r in plan.ranks()])

    def send(self, stage_id: str, plan: StagingPlan, refs: Mapping[str, Any]) -> None:
        """Start one ``isend`` per (reader, chunk) of ``refs``, mini-batch by mini-batch; returns at once."""
        dist = self._dist()
        sends = self._sends.setdefault(stage_id, [])
        for name, readers in self._readers(plan, refs).items():
            m = int(name.rsplit("/mb", 1)[1])
            for g in readers:
                try:
                    sends.append(dist.isend(self._tensors[refs[name]], dst=g, group=self.group, tag=_tag(stage_id, m)))
                except RuntimeError:  # the rank is gone: it cannot report, so every other rank's barrier fails
                    pass

    def release(self, stage_id: str, refs: Sequence[Any]) -> None:
        """Drop the chunks' tensors, the pending sends and the batch's keys in the store."""
        for ref in refs:
            if isinstance(ref, str):
                self._tensors.pop(ref, None)
        self._sends.pop(stage_id, None)
        try:
            self.store.delete_key(self._manifest_key(stage_id))
        except Exception:  # noqa: BLE001 - best effort: a store without delete keeps a few bytes
            pass

    # ---- ranks ----
    def attach(self, stage_id: str, *, timeout: float = 60.0, layout: Any = None) -> StagedBatch:
        """On a trainer rank: the handle of the batch the driver staged as ``stage_id`` (its manifest, waited
        for up to ``timeout`` s). ``layout``: this rank's own layout, checked against the driver's plan."""
        key = self._manifest_key(stage_id)
        self.store.set_timeout(_td(timeout))
        try:
            self.store.wait([key], _td(timeout))
            raw = self.store.get(key)
        except Exception as e:
            raise StagingError(
                f"staging {stage_id}: the driver published no manifest within {timeout:.1f} s "
                f"({type(e).__name__}); every rank stops here"
            ) from e
        try:
            m = orjson.loads(raw)
            plan = StagingPlan.from_dict(m["plan"])
            chunks = {n: (int(c["tag"]), int(c["bytes"]), tuple(c["readers"])) for n, c in m["chunks"].items()}
            layer_ids = tuple(int(i) for i in m["layer_ids"])
            if m["stage_id"] != stage_id:
                raise StagingError(f"the manifest is for stage {m['stage_id']!r}")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise StagingError(f"staging {stage_id}: malformed manifest: {type(e).__name__}: {e}") from e
        if layout is not None and plan.layout != layout:
            raise StagingError(f"staging {stage_id}: the driver's layout {plan.layout} is not this rank's {layout}")
        tally = StoreTally(self.store, f"{self.prefix}/{stage_id}", stage_id, [str(r) for r in plan.ranks()])
        return StagedBatch(stage_id, plan, chunks, self, tally, layer_ids)

    def get(self, ref: Any, timeout: float) -> np.ndarray:
        """Receive this rank's chunk from the driver within ``timeout`` s (host bytes; a copy off the device)."""
        with importing("torch", for_="TorchDistBackend"):
            import torch

        dist = self._dist()
        tag, nbytes, readers = ref
        me = dist.get_rank(self.group)
        if me not in readers:
            raise StagingError(f"the driver sends this chunk to global ranks {list(readers)}, this process is {me}")
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        work = dist.irecv(buf, src=self.driver, group=self.group, tag=tag)
        deadline = time.monotonic() + timeout
        try:
            work.wait(timeout=_td(timeout))
        except RuntimeError as e:
            # gloo's timeout is a plain RuntimeError (no type of its own to catch): one raised at the deadline is
            # the deadline, any earlier one a failure of the transfer, raised as it is
            if time.monotonic() >= deadline:
                raise StagingTimeoutError(f"not received from the driver within {timeout:.1f} s") from e
            raise
        return buf.cpu().numpy()

    def report(
        self, coordinator: StoreTally, stage_id: str, mini_batch: int, rank: str, failure: str | None, timeout: float
    ) -> None:
        coordinator.report(mini_batch, rank, failure, timeout)

    def wait(self, coordinator: StoreTally, stage_id: str, mini_batch: int, timeout: float) -> WaitResult:
        return coordinator.wait(mini_batch, timeout)
