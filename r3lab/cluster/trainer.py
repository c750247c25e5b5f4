"""A one-process trainer (transformers) in one Ray actor: :class:`RayTrainer`, and :func:`build_trainer`, the ``ray``
trainer placement (:mod:`r3lab.cluster.placement`), which places any registered trainer on the cluster (Megatron:
rank actors, :mod:`r3lab.cluster.megatron`).

The actor loads the trainer with the registry's own loader (:func:`r3lab.trainer_registry.load_trainer`), so it
runs the local code on the same inputs; every call waits at most ``timeout_s`` and a dead or hung actor raises
:class:`~r3lab.errors.ClusterError` naming it and its node. ``export_weights`` leaves the weights in the object
store (:class:`~r3lab.cluster.megatron.RemoteWeights`), as the rank actors do.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from r3lab._process import Closing
from r3lab.cluster.connect import actor_options, check_placeable, connect, node_here, parse_resources
from r3lab.cluster.waits import RAY_TIMEOUTS, Member, RayTimeouts, get_one
from r3lab.errors import ClusterError, R3LabError
from r3lab.trainer_registry import TrainerOptions, trainer_spec

if TYPE_CHECKING:
    from r3lab.cluster.megatron import RemoteWeights

__all__ = ["TrainerHost"]


class TrainerHost:
    """What runs inside the actor: one registered trainer."""

    def __init__(self, name: str, path: str, options: TrainerOptions):
        import torch

        from r3lab.trainer_registry import load_trainer as load_registered

        torch.set_num_threads(1)  # as the drift experiment and the RL loop score locally
        self.trainer = load_registered(name, path, options)

    def info(self) -> dict[str, Any]:
        return {**node_here(), "name": self.trainer.name, "batch_forward": bool(self.trainer.batch_forward),
                "records_weights": bool(getattr(self.trainer, "records_weights", False))}

    def call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        return getattr(self.trainer, method)(*args, **kwargs)

    def export_weights(self) -> tuple[dict[str, Any], dict[str, Any]]:
        w = {k: v.detach().to("cpu").contiguous() for k, v in self.trainer.export_weights().items()}
        return {"tensors": len(w)}, w

    def close(self) -> None:
        self.trainer.close()


class RayTrainer(Closing):
    """A registered trainer in a Ray actor, with the :class:`~r3lab.trainers.base.Trainer` calls.

    ``timeout_s`` bounds every call; ``timeouts``: the fixed waits (:class:`~r3lab.cluster.waits.RayTimeouts`: a dead
    peer's grace, the polite close)."""

    def __init__(self, name: str, path: str | os.PathLike, options: TrainerOptions, *, cluster: str = "ray",
                 resources: str | Mapping[str, Any] | None = None, timeout_s: float = 300.0,
                 timeouts: RayTimeouts = RAY_TIMEOUTS):
        import ray

        connect(cluster)
        self.timeout_s = float(timeout_s)
        self.timeouts = timeouts
        self.resources = parse_resources(resources, what="--trainer-resources")
        check_placeable(self.resources, what="the trainer actor")
        self._closed = False
        self.member = Member(None, f"r3lab-trainer-{name}-{uuid.uuid4().hex[:8]}")
        self.member.handle = ray.remote(TrainerHost).options(
            name=self.member.name, max_restarts=0, max_concurrency=1, **actor_options(self.resources)
        ).remote(name, str(path), options)
        try:
            info = self._get(self.member.handle.info.remote(), "start")
        except BaseException:
            self.close()
            raise
        self.member.node_id, self.member.ip, self.member.pid = info["node_id"], info["ip"], info["pid"]
        self.name, self.batch_forward = info["name"], info["batch_forward"]
        self.records_weights = bool(info["records_weights"])  # score(record_weights=True), as the trainer it hosts

    @property
    def node_ids(self) -> list[str]:
        return [self.member.node_id]

    def _fail(self, message: str) -> ClusterError:
        self.close()
        return ClusterError(f"trainer on Ray: {message}; the trainer actor was ended")

    def _get(self, ref: Any, what: str) -> Any:
        return get_one(ref, self.member, what, self.timeout_s, self._fail, passthrough=(R3LabError,),
                       timeouts=self.timeouts)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise ClusterError(f"the trainer actor {self.member.name} is closed")
        return self._get(self.member.handle.call.remote(method, args, kwargs), method)

    def score(self, batch: Any, *, routes: Any = None, record: bool = False, entropy: bool = False,
              weights: str | None = None, **options: Any) -> Any:
        """The hosted trainer's ``score``; its own options (``record_weights``) pass through as given."""
        return self._call("score", batch, routes=routes, record=record, entropy=entropy, weights=weights, **options)

    def policy_step(self, batch: Any, update: Any, *, routes: Any = None, **options: Any) -> Any:
        """The hosted trainer's ``policy_step``; ``weights`` (R3W) and its other options pass through as given."""
        return self._call("policy_step", batch, update, routes=routes, **options)

    def export_weights(self) -> RemoteWeights:
        from r3lab.cluster.megatron import RemoteWeights  # with torch and the Megatron trainer: only when used

        calls = self.member.handle.export_weights.options(num_returns=2).remote()
        status = self._get(calls[0], "export")
        return RemoteWeights(calls[1], status, self.timeout_s)

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        self._call("load_weights", dict(weights))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.member.handle is None:
            return
        import ray

        try:
            ray.get(self.member.handle.close.remote(), timeout=self.timeouts.close_grace_s)
        except Exception:  # noqa: BLE001 - dead or stuck: killed below either way
            pass
        try:
            ray.kill(self.member.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def build_trainer(config: Any, path: Path, options: TrainerOptions) -> Any:
    """The ``ray`` trainer placement (:mod:`r3lab.cluster.placement`): trainer ``config.trainer`` on the cluster
    ``config.cluster`` names, each call bounded by ``config.cluster_timeout``. Megatron's ranks are actors in one
    placement group (one bundle of ``config.trainer_resources`` each); any other registered trainer is one actor."""
    name, resources, timeout_s = config.trainer, config.trainer_resources, config.cluster_timeout
    if trainer_spec(name).parallel_layout:
        from r3lab.cluster.megatron import RayMegatronTrainer  # torch and the Megatron trainer: only when used

        return RayMegatronTrainer(path, tp=options.tp, pp=options.pp, ep=options.ep, dp=options.dp,
                                  dtype=options.dtype, lr=options.lr, cluster=config.cluster, resources=resources,
                                  timeout_s=timeout_s, megatron_loader=options.megatron_loader)
    return RayTrainer(name, path, options, cluster=config.cluster, resources=resources, timeout_s=timeout_s)
