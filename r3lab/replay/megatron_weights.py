"""Routing-weight replay (R3W) for Megatron-core: the engine's expert ids *and* its routing weights.

Megatron's ``RouterReplay`` replays ids only: under REPLAY_FORWARD / REPLAY_BACKWARD,
``RouterReplay.get_replay_topk`` returns ``scores.gather(1, top_indices)`` and
``topk_routing_with_score_function`` turns those live scores into the weights (softmax over the gathered logits,
or sigmoid renormalized, times ``moe_router_topk_scaling_factor``; megatron-core 0.16.1,
``transformer/moe/router_replay.py`` and ``moe_utils.py``). The weights the experts are mixed with are therefore
the trainer's, recomputed at the engine's ids.

:class:`MegatronWeightReplay` (a :class:`~r3lab.replay.megatron.MegatronReplay`) patches, on the routers of the
given model only (instance attributes, removed on exit; no Megatron file is edited):

* ``router_replay.get_replay_topk``: notes which replayed ids tensor this call uses (forward target or the head of
  the backward queue), so the weights of the same micro-batch follow it through recomputation;
* ``TopKRouter.routing``: after Megatron's own routing, checks that its ``routing_map`` is exactly the replayed ids
  (no token dropping, no other path), and replaces the dense ``probs`` by the engine's weights at those ids.

``weights="stop"`` (R3W, as prime-rl #3509 "Total Router Recall", PrimeIntellect-ai/prime-rl, open, read
2026-12-02: "Recorded coefficients are constants. The normal gradient through the router and its input-dependent
coefficients is removed; expert paths remain trainable. This is not a straight-through estimator"): the engine's
weights are constants; the live probs stay on the graph multiplied by zero, so the auxiliary-loss scaler Megatron
attached to them still injects its gradient, but the language-model loss sends the router nothing.
``weights="straight"``: the engine's weights forward, the live probs' gradient backward
(``w_engine + probs - probs.detach()``), so the router keeps learning from the loss.

Guards (:func:`check_megatron_router`): ``TopKRouter.routing`` must still call
``topk_routing_with_score_function(..., router_replay=self.router_replay)`` and return ``probs, routing_map``,
and ``RouterReplay.get_replay_topk`` must still gather the replayed scores; otherwise, and whenever a router's
``routing_map`` is not the replayed ids, :class:`ReplayError` is raised.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from r3lab.replay.common import ReplayError
from r3lab.replay.megatron import MegatronReplay, _megatron_classes, megatron_routers

__all__ = ["check_megatron_router", "count_weight_patches", "MEGATRON_WEIGHT_REPLAY"]

#: "stop": the engine's weights, no router gradient from the loss (R3W); "straight": straight-through
MEGATRON_WEIGHT_REPLAY = ("stop", "straight")


def check_megatron_router() -> None:
    """Raise unless Megatron's ``TopKRouter.routing`` and ``RouterReplay.get_replay_topk`` are as r3lab patches."""
    TopKRouter, RouterReplay, _ = _megatron_classes()
    src = inspect.getsource(TopKRouter.routing)
    need = ("topk_routing_with_score_function(", "router_replay=self.router_replay", "return probs, routing_map")
    missing = [s for s in need if s not in src]
    rsrc = inspect.getsource(RouterReplay.get_replay_topk)
    if "scores.gather(1, top_indices)" not in rsrc or "replay_backward_list.pop(0)" not in rsrc:
        missing.append("RouterReplay.get_replay_topk: scores.gather(1, top_indices) / replay_backward_list.pop(0)")
    if missing:
        raise ReplayError(f"megatron-core's router changed under r3lab's routing-weight replay: {missing} not found; "
                          "r3lab.replay.megatron_weights must be re-checked against this megatron-core")


