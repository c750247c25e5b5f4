"""Routing replay for Megatron-core (0.16.1 to 0.19.x, ``moe_enable_routing_replay=True``).

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

Multi-token prediction (``mtp_num_layers``): what ``RouterReplay`` registers, measured by ``tests/test_mtp.py`` on
the tiny Qwen3-MoE shape (8 MoE decoder layers, ``mtp_num_layers=1``): **nine** instances, one per ``TopKRouter`` in
construction order (``TopKRouter.__init__`` creates one per router, ``RouterReplay.__init__`` appends it to the
class-level list): decoder layers 0..7 first, then the MTP router (``GPTModel.__init__`` builds the decoder, then the
MTP block). Their ``layer_number``: decoder layer ``i`` is ``i + 1``; the MTP layer (``MultiTokenPredictionLayer``)
is numbered from 1; its router is ``num_layers + k`` at megatron-core 0.16.1 (9 here) and ``k`` at 0.19.2 (1 here,
the number of decoder layer 0; :mod:`r3lab.replay.mcore_api` lists this and the other changes between releases).
NeMo-RL met the second numbering on Megatron-LM main (#4057 review) and skips MTP routers by default
(#3903). ``layer_number`` and list position are release-dependent ways to find a router, so this
module finds routers by *where they are*: :func:`megatron_router_map` takes the decoder's routers from its
``TransformerBlock.layers`` (layer id from the decoder layer) and the MTP routers from the
``MultiTokenPredictionBlock``, refuses any other router, and checks the count against the config
(``moe_layer_freq``, ``mtp_num_layers``). :class:`MegatronReplay` feeds the decoder routers exactly the given
routes and, by ``mtp=``, leaves the MTP routers live (default: they route on their own and a guard fails if
anything sets a replay action on them), replays them from a route source of their own (``mtp_routes``) or
records them; decoder routes never reach an MTP router, and a list holding an MTP router's routes among the
decoder's is refused by its length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from r3lab.replay import mcore_api
from r3lab.replay.common import ReplayError, check_route_tensor


def _megatron_classes() -> tuple[Any, Any, Any]:
    mcore_api.check_mcore_api()  # a release outside the checked ones, or a changed internal, fails here
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

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
    (``layer_number - 1`` of the decoder layer holding the router), ascending; MTP routers in depth order.
    Found and count-checked by :func:`megatron_router_map`.
    """
    m = megatron_router_map(model)
    return dict(m.decoder), list(m.mtp.values())


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

    :param model: the model, a list of its VPP chunks, or ``None`` to drive the global registry blindly
        (then no config, orphan or per-layer checks are possible, ``num_experts`` is required, and every
        instance in the registry is set and, on exit, cleared).
    :param per_microbatch_routes: for ``mode="replay"``, one entry per micro-batch, each a list of int
        ``[tokens, top_k]`` arrays (one per decoder router on this rank, increasing global layer
        order, i.e. ``r3lab.slicing.shard()`` output) or a mapping ``{layer_id: array}``. May be
        omitted and passed to :meth:`begin_microbatch` instead.
    :param mode: ``"replay"`` (REPLAY_FORWARD, then REPLAY_BACKWARD after each forward) or ``"record"``.
    :param num_experts: checked against the model's config when both are known.
    :param orphans: what to do with RouterReplay instances in the global registry that belong to no router of
        ``model`` (earlier model builds): ``"raise"`` (default), ``"prune"`` (drop them from the registry)
        or ``"ignore"`` (a second live model, e.g. a reference model, legitimately owns them; this class
        sets and clears ids per router, so they never receive this model's ids and keep their own state).
    :param mtp: what the MTP routers (``mtp_num_layers``) do, one of :data:`MTP_MODES`: ``"live"`` (default: they
        route on their own, as NeMo-RL does by default (#3903), and a guard raises if anything sets a replay
        action on them), ``"replay"`` (mode replay: from ``mtp_routes``) or ``"record"`` (mode record: their
        own routes, in :attr:`recorded_mtp`). Decoder routes never reach an MTP router in any mode.
    :param mtp_routes: for ``mtp="replay"``, the MTP routers' own route source, one entry per micro-batch, each a
        list of int ``[tokens, top_k]`` arrays (one per MTP router, depth order) or ``{depth: array}``: e.g.
        the MTP layers' rows an importer set apart, or the trainer's own recorded with ``mtp="record"``.
    """

    def __init__(
        self,
        model: Any,
        per_microbatch_routes: Sequence[Any] | None = None,
        mode: str = "replay",
        *,
        num_experts: int | None = None,
        orphans: str = "raise",
        mtp: str = "live",
        mtp_routes: Sequence[Any] | None = None,
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
        self._mtp = _MTPReplay(self, model, mtp, mtp_routes)

    @property
    def recorded_mtp(self) -> list[dict[int, torch.Tensor]]:
        """With ``mtp="record"``: ``{depth: int64 [tokens, top_k]}`` per micro-batch, the MTP routers' own routes."""
        return self._mtp.recorded

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
            bypass = mcore_api.replay_bypass(r)
            if bypass is not None:
                raise ReplayError(f"{where}: {bypass}")
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
            n_mtp = len(self._mtp.routers)
            hint = ""
            if n_mtp and len(routes) == n + n_mtp:
                hint = (f": {n} decoder routers plus {n_mtp} MTP routers? Decoder layers get the decoder's routes "
                        "only; pass the MTP routers' own as mtp_routes with mtp='replay'")
            raise ReplayError(f"{len(routes)} id tensors for {n} routers on this rank (layers {self.layer_ids}){hint}")
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

    def begin_microbatch(self, routes: Any = None, *, forward_only: bool = False, mtp_routes: Any = None) -> None:
        """Call before each micro-batch forward.

        Replay: validate this micro-batch's ids (``routes``, or else the next not yet used entry of
        ``per_microbatch_routes``), hand
        them to the routers and set REPLAY_FORWARD. ``forward_only=True`` (no backward follows, e.g. old
        log-probs) drops the entry again from the REPLAY_BACKWARD queue so no stale ids reach a later
        recomputation. Record: set RECORD. ``mtp_routes``: this micro-batch's MTP ids (``mtp="replay"``; else the
        next entry of the constructor's ``mtp_routes``).
        """
        self._require_active()
        if self.mode == "record":
            if routes is not None:
                raise ReplayError("mode='record' takes no routes")
            self._set_action(self._A.RECORD)
            self._mtp.begin(mtp_routes, forward_only)
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
        self._mtp.begin(mtp_routes, forward_only)

    def after_forward(self) -> dict[int, torch.Tensor] | None:
        """Call right after each micro-batch forward (before its backward).

        Replay: switch to REPLAY_BACKWARD so a recomputation pops the ids of the micro-batch it recomputes.
        Record: collect and return ``{layer_id: int64 [tokens, top_k]}`` (also appended to :attr:`recorded`).
        """
        self._require_active()
        self._mtp.after_forward()
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

    def _check_tokens(self, g: int | str, rr: Any) -> Callable:
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
        self._mtp.enter()
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
        self._mtp.exit()


@contextmanager
def megatron_replay(
    model: Any,
    per_microbatch_routes: Sequence[Any] | None = None,
    mode: str = "replay",
    *,
    num_experts: int | None = None,
    orphans: str = "raise",
    mtp: str = "live",
    mtp_routes: Sequence[Any] | None = None,
) -> Iterator[MegatronReplay]:
    """Context manager form of :class:`MegatronReplay`; this model's actions, ids and hooks are cleared on exit."""
    with MegatronReplay(model, per_microbatch_routes, mode, num_experts=num_experts, orphans=orphans, mtp=mtp,
                        mtp_routes=mtp_routes) as rep:
        yield rep


# ---- MTP: the routers after the decoder -------------------------------------------------------------------------
MTP_MODES = ("live", "replay", "record")
"""What :class:`MegatronReplay` does with the MTP routers: ``live`` (route on their own), ``replay`` (from
``mtp_routes``), ``record`` (their own routes, in ``recorded_mtp``)."""


@dataclass(frozen=True)
class MegatronRouterMap:
    """Where each ``TopKRouter`` of a Megatron model sits (this rank), found by module identity, never by position.

    ``decoder``: ``{layer id: router}``, the router of ``TransformerBlock.layers[i]`` under the id of that decoder
    layer (``layer.layer_number - 1``, global under PP/VPP). ``mtp``: ``{depth: router}``, the router of the MTP
    block's layer ``depth`` (``MultiTokenPredictionLayer.layer_number - 1``). ``dense``: decoder layer ids on this
    rank without a router. ``mtp_layers``: MTP layers on this rank (with or without a router).
    """

    decoder: dict[int, Any]
    mtp: dict[int, Any]
    dense: tuple[int, ...] = ()
    mtp_layers: int = 0

    def replays(self) -> list[Any]:
        """Every router's ``RouterReplay`` instance: decoder layers ascending, then MTP depths."""
        return [r.router_replay for r in [*self.decoder.values(), *self.mtp.values()]]


def _layer_router(layer: Any, TopKRouter: Any, where: str) -> Any:
    r = getattr(getattr(layer, "mlp", None), "router", None)
    if r is None:
        return None
    if not isinstance(r, TopKRouter):
        raise ReplayError(f"{where}: router is a {type(r).__name__}, not a TopKRouter (RouterReplay needs TopKRouter)")
    if r.layer_number != layer.layer_number:  # TransformerLayer.__init__ hands its number to the MLP
        raise ReplayError(
            f"{where}: router layer_number {r.layer_number} differs from its layer's {layer.layer_number} "
            "(megatron-core changed how routers are numbered?)"
        )
    return r


def _moe_pattern(config: Any) -> list[int]:
    """Megatron's ``moe_layer_freq`` as one 0/1 per decoder layer (as ``get_gpt_decoder_block_spec`` reads it)."""
    f, n = config.moe_layer_freq, int(config.num_layers)
    if isinstance(f, int):
        return [1 if i % f == 0 else 0 for i in range(n)]
    if isinstance(f, (list, tuple)) and len(f) == n:
        return [int(x) for x in f]
    raise ReplayError(f"moe_layer_freq={f!r} is neither an int nor a list of {n} entries")


def megatron_router_map(model: Any) -> MegatronRouterMap:
    """Find this rank's decoder and MTP routers by where they sit, and check their count against the config.

    Decoder routers are taken from each ``TransformerBlock``'s ``layers`` (so a router is matched to *its*
    decoder layer, whatever its ``layer_number`` or its place in RouterReplay's global list), MTP routers from
    each ``MultiTokenPredictionBlock``'s layers (the inner layer's ``mlp.router``, :func:`mcore_api.mtp_inner_layer`:
    ``transformer_layer`` or ``mtp_model_layer`` by release). Raises :class:`ReplayError`
    when a ``TopKRouter`` sits anywhere else, two routers claim one layer, the decoder's routed layers differ from
    ``moe_layer_freq``, the MTP block has other than ``mtp_num_layers`` layers or MTP routers, or two routers share
    one ``RouterReplay``: then the registered routers are not decoder MoE layers + MTP MoE layers.
    """
    TopKRouter, _, _ = _megatron_classes()
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
    from megatron.core.transformer.transformer_block import TransformerBlock

    decoder: dict[int, Any] = {}
    mtp: dict[int, Any] = {}
    dense: list[int] = []
    mtp_layers = 0
    config = None
    for chunk in _chunks(model):
        claimed: set[int] = set()
        for name, mod in chunk.named_modules():
            if isinstance(mod, TransformerBlock):
                config = mod.config
                for i, layer in enumerate(mod.layers):
                    g = int(layer.layer_number) - 1
                    r = _layer_router(layer, TopKRouter, f"{name}.layers.{i}")
                    if r is None:
                        dense.append(g)
                        continue
                    if g in decoder:
                        raise ReplayError(f"two decoder routers claim layer id {g} (layer_number {g + 1})")
                    decoder[g] = r
                    claimed.add(id(r))
            elif isinstance(mod, MultiTokenPredictionBlock):
                config = mod.config
                for j, layer in enumerate(mod.layers):
                    mtp_layers += 1
                    d = int(layer.layer_number) - 1
                    r = _layer_router(mcore_api.mtp_inner_layer(layer), TopKRouter, f"{name}.layers.{j} (inner layer)")
                    if r is None:
                        continue
                    if d in mtp:
                        raise ReplayError(f"two MTP routers claim depth {d}")
                    mtp[d] = r
                    claimed.add(id(r))
        stray = [n for n, m in chunk.named_modules() if isinstance(m, TopKRouter) and id(m) not in claimed]
        if stray:
            raise ReplayError(
                f"routers {stray} sit neither in the decoder's layers nor in the MTP block: r3lab cannot tell which "
                "routes they should get (it never assigns routes by a router's place in RouterReplay's list)"
            )
    rmap = MegatronRouterMap(dict(sorted(decoder.items())), dict(sorted(mtp.items())), tuple(sorted(dense)),
                             mtp_layers)
    if config is not None and config.num_moe_experts:
        _check_router_count(rmap, config)
    return rmap


def _check_router_count(rmap: MegatronRouterMap, config: Any) -> None:
    pattern = _moe_pattern(config)
    here = sorted([*rmap.decoder, *rmap.dense])
    want = [g for g in here if 0 <= g < len(pattern) and pattern[g]]
    if sorted(rmap.decoder) != want:
        raise ReplayError(
            f"decoder routers on layers {sorted(rmap.decoder)}, but moe_layer_freq routes layers {want} of this "
            f"rank's {here}: the routers registered are not the decoder's MoE layers"
        )
    n_mtp = int(getattr(config, "mtp_num_layers", None) or 0)
    if rmap.mtp_layers:
        if rmap.mtp_layers != n_mtp:
            raise ReplayError(f"the MTP block has {rmap.mtp_layers} layers, config.mtp_num_layers={n_mtp}")
        want_mtp = n_mtp if pattern[-1] else 0  # MTP layers wrap the last decoder layer (get_gpt_mtp_block_spec)
        if len(rmap.mtp) != want_mtp:
            raise ReplayError(
                f"{len(rmap.mtp)} MTP routers for {n_mtp} MTP layers (the last decoder layer is "
                f"{'MoE' if pattern[-1] else 'dense'}): expected {want_mtp}"
            )
    reps = [rr for rr in rmap.replays() if rr is not None]
    if len({id(rr) for rr in reps}) != len(reps):
        raise ReplayError("two routers share one RouterReplay instance: the registered routers are not one per layer")


class _MTPReplay:
    """What :class:`MegatronReplay` does with the MTP routers (kept apart from the decoder's, see ``MTP_MODES``)."""

    def __init__(self, owner: MegatronReplay, model: Any, how: str, per_microbatch: Sequence[Any] | None):
        if how not in MTP_MODES:
            raise ReplayError(f"mtp must be one of {MTP_MODES}, got {how!r}")
        if how != "replay" and per_microbatch is not None:
            raise ReplayError(f"mtp={how!r} takes no mtp_routes (pass mtp='replay' to replay the MTP routers)")
        if how != "live" and how != owner.mode:
            raise ReplayError(f"mtp={how!r} needs mode={how!r}, got mode={owner.mode!r}")
        if model is None:
            if how != "live":
                raise ReplayError(f"mtp={how!r} needs the model (to tell its MTP routers from the decoder's)")
            self.routers: dict[int, Any] = {}
        else:
            self.routers = megatron_router_map(model).mtp
        if how != "live" and not self.routers:
            raise ReplayError(f"mtp={how!r}, but the model has no MTP router on this rank")
        reg = {id(rr) for rr in owner._RR.global_router_replay_instances}
        missing = [d for d, r in self.routers.items() if id(r.router_replay) not in reg]
        if missing:
            raise ReplayError(f"MTP routers of depths {missing} are not in RouterReplay's global registry")
        self.how, self.owner = how, owner
        self.depths = list(self.routers)
        self._replays = [r.router_replay for r in self.routers.values()]
        self._queue = list(per_microbatch) if per_microbatch is not None else []
        self._next = 0
        self._hooks: list[Any] = []
        self.recorded: list[dict[int, torch.Tensor]] = []

    def _validated(self, routes: Any) -> list[torch.Tensor]:
        if isinstance(routes, Mapping):
            keys = sorted(int(k) for k in routes)
            if keys != self.depths:
                raise ReplayError(f"MTP ids given for depths {keys}; this rank's MTP routers are depths {self.depths}")
            routes = [routes[d] if d in routes else routes[str(d)] for d in self.depths]
        elif isinstance(routes, (str, bytes)) or not isinstance(routes, Sequence):
            raise ReplayError(
                f"mtp_routes must be a list or mapping of per-MTP-router ids, got {type(routes).__name__}"
            )
        if len(routes) != len(self.depths):
            raise ReplayError(f"{len(routes)} MTP id tensors for {len(self.depths)} MTP routers (depths {self.depths})")
        o = self.owner
        return [check_route_tensor(ids, top_k=o.top_k, num_experts=o.num_experts, what=f"MTP depth {d}",
                                   allow_3d=False) for d, ids in zip(self.depths, routes, strict=True)]

    def begin(self, routes: Any, forward_only: bool) -> None:
        if self.how == "live":
            if routes is not None:
                raise ReplayError("mtp_routes given, but mtp='live' (pass mtp='replay')")
            return
        if self.how == "record":
            for rr in self._replays:
                rr.set_router_replay_action(self.owner._A.RECORD)
            return
        if routes is None:
            if self._next >= len(self._queue):
                raise ReplayError(f"no mtp_routes for micro-batch {self._next}: {len(self._queue)} were given")
            routes = self._queue[self._next]
            self._next += 1
        for rr, t in zip(self._replays, self._validated(routes), strict=True):
            rr.set_target_indices(t)
            if forward_only:  # as MegatronReplay.begin_microbatch: drop the queued REPLAY_BACKWARD entry again
                if not rr.replay_backward_list or rr.replay_backward_list[-1] is not t:
                    raise ReplayError("RouterReplay.set_target_indices did not queue the ids (megatron-core changed?)")
                rr.replay_backward_list.pop()
            rr.set_router_replay_action(self.owner._A.REPLAY_FORWARD)

    def after_forward(self) -> None:
        if self.how == "replay":
            for rr in self._replays:
                rr.set_router_replay_action(self.owner._A.REPLAY_BACKWARD)
        elif self.how == "record":
            got = {}
            for d, rr in zip(self.depths, self._replays, strict=True):
                idx = rr.get_recorded_indices()
                if idx is None:
                    raise ReplayError(f"MTP depth {d} recorded nothing: did the MTP block run (labels given)?")
                got[d] = idx.detach().to(torch.int64).clone()
            self.recorded.append(got)

    def _live_guard(self, d: int, rr: Any) -> Callable:
        def pre_hook(module: Any, args: Any, kwargs: Any) -> None:
            if rr.router_replay_action is not None:
                raise ReplayError(
                    f"MTP router (depth {d}) has replay action {rr.router_replay_action.name} while r3lab keeps it "
                    "live: something set every router's action (RouterReplay.set_global_router_replay_action or "
                    "set_replay_data, which feed routers by their place in the global list); an MTP router must "
                    "never route with a decoder layer's ids. Use mtp='replay' with mtp_routes to replay it"
                )

        return pre_hook

    def enter(self) -> None:
        for rr in self._replays:
            rr.clear_indices()
            rr.clear_router_replay_action()
        for d, r in self.routers.items():
            hook = self._live_guard(d, r.router_replay) if self.how == "live" else self.owner._check_tokens(
                f"MTP depth {d}", r.router_replay)
            self._hooks.append(r.register_forward_pre_hook(hook, with_kwargs=True))

    def exit(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()
        for rr in self._replays:
            rr.clear_router_replay_action()
            rr.clear_indices()
