"""The rollout engine as a Ray actor placed by resources: :class:`RayEngine`, the same calls as ``RolloutEngine``.

The actor hosts an unchanged :class:`~r3lab.rollout.RolloutEngine` (vLLM in the actor's process, as in-process
here; CUDA vLLM on a GPU node, ``--engine-resources '{"GPU": 1}'``). ``generate`` and ``score`` results (tokens,
log-probs, validated routes) come back to the driver or notebook through Ray's object store. ``update_weights``
takes either a mapping of tensors or a :class:`~r3lab.cluster.megatron.RemoteWeights`, the trainer ranks' export
left in the object store: then only its reference crosses the driver and the engine actor fetches the weights
from the rank's node itself. Every call waits at most ``timeout_s``; an engine actor that dies or hangs raises
:class:`~r3lab.errors.ClusterError` naming it and its node, and the actor is ended.

Seeds, kernels and inputs are the local engine's: the same flags give the same tokens and routes bit for bit
(``tests/test_cluster.py``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from r3lab._process import Closing
from r3lab.cluster.connect import actor_options, check_placeable, connect, node_here, parse_resources
from r3lab.cluster.waits import RAY_TIMEOUTS, Member, RayTimeouts, get_one
from r3lab.errors import ClusterError, R3LabError

__all__ = ["EngineHost"]


class EngineHost:
    """What runs inside the engine actor: one :class:`~r3lab.rollout.RolloutEngine` and its calls."""

    def __init__(self, model: str, options: dict[str, Any]):
        from r3lab.rollout import RolloutEngine

        self.engine = RolloutEngine(model, **options)

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {**node_here(), "device": e.device, "engine_quant": e.engine_quant, "max_model_len": e.max_model_len,
                "captures_weights": e.captures_weights,
                "start_seconds": e.start_seconds, "weight_version": e.weight_version}

    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Any, sampling: Any, kwargs: dict[str, Any]) -> Any:
        return self.engine.generate(prompts, sampling, **kwargs)

    def score(self, sequences: Any, start: Any) -> Any:
        return self.engine.score(sequences, start=start)

    def encode_prompts(self, prompts: Any, max_tokens: int) -> Any:
        return self.engine.encode_prompts(prompts, max_tokens)

    def update_weights(self, weights: Mapping[str, Any], version: int | None) -> int:
        return self.engine.update_weights(weights, version=version)

    def prefix_cache(self) -> dict[str, Any]:
        return self.engine.prefix_cache()

    def close(self) -> None:
        self.engine.close()


class RayEngine(Closing):
    """A :class:`~r3lab.rollout.RolloutEngine` in a Ray actor: ``generate``, ``score``, ``update_weights``,
    ``tokenizer``, ``weight_version``, ``engine_quant`` as the local engine has them.

    ``resources``: what the actor needs, JSON or a mapping (``{"GPU": 1}``; default one CPU), checked against the
    cluster's nodes before anything waits. ``cluster``: as :func:`~r3lab.cluster.connect`. ``timeout_s`` bounds
    every call, ``start_timeout_s`` the placement and the engine's start; ``timeouts``: the fixed waits
    (:class:`~r3lab.cluster.waits.RayTimeouts`: a dead peer's grace, the polite close). ``engine_kwargs`` go to
    ``RolloutEngine`` unchanged (``seed``, ``dtype``, ``engine_quant``, vLLM's parallel settings).
    """

    def __init__(self, model: str | os.PathLike, *, resources: str | Mapping[str, Any] | None = None,
                 cluster: str = "ray", timeout_s: float = 300.0, start_timeout_s: float = 600.0,
                 name: str | None = None, timeouts: RayTimeouts = RAY_TIMEOUTS, **engine_kwargs: Any):
        import ray

        connect(cluster)
        self.model_dir = Path(model)
        self.timeout_s = float(timeout_s)
        self.timeouts = timeouts
        self.resources = parse_resources(resources, what="--engine-resources")
        check_placeable(self.resources, what="the engine actor")
        self._closed = False
        self.member = Member(None, name or f"r3lab-engine-{uuid.uuid4().hex[:8]}")
        self.member.handle = ray.remote(EngineHost).options(
            name=self.member.name, max_restarts=0, max_concurrency=1, **actor_options(self.resources)
        ).remote(str(self.model_dir), dict(engine_kwargs))
        try:
            info = self._get(self.member.handle.info.remote(), "start", float(start_timeout_s))
            self.member.node_id, self.member.ip, self.member.pid = info["node_id"], info["ip"], info["pid"]
            self.info = info
            self.device, self.engine_quant = info["device"], info["engine_quant"]
            self.max_model_len, self.start_seconds = info["max_model_len"], info["start_seconds"]
            self.weight_version = int(info["weight_version"])
            self.captures_weights = bool(info["captures_weights"])
            self.tokenizer = self._get(self.member.handle.tokenizer.remote(), "tokenizer", self.timeout_s)
        except BaseException:
            self.close()
            raise

    #: ``update_weights`` loads weights in the actor (:attr:`r3lab.rollout.base.Engine.weights_refusal`)
    weights_refusal: str | None = None

    def facts(self) -> dict[str, Any]:
        """What a run records about this engine: vLLM in a Ray actor, its node and the resources it asked for."""
        return {"ray": "r3lab.cluster.RayEngine", "node_id": self.member.node_id, "resources": dict(self.resources)}

    # ---- plumbing ------------------------------------------------------------------------------
    @property
    def node_id(self) -> str:
        """The Ray node the engine actor runs on."""
        return self.member.node_id

    def _fail(self, message: str) -> ClusterError:
        self.close()
        return ClusterError(f"rollout engine on Ray ({self.model_dir.name}): {message}; the engine actor was ended")

    def _get(self, ref: Any, what: str, timeout: float | None = None) -> Any:
        return get_one(ref, self.member, what, self.timeout_s if timeout is None else timeout, self._fail,
                       passthrough=(R3LabError,), timeouts=self.timeouts)

    def _actor(self) -> Any:
        if self._closed:
            raise ClusterError(f"the engine actor {self.member.name} is closed")
        return self.member.handle

    def close(self) -> None:
        """End the actor (vLLM shut down politely first, within ``timeouts.close_grace_s``); idempotent."""
        if self._closed:
            return
        self._closed = True
        handle = self.member.handle
        if handle is None:
            return
        import ray

        try:
            ray.get(handle.close.remote(), timeout=self.timeouts.close_grace_s)
        except Exception:  # noqa: BLE001 - dead or stuck: killed below either way
            pass
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    # ---- the engine's calls -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Any], sampling: Any = None, *, routes_prompt_start: Any = 0,
                 progress: bool | None = None) -> list[Any]:
        """``RolloutEngine.generate`` in the actor; results (routes included) through the object store."""
        kwargs = {"routes_prompt_start": routes_prompt_start, "progress": False if progress is None else progress}
        return self._get(self._actor().generate.remote(list(prompts), sampling, kwargs), "generate")

    def score(self, sequences: Sequence[Sequence[int]], *, start: Any = 1) -> list[Any]:
        return self._get(self._actor().score.remote([list(q) for q in sequences], start), "score")

    def encode_prompts(self, prompts: Sequence[Any], max_tokens: int = 1) -> list[list[int]]:
        return self._get(self._actor().encode_prompts.remote(list(prompts), max_tokens), "encode_prompts")

    def prefix_cache(self) -> dict[str, Any]:
        return self._get(self._actor().prefix_cache.remote(), "prefix_cache")

    def update_weights(self, state_dict: Mapping[str, Any], *, version: int | None = None) -> int:
        """Load weights into the engine actor. A :class:`~r3lab.cluster.megatron.RemoteWeights` passes by reference
        (the actor fetches the ranks' export from the object store); a mapping of tensors is put there first."""
        import ray

        ref = getattr(state_dict, "ref", None)
        if ref is None:
            if not isinstance(state_dict, Mapping) or not state_dict:
                raise ClusterError("update_weights needs a non-empty mapping of parameter name -> tensor")
            ref = ray.put(dict(state_dict))
        self.weight_version = int(self._get(self._actor().update_weights.remote(ref, version), "update_weights"))
        return self.weight_version

    @staticmethod
    def stack_routes(results: Sequence[Any]) -> Any:
        from r3lab.rollout import stack_routes

        return stack_routes(results)


def build_engine(config: Any, path: Path, options: dict[str, Any]) -> RayEngine:
    """The ``ray`` engine placement (:mod:`r3lab.cluster.placement`): a :class:`RayEngine` on the cluster
    ``config.cluster`` names, placed by ``config.engine_resources``, every call bounded by ``config.cluster_timeout``;
    ``options`` go to the ``RolloutEngine`` in the actor."""
    return RayEngine(path, resources=config.engine_resources, cluster=config.cluster, timeout_s=config.cluster_timeout,
                     **options)
