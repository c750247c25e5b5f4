"""The Megatron trainer's ranks as Ray actors in one placement group: :class:`RayRanks`, a rank transport, and
:class:`RayMegatronTrainer`, the Megatron trainer on it.

The driver is :class:`~r3lab.trainers.megatron.trainer.MegatronTrainer` itself (batches, staging plans, replay
checks, losses); :class:`RayRanks` is its :class:`~r3lab.trainers.megatron.transport.RankTransport`, hosting the
ranks with Ray instead of ``torch.multiprocessing``:

* **Placement**: one placement group of ``tp * pp * dp`` bundles, each ``--trainer-resources`` (default one CPU),
  strategy ``PACK`` (Megatron puts TP neighbours on one node); rank r is pinned to bundle r.
* **The world**: rank 0 reports its node's IP and a free port there; every rank joins
  ``torch.distributed`` at that address (gloo here, as the local ranks do; NCCL is the GPU nodes' choice) and
  builds its shard with the same :func:`~r3lab.trainers.megatron.worker.build_rank` as a spawned rank.
* **Routes**: staged with :class:`~r3lab.staging.RayBackend`, one object per (DP rank, mini-batch); each rank's
  call carries the references of every chunk unresolved (nested in a dict, so Ray fetches none of them) and the
  rank gets only its own (:func:`~r3lab.staging.receive`: checksums, identity, the all-or-none tally in
  the backend's coordinator actor).
* **Weights**: ``export`` leaves the gathered weights in the object store as the driver-owned second return of rank
  0's call and returns :class:`RemoteWeights`, a lazy mapping; ``RayEngine.update_weights`` passes its reference on,
  so the weights go from the rank actor's node to the engine actor without the driver holding them.
* **All or none, bounded**: every call on the ranks is one :func:`~r3lab.cluster.waits.gather` with a deadline;
  a rank that dies, raises or hangs fails the call with its name and node, and every rank actor, the placement
  group and the staging coordinator are ended before the error (a :class:`~r3lab.errors.ClusterError`) is raised.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from r3lab.cluster.connect import actor_options, check_placeable, connect, node_here, parse_resources
from r3lab.cluster.waits import RAY_TIMEOUTS, Member, RayTimeouts, gather
from r3lab.errors import ClusterError, R3LabError
from r3lab.trainers.megatron.trainer import MegatronTrainer
from r3lab.trainers.megatron.transport import Fail

if TYPE_CHECKING:
    from r3lab.trainers.megatron.worker import RankState

__all__ = ["RayMegatronTrainer", "RayRanks", "RemoteWeights", "RankHost"]


class RankHost:
    """What runs inside one rank actor: this rank's :class:`~r3lab.trainers.megatron.worker.RankState`."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self._state: RankState | None = None

    @property
    def state(self) -> RankState:
        if self._state is None:
            raise ClusterError(f"rank {self.rank}: called before start")
        return self._state

    def where(self, timeout_s: float) -> dict[str, Any]:
        """This actor's node, IP and pid; rank 0 also hosts the world's rendezvous store on its node, on a port it
        holds from now on (``port``), so no other process can take it before the ranks join."""
        here = node_here()
        if self.rank != 0:
            return {**here, "port": None}
        from r3lab.trainers.megatron.launch import host_rendezvous

        self._rendezvous = host_rendezvous(timeout_s, host=here["ip"])
        return {**here, "port": int(self._rendezvous.port)}

    def start(self, master_addr: str, port: int, spec: dict) -> dict[str, Any]:
        from r3lab.staging import RayBackend
        from r3lab.trainers.megatron.worker import build_rank

        self._state = s = build_rank(self.rank, self.world, master_addr, port, spec, RayBackend,
                                     store=getattr(self, "_rendezvous", None))
        return dict(rank=self.rank, dp=s.dp, pp=s.pp, tp=s.tp, pid=os.getpid())

    def call(self, cmd: str, kwargs: dict[str, Any]) -> Any:
        return getattr(self.state, cmd)(**kwargs)

    def export_weights(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(a small status, the weights as torch tensors) on rank 0, (None, None) elsewhere; two returns, so the
        driver waits on the status and leaves the weights in the object store."""
        import numpy as np
        import torch

        state = self.state.export()
        if state is None:
            return None, None
        out = {}
        for n, (kind, a) in state.items():
            t = torch.from_numpy(np.array(a))
            out[n] = t.view(torch.bfloat16) if kind == "bfloat16" else t
        return {"tensors": len(out), "bytes": int(sum(t.numel() * t.element_size() for t in out.values()))}, out

    def close(self) -> None:
        from r3lab.trainers.megatron.cpu import destroy_parallel

        destroy_parallel(keep_process_group=False)


class RemoteWeights(Mapping):
    """Weights in Ray's object store (checkpoint names -> CPU tensors), fetched only when read.

    ``ref`` is what crosses to the engine actor; reading a key here fetches the whole mapping once (within
    ``timeout_s``), for a driver-side consumer such as a behaviour scorer's ``load_weights``."""

    def __init__(self, ref: Any, info: Mapping[str, Any], timeout_s: float):
        self.ref, self.info, self.timeout_s = ref, dict(info), float(timeout_s)
        self._value: dict[str, Any] | None = None

    def _get(self) -> dict[str, Any]:
        if self._value is None:
            import ray

            try:
                self._value = ray.get(self.ref, timeout=self.timeout_s)
            except Exception as e:  # noqa: BLE001 - lost, or its owner gone
                raise ClusterError(f"the exported weights are not in the object store any more: {e}") from e
        return self._value

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return int(self.info.get("tensors", len(self._get())))


class RayRanks:
    """The Megatron trainer's ranks as Ray actors (module docstring): a
    :class:`~r3lab.trainers.megatron.transport.RankTransport`.

    ``resources``: one rank's bundle (JSON or a mapping; default one CPU), checked against the cluster before anything
    waits; ``cluster``: as :func:`~r3lab.cluster.connect` (joined here, when the transport is made); ``timeouts``: the
    fixed waits (:class:`~r3lab.cluster.waits.RayTimeouts`: a dead peer's grace, the ranks' polite close).
    """

    label = "Megatron trainer on Ray"
    ended = "every rank actor was ended"
    error: type[R3LabError] = ClusterError

    def __init__(self, *, resources: str | Mapping[str, Any] | None = None, cluster: str = "ray",
                 timeouts: RayTimeouts = RAY_TIMEOUTS):
        connect(cluster)
        self.timeouts = timeouts
        self.resources = parse_resources(resources, what="--trainer-resources")
        self._members: list[Member] = []
        self._pg: Any = None
        self._backend: Any = None
        self._closed = False
        self.master: str | None = None

    @property
    def backend(self) -> Any:
        return self._backend

    @property
    def pids(self) -> list[int]:
        return [m.pid for m in self._members if m.pid is not None]

    @property
    def node_ids(self) -> list[str]:
        """The Ray node of each rank actor, by rank."""
        return [m.node_id for m in self._members]

    @property
    def members(self) -> list[Member]:
        """The rank actors (handle, name, node), by rank."""
        return list(self._members)

    def start(self, spec: dict[str, Any], world: int, timeout: float, fail: Fail) -> list[Any]:
        """The placement group, one actor per rank pinned to its bundle, rank 0's rendezvous, every rank's shard."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from r3lab.staging import RayBackend

        check_placeable(self.resources, what="a trainer rank", count=world)
        tag = uuid.uuid4().hex[:8]
        self._backend = RayBackend(coordinator_name=f"r3lab-staging-{tag}")
        self._pg = placement_group([dict(self.resources)] * world, strategy="PACK", name=f"r3lab-ranks-{tag}")
        try:
            ray.get(self._pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise fail(f"the placement group of {world} bundles {self.resources} was not placed within "
                       f"{timeout:.0f} s (the cluster is busy or short of them)") from None
        opts = actor_options(self.resources)
        for r in range(world):
            name = f"r3lab-megatron-rank{r}-{tag}"
            handle = ray.remote(RankHost).options(
                name=name, max_restarts=0, max_concurrency=1, **opts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=r),
            ).remote(r, world)
            self._members.append(Member(handle, name))
        hold_s = float(spec["collective_timeout_s"])
        where = gather([m.handle.where.remote(hold_s) for m in self._members], self._members, "placement", timeout,
                       fail, timeouts=self.timeouts)
        for m, w in zip(self._members, where, strict=True):
            m.node_id, m.ip, m.pid = w["node_id"], w["ip"], w["pid"]
        master, port = where[0]["ip"], where[0]["port"]  # the world's master: rank 0's node, its store's port
        ranks = gather([m.handle.start.remote(master, port, spec) for m in self._members], self._members, "start",
                       timeout, fail, timeouts=self.timeouts)
        self.master = f"{master}:{port}"
        return ranks

    def call(self, cmd: str, kwargs: dict[str, Any], timeout: float, fail: Fail) -> list[Any]:
        return gather([m.handle.call.remote(cmd, kwargs) for m in self._members], self._members, cmd, timeout, fail,
                      timeouts=self.timeouts)

    def export(self, timeout: float, fail: Fail) -> RemoteWeights:
        """Every shard gathered on rank 0, left in the object store (:class:`RemoteWeights`); the driver waits for
        every rank's status within the deadline, never for the weights' bytes."""
        calls = [m.handle.export_weights.options(num_returns=2).remote() for m in self._members]
        status = gather([c[0] for c in calls], self._members, "export", timeout, fail, timeouts=self.timeouts)
        return RemoteWeights(calls[0][1], status[0] or {}, timeout)

    def stage_info(self, info: dict[str, Any], staged: Any) -> dict[str, Any]:
        info["coordinator"] = staged.coordinator  # the ranks report to the backend's coordinator actor
        return info

    def release(self, staged: Any) -> None:
        try:
            staged.release()
        except Exception:  # noqa: BLE001 - the coordinator is gone with a failed job; the chunks go with it
            pass

    def close(self) -> None:
        """End every rank actor, the placement group and the staging coordinator; idempotent."""
        if self._closed:
            return
        self._closed = True
        import ray

        polite = [m.handle.close.remote() for m in self._members if m.handle is not None]
        if polite:
            ray.wait(polite, num_returns=len(polite), timeout=self.timeouts.polite_stop_s)
        for m in self._members:
            try:
                ray.kill(m.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        coordinator = getattr(self._backend, "coordinator", None)
        if coordinator is not None:
            try:
                ray.kill(coordinator, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._pg is not None:
            try:
                ray.util.remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - already removed
                pass


class RayMegatronTrainer(MegatronTrainer):
    """:class:`~r3lab.trainers.megatron.trainer.MegatronTrainer` on :class:`RayRanks`: its ranks as Ray actors.

    Only the transport differs: ``resources`` (one rank's bundle) and ``cluster`` make the :class:`RayRanks`;
    ``timeout_s`` bounds every call (and the ranks' collectives), ``start_timeout_s`` the placement and the ranks'
    start; ``timeouts``: the transport's fixed waits. :attr:`members`, :attr:`node_ids` and :attr:`master` are the
    transport's.
    """

    transport: RayRanks

    def __init__(self, model_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1, ep: int = 1, dp: int | None = None,
                 dtype: str = "float32", lr: float | None = None, codec: str = "raw", timeout_s: float = 180.0,
                 start_timeout_s: float = 300.0, resources: str | Mapping[str, Any] | None = None,
                 cluster: str = "ray", megatron_loader: str | None = None, timeouts: RayTimeouts = RAY_TIMEOUTS):
        super().__init__(model_dir, tp=tp, pp=pp, ep=ep, dp=dp, dtype=dtype, lr=lr, codec=codec, timeout_s=timeout_s,
                         start_timeout_s=start_timeout_s, megatron_loader=megatron_loader,
                         transport=RayRanks(resources=resources, cluster=cluster, timeouts=timeouts))

    @property
    def resources(self) -> dict[str, float]:
        """One rank's bundle."""
        return self.transport.resources

    @property
    def members(self) -> list[Member]:
        """The rank actors (handle, name, node), by rank."""
        return self.transport.members

    @property
    def node_ids(self) -> list[str]:
        """The Ray node of each rank actor, by rank."""
        return self.transport.node_ids

    @property
    def master(self) -> str | None:
        """The world's rendezvous, ``IP:PORT`` on rank 0's node."""
        return self.transport.master