class MegatronWeightReplay(MegatronReplay):
    """:class:`MegatronReplay` that also replays the engine's routing weights (module docstring).

    ``per_microbatch_weights``: one entry per micro-batch, like ``per_microbatch_routes``: float ``[tokens, top_k]``
    arrays, one per decoder router on this rank (``weights[t, j]`` belongs to ``ids[t, j]``), or ``{layer_id: array}``.
    :attr:`used` holds, per router call, the ``[tokens, top_k]`` weights the experts were mixed with
    (``{layer_id: [call 0, call 1, ...]}``), read from the dense probs the router returned.
    """

    def __init__(self, model: Any, per_microbatch_routes: Sequence[Any] | None = None,
                 per_microbatch_weights: Sequence[Any] | None = None, *, weights: str = "stop",
                 num_experts: int | None = None, orphans: str = "raise"):
        if model is None:
            raise ReplayError("routing-weight replay needs the model (its routers are patched)")
        if weights not in MEGATRON_WEIGHT_REPLAY:
            raise ReplayError(f"weights must be one of {MEGATRON_WEIGHT_REPLAY}, got {weights!r}")
        check_megatron_router()
        super().__init__(model, per_microbatch_routes, "replay", num_experts=num_experts, orphans=orphans)
        self.weights = weights
        self._wqueue = list(per_microbatch_weights) if per_microbatch_weights is not None else []
        self._wnext = 0
        self._by_ids: dict[int, torch.Tensor] = {}  # id(replayed ids tensor) -> its weights
        self._current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._patched: list[tuple[Any, str]] = []
        self.used: dict[int, list[torch.Tensor]] = {g: [] for g in self.layer_ids}

    def _validated_weights(self, weights: Any, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        if isinstance(weights, Mapping):
            keys = sorted(int(k) for k in weights)
            if keys != self.layer_ids:
                raise ReplayError(f"weights given for layers {keys}; this rank's MoE routers are {self.layer_ids}")
            weights = [weights[g] for g in self.layer_ids]
        if len(weights) != len(ids):
            raise ReplayError(f"{len(weights)} weight tensors for {len(ids)} routers (layers {self.layer_ids})")
        out = []
        for g, w, t in zip(self.layer_ids, weights, ids, strict=True):
            wt = torch.as_tensor(np.asarray(w) if not torch.is_tensor(w) else w)
            if not wt.is_floating_point() or tuple(wt.shape) != tuple(t.shape):
                raise ReplayError(f"layer {g}: weights must be float {tuple(t.shape)} like its ids, got "
                                  f"{wt.dtype} {tuple(wt.shape)}")
            if not torch.isfinite(wt).all():
                raise ReplayError(f"layer {g}: a routing weight is not finite")
            out.append(wt.float())
        return out

    def begin_microbatch(self, routes: Any = None, *, weights: Any = None, forward_only: bool = False,
                         mtp_routes: Any = None) -> None:
        """As :meth:`MegatronReplay.begin_microbatch`, with this micro-batch's ``weights`` (or the next queued)."""
        if weights is None:
            if self._wnext >= len(self._wqueue):
                raise ReplayError(f"no routing weights for micro-batch {self._wnext}: {len(self._wqueue)} were given")
            weights = self._wqueue[self._wnext]
            self._wnext += 1
        super().begin_microbatch(routes, forward_only=forward_only, mtp_routes=mtp_routes)
        ids = [rr.target_topk_idx for rr in self._replays]
        for t, w in zip(ids, self._validated_weights(weights, ids), strict=True):
            self._by_ids[id(t)] = w

    # ---- patches ---------------------------------------------------------------------------------
    def _patch(self, obj: Any, name: str, fn: Any) -> None:
        if name in obj.__dict__:
            raise ReplayError(f"{type(obj).__name__}.{name} is already patched on this instance (nested replay?)")
        setattr(obj, name, fn)
        self._patched.append((obj, name))

    def _install(self) -> None:
        A = self._A
        for g, router in self.routers.items():
            rr = router.router_replay
            orig_topk, orig_routing = rr.get_replay_topk, router.routing

            def get_replay_topk(scores: Any, *args: Any, _g: int = g, _rr: Any = rr, _f: Any = orig_topk,
                                **kwargs: Any) -> Any:
                act = _rr.router_replay_action
                ids = _rr.target_topk_idx if act == A.REPLAY_FORWARD else (
                    _rr.replay_backward_list[0] if act == A.REPLAY_BACKWARD and _rr.replay_backward_list else None)
                if ids is None:
                    raise ReplayError(f"layer {_g}: routing-weight replay ran without replayed ids (action {act})")
                w = self._by_ids.get(id(ids))
                if w is None:
                    raise ReplayError(f"layer {_g}: no routing weights for the replayed ids of this micro-batch")
                self._current[_g] = (ids, w)
                return _f(scores, *args, **kwargs)

            def routing(logits: Any, *args: Any, _g: int = g, _f: Any = orig_routing, **kwargs: Any) -> Any:
                self._current.pop(_g, None)
                probs, routing_map = _f(logits, *args, **kwargs)
                got = self._current.pop(_g, None)
                if got is None:
                    raise ReplayError(f"layer {_g}: Megatron's routing did not go through RouterReplay.get_replay_topk "
                                      "(fused or sinkhorn routing, or a changed megatron-core)")
                ids, w = got
                ids = ids.to(probs.device)
                want_map = torch.zeros_like(routing_map, dtype=torch.bool).scatter_(1, ids, True)
                if not torch.equal(routing_map.bool(), want_map):
                    raise ReplayError(f"layer {_g}: Megatron's routing_map is not the replayed ids (token dropping or "
                                      "a changed router): refusing to put the engine's weights on other experts")
                engine = torch.zeros_like(probs).scatter(1, ids, w.to(device=probs.device, dtype=probs.dtype))
                new = engine + (probs - probs.detach()) * (0.0 if self.weights == "stop" else 1.0)
                self.used[_g].append(new.detach().gather(1, ids).float().clone())
                return new, routing_map

            self._patch(rr, "get_replay_topk", get_replay_topk)
            self._patch(router, "routing", routing)

    def _uninstall(self) -> None:
        while self._patched:
            obj, name = self._patched.pop()
            obj.__dict__.pop(name, None)
        self._by_ids.clear()
        self._current.clear()

    def __enter__(self) -> MegatronWeightReplay:
        super().__enter__()
        try:
            self._install()
        except BaseException:
            self._uninstall()
            super().__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._uninstall()
        finally:
            super().__exit__(*exc)


def count_weight_patches(model: Any) -> int:
    """Routers and RouterReplays of ``model`` that carry an r3lab weight-replay patch (0 outside the context)."""
    routers, _ = megatron_routers(model)
    return sum(("routing" in r.__dict__) + ("get_replay_topk" in r.router_replay.__dict__) for r in routers.values())


@contextmanager
def megatron_weight_replay(model: Any, per_microbatch_routes: Sequence[Any] | None = None,
                           per_microbatch_weights: Sequence[Any] | None = None, *, weights: str = "stop",
                           num_experts: int | None = None, orphans: str = "raise") -> Iterator[MegatronWeightReplay]:
    """Context manager form of :class:`MegatronWeightReplay`; every patch, action and id is undone on exit."""
    with MegatronWeightReplay(model, per_microbatch_routes, per_microbatch_weights, weights=weights,
                              num_experts=num_experts, orphans=orphans) as rep:
        yield rep
