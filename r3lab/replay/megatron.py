"""Routing replay for Megatron-core (>= 0.16, ``moe_enable_routing_replay=True``).

:func:`megatron_replay` / :class:`MegatronReplay` drive
``megatron.core.transformer.moe.router_replay.RouterReplay`` around a training step, one micro-batch at
a time, router by router: only the RouterReplay instances of the given model are set, read and cleared,
so the routers of another live model (a reference model, say) keep their state.

Layer ids are the 0-based global decoder-layer index (as in :class:`r3lab.routes.Routes`); Megatron's
1-based ``layer_number`` ``n`` is layer id ``n - 1``.

One training step (works with or without activation recomputation)::

    with megatron_replay(model, per_microbatch_routes) as rep:   # routes: shard() output per micro-batch
        forward_backward_func(forward_step_func=rep.wrap_forward_step(forward_step), ...)

or drive it by hand: ``rep.begin_microbatch()`` before each micro-batch forward, ``rep.after_forward()``
right after it (switches to REPLAY_BACKWARD so a recomputation in backward pops the same ids).
megatron-core is imported when a replay is built, not when this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from r3lab.replay.common import ReplayError, check_route_tensor

__all__ = ["MegatronReplay", "megatron_replay", "megatron_routers", "find_orphaned_router_replays"]


def _megatron_classes() -> tuple[Any, Any, Any]:
    try:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    except ImportError as e:  # pragma: no cover - megatron-core is a dependency of the trainer side
        raise ReplayError("the Megatron backend needs megatron-core >= 0.16 (RouterReplay)") from e
    return TopKRouter, RouterReplay, RouterReplayAction


def _chunks(model: Any) -> list[torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return [model]
    if isinstance(model, Sequence) and all(isinstance(m, torch.nn.Module) for m in model):
        return list(model)
    raise ReplayError(f"model must be a torch module or a list of model chunks, got {type(model).__name__}")


def megatron_routers(model: Any) -> tuple[dict[int, Any], list[Any]]:
    """The ``TopKRouter`` modules of a Megatron model (or list of VPP chunks).

    Returns ``({layer_id: decoder router}, [MTP routers])``; layer ids are 0-based global
    (``layer_number - 1``), ascending. MTP routers (under an ``mtp`` submodule) are not decoder routers.
    """
    TopKRouter, _, _ = _megatron_classes()
    decoder: dict[int, Any] = {}
    mtp: list[Any] = []
    for chunk in _chunks(model):
        for name, mod in chunk.named_modules():
            if not isinstance(mod, TopKRouter):
                continue
            if "mtp" in name.split("."):
                mtp.append(mod)
                continue
            if mod.layer_number is None:
                raise ReplayError(f"router {name!r} has no layer_number (built outside a TransformerLayer?)")
            g = int(mod.layer_number) - 1
            if g in decoder:
                raise ReplayError(f"two decoder routers claim layer id {g} (layer_number {g + 1})")
            decoder[g] = mod
    return dict(sorted(decoder.items())), mtp


def find_orphaned_router_replays(model: Any) -> list[Any]:
    """RouterReplay instances in Megatron's global registry that belong to no router of ``model``.

    They come from earlier model builds (the registry is a class-level list that is never pruned) and
    make ``RouterReplay.set_replay_data`` fail or, worse, hand the wrong tensor to each router.
    """
    _, RouterReplay, _ = _megatron_classes()
    dec, mtp = megatron_routers(model)
    mine = {id(r.router_replay) for r in [*dec.values(), *mtp] if r.router_replay is not None}
    return [rr for rr in RouterReplay.global_router_replay_instances if id(rr) not in mine]


class MegatronReplay:
    """Routing replay (or recording) for a Megatron-core model during one training step.

    Args:
        model: the model, a list of its VPP chunks, or ``None`` to drive the global registry blindly
            (then no config, orphan or per-layer checks are possible, ``num_experts`` is required, and every
            instance in the registry is set and, on exit, cleared).
        per_microbatch_routes: for ``mode="replay"``, one entry per micro-batch, each a list of int
            ``[tokens, top_k]`` arrays (one per decoder router on this rank, increasing global layer
            order, i.e. ``r3lab.slicing.shard()`` output) or a mapping ``{layer_id: array}``. May be
            omitted and passed to :meth:`begin_microbatch` instead.
        mode: ``"replay"`` (REPLAY_FORWARD, then REPLAY_BACKWARD after each forward) or ``"record"``.
        num_experts: checked against the model's config when both are known.
        orphans: what to do with RouterReplay instances in the global registry that belong to no router of
            ``model`` (earlier model builds): ``"raise"`` (default), ``"prune"`` (drop them from the registry)
            or ``"ignore"`` (a second live model, e.g. a reference model, legitimately owns them; this class
            sets and clears ids per router, so they never receive this model's ids and keep their own state).
    """

    def __init__(
        self,
        model: Any,
        per_microbatch_routes: Sequence[Any] | None = None,
        mode: str = "replay",
        *,
        num_experts: int | None = None,
        orphans: str = "raise",
    ):
        _, self._RR, self._A = _megatron_classes()
        if mode not in ("replay", "record"):
            raise ReplayError(f"mode must be 'replay' or 'record', got {mode!r}")
        if mode == "record" and per_microbatch_routes is not None:
            raise ReplayError("mode='record' takes no routes")
        self.mode = mode
        self.recorded: list[dict[int, torch.Tensor]] = []
        self._queue = list(per_microbatch_routes) if per_microbatch_routes is not None else []
        self._next = 0
        self._hooks: list[Any] = []
        self._active = False
        if model is None:
            if num_experts is None:
                raise ReplayError("num_experts is required when model is None")
            self.routers: dict[int, Any] = {}
            self._replays = list(self._RR.global_router_replay_instances)
            self.num_experts, self.top_k = int(num_experts), None
        else:
            self.routers = self._check_model(model, num_experts, orphans)
            self._replays = [r.router_replay for r in self.routers.values()]
            cfg = next(iter(self.routers.values())).config
            self.num_experts, self.top_k = int(cfg.num_moe_experts), int(cfg.moe_router_topk)
        if not self._replays:
            raise ReplayError("no RouterReplay instance: build the model with moe_enable_routing_replay=True")
        self.layer_ids = list(self.routers) or list(range(len(self._replays)))

    def _check_model(self, model: Any, num_experts: int | None, orphans: str) -> dict[int, Any]:
        if orphans not in ("raise", "prune", "ignore"):
            raise ReplayError(f"orphans must be 'raise', 'prune' or 'ignore', got {orphans!r}")
        routers, mtp = megatron_routers(model)
        if not routers:
            raise ReplayError("the model has no MoE TopKRouter")
        for g, r in [*routers.items(), *((None, m) for m in mtp)]:
            where = f"layer {g}" if g is not None else "MTP router"
            cfg = r.config
            if r.router_replay is None:
                raise ReplayError(f"{where}: no RouterReplay; build the model with moe_enable_routing_replay=True")
            if cfg.moe_router_fusion:
                raise ReplayError(f"{where}: moe_router_fusion=True uses the fused top-k, which ignores RouterReplay")
            if r.routing_type == "sinkhorn":
                raise ReplayError(f"{where}: sinkhorn routing bypasses RouterReplay; replay would be silently ignored")
            if num_experts is not None and int(cfg.num_moe_experts) != int(num_experts):
                raise ReplayError(f"{where}: model has {cfg.num_moe_experts} experts, num_experts={num_experts}")
        registry = self._RR.global_router_replay_instances
        found = find_orphaned_router_replays(model)
        if found and orphans == "raise":
            raise ReplayError(
                f"{len(found)} orphaned RouterReplay instance(s) in the global registry ({len(registry)} in all, "
                f"{len(routers) + len(mtp)} routers in this model): routers of an earlier model build. Call "
                "RouterReplay.clear_global_router_replay_instances() before building, pass orphans='prune' to drop "
                "them, or orphans='ignore' if another live model owns them"
            )
        if found and orphans == "prune":
            # upstream leaves no choice: RouterReplay can only clear the whole registry, not drop one instance
            registry[:] = [rr for rr in registry if all(rr is not o for o in found)]
        reg_ids = {id(rr) for rr in registry}
        missing = [g for g, r in routers.items() if id(r.router_replay) not in reg_ids]
        if missing:
            raise ReplayError(
                f"routers of layers {missing} are not in RouterReplay's global registry "
                "(was clear_global_router_replay_instances() called after building the model?)"
            )
        return routers

    # ---- per micro-batch ---------------------------------------------------------------------
    def _validated(self, routes: Any) -> list[torch.Tensor]:
        n = len(self._replays)
        if isinstance(routes, Mapping):
            keys = sorted(int(k) for k in routes)
            if keys != self.layer_ids:
                raise ReplayError(f"ids given for layers {keys}; this rank's MoE routers are layers {self.layer_ids}")
            routes = [routes[g] if g in routes else routes[str(g)] for g in self.layer_ids]
        elif isinstance(routes, (str, bytes)) or not isinstance(routes, Sequence):
            raise ReplayError(
                f"micro-batch routes must be a list or mapping of per-router ids, got {type(routes).__name__}"
            )
        if len(routes) != n:
            raise ReplayError(f"{len(routes)} id tensors for {n} routers on this rank (layers {self.layer_ids})")
        out, tokens = [], None
        for g, ids in zip(self.layer_ids, routes, strict=True):
            t = check_route_tensor(
                ids, top_k=self.top_k, num_experts=self.num_experts, what=f"layer {g}", allow_3d=False
            )
            if tokens is not None and t.shape[0] != tokens:
                raise ReplayError(f"layer {g} has {t.shape[0]} token rows, layer {self.layer_ids[0]} has {tokens}")
            tokens = t.shape[0]
            out.append(t)
        return out

    def _set_action(self, action: Any) -> None:
        for rr in self._replays:
            rr.set_router_replay_action(action)

    def begin_microbatch(self, routes: Any = None, *, forward_only: bool = False) -> None:
        """Call before each micro-batch forward.

        Replay: validate this micro-batch's ids (``routes``, or else the next not yet used entry of
        ``per_microbatch_routes``), hand
        them to the routers and set REPLAY_FORWARD. ``forward_only=True`` (no backward follows, e.g. old
        log-probs) drops the entry again from the REPLAY_BACKWARD queue so no stale ids reach a later
        recomputation. Record: set RECORD.
        """
        self._require_active()
        if self.mode == "record":
            if routes is not None:
                raise ReplayError("mode='record' takes no routes")
            self._set_action(self._A.RECORD)
            return
        if routes is None:
            if self._next >= len(self._queue):
                raise ReplayError(f"no routes for micro-batch {self._next}: {len(self._queue)} were given")
            routes = self._queue[self._next]
            self._next += 1
        tensors = self._validated(routes)
        for rr, t in zip(self._replays, tensors, strict=True):
            rr.set_target_indices(t)  # what RouterReplay.set_replay_data does, but in *this model's* layer order
            if forward_only:
                # upstream leaves no choice: set_target_indices always queues the ids for REPLAY_BACKWARD and
                # RouterReplay has no public way to set only the forward target or to drop one queued entry
                queue = rr.replay_backward_list
                if not queue or queue[-1] is not t:
                    raise ReplayError("RouterReplay.set_target_indices did not queue the ids (megatron-core changed?)")
                queue.pop()
        self._set_action(self._A.REPLAY_FORWARD)

    def after_forward(self) -> dict[int, torch.Tensor] | None:
        """Call right after each micro-batch forward (before its backward).

        Replay: switch to REPLAY_BACKWARD so a recomputation pops the ids of the micro-batch it recomputes.
        Record: collect and return ``{layer_id: int64 [tokens, top_k]}`` (also appended to :attr:`recorded`).
        """
        self._require_active()
        if self.mode == "replay":
            self._set_action(self._A.REPLAY_BACKWARD)
            return None
        got = {}
        for g, rr in zip(self.layer_ids, self._replays, strict=True):
            idx = rr.get_recorded_indices()
            if idx is None:
                raise ReplayError(f"layer {g} recorded nothing: did its router run (fused or sinkhorn routing)?")
            got[g] = idx.detach().to(torch.int64).clone()
        self.recorded.append(got)
        return got

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        """Wrap a Megatron ``forward_step_func`` so each call brackets its forward with begin/after."""

        def step(*args: Any, **kwargs: Any) -> Any:
            self.begin_microbatch()
            out = forward_step_func(*args, **kwargs)
            self.after_forward()
            return out

        return step

    # ---- context -----------------------------------------------------------------------------
    def _require_active(self) -> None:
        if not self._active:
            raise ReplayError("MegatronReplay is not active: use it as a context manager")

    def _check_tokens(self, g: int, rr: Any) -> Callable:
        A = self._A

        def pre_hook(module: Any, args: Any, kwargs: Any) -> None:
            x = args[0] if args else kwargs["input"]
            tokens = x.numel() // x.shape[-1]
            act = rr.router_replay_action
            if act == A.REPLAY_FORWARD:
                want = rr.target_topk_idx
            elif act == A.REPLAY_BACKWARD:
                if not rr.replay_backward_list:
                    raise ReplayError(
                        f"layer {g}: REPLAY_BACKWARD with an empty queue (more recomputations than micro-batches)"
                    )
                want = rr.replay_backward_list[0]
            else:
                return
            if want is None or want.shape[0] != tokens:
                rows = None if want is None else want.shape[0]
                raise ReplayError(f"layer {g}: replay ids have {rows} token rows but the router sees {tokens} tokens")

        return pre_hook

    def __enter__(self) -> MegatronReplay:
        for rr in self._replays:
            rr.clear_indices()
        for g, r in self.routers.items():  # empty without a model: then Megatron's own errors apply
            self._hooks.append(r.register_forward_pre_hook(self._check_tokens(g, r.router_replay), with_kwargs=True))
        self._active = True
        if self.mode == "record":
            self._set_action(self._A.RECORD)
        return self

    def __exit__(self, *exc: Any) -> None:
        # undo exactly what this context set: its own routers' actions and ids, through RouterReplay's public
        # per-instance methods; the rest of the global registry (another live model's routers) is left alone
        self._active = False
        while self._hooks:
            self._hooks.pop().remove()
        for rr in self._replays:
            rr.clear_router_replay_action()
            rr.clear_indices()


@contextmanager
def megatron_replay(
    model: Any,
    per_microbatch_routes: Sequence[Any] | None = None,
    mode: str = "replay",
    *,
    num_experts: int | None = None,
    orphans: str = "raise",
) -> Iterator[MegatronReplay]:
    """Context manager form of :class:`MegatronReplay`; this model's actions, ids and hooks are cleared on exit."""
    with MegatronReplay(model, per_microbatch_routes, mode, num_experts=num_experts, orphans=orphans) as rep:
        yield rep
