"""Routing replay for transformers MoE models: forward hooks on each router (the CPU / FSDP-style trainer).

Each supported router returns ``(router_logits, topk_weights, topk_indices)``, or, for the two routers that
transformers 5.12 splits (GLM-4-MoE, DeepSeek-V3), returns the logits while its MoE block selects
(:mod:`r3lab.replay.hf_api` tells the two apart and wraps the block's selection method instead of hooking the
router). In REPLAY mode the hook keeps the router's own logits (so the router keeps its gradient), replaces
``topk_indices`` with the replayed ids and recomputes ``topk_weights`` from those logits by the family's own rule:

==========================================  =====================================================================
family (router class)                       gate weights at the replayed ids ``r``
==========================================  =====================================================================
Qwen3-MoE, Qwen2-MoE, OLMoE                 ``softmax(logits, fp32)[r]``, divided by its sum if ``norm_topk_prob``,
                                            cast back to the logits dtype
Mixtral                                     ``softmax(logits.float())[r] / sum`` (always renormalized, stays fp32)
GPT-OSS                                     ``softmax(logits[r])`` (softmax over the gathered logits, incl. bias)
DeepSeek-V3, GLM-4-MoE                      ``sigmoid(logits)[r]`` (no ``e_score_correction_bias``: it only steers
                                            selection), ``/ (sum + 1e-20)`` if ``norm_topk_prob``,
                                            ``* routed_scaling_factor``
==========================================  =====================================================================

Replaying a model's own recorded ids therefore reproduces its logits bit for bit. Group-limited
selection (``n_group``/``topk_group``) is not re-applied: the replayed ids are taken as given.
Routers are mapped by their global decoder-layer index (``model.layers.<i>``), so leading dense layers
are simply absent. Tokens are the router's rows: the batch flattened batch-major (``b * S + s``).
The auxiliary load-balancing loss (``output_router_logits``) still sees the router's native logits.

Hooks are removed when the context exits, also on exceptions.

**Routing-weight replay (R3W).** ``weights="stop"`` replays the engine's routing weights beside its ids
(``Routes.weights``, captured by :mod:`r3lab.rollout.weights`): the experts are mixed with exactly the engine's
weights, held constant, so the language-model loss sends no gradient into the router (as prime-rl #3509,
"Total Router Recall", does: its replayed ``routed_weights`` replace the router's ``topk_weights`` and the router
logits are detached, see :mod:`r3lab.replay.megatron`). ``weights="straight"`` is the variant that keeps the
gradient: the forward uses the engine's weights, the backward the live rule's gradient at the replayed ids
(``w_engine + w_live - w_live.detach()``, a straight-through estimator), so the router keeps learning from the
loss while the forward matches the engine. The router's own logits are returned unchanged in both (the
auxiliary load-balancing loss still sees them).

The same hooks are this package's one router recorder (``mode="record"``, routers matched by class);
:mod:`r3lab.replay.hf_model` builds the trainer's one log-prob forward on them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from r3lab.families import FAMILIES
from r3lab.replay import hf_api
from r3lab.replay.common import ReplayError, check_route_tensor
from r3lab.routes import Routes

#: how :func:`hf_replay` treats routing weights: None (ids only, R3; the live rule's weights), "stop" (the
#: engine's weights, no router gradient: R3W), "straight" (the engine's weights forward, the live gradient back)
WEIGHT_REPLAY = (None, "stop", "straight")

Rule = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _softmax_rule(router: torch.nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE / Qwen2-MoE / OLMoE: fp32 softmax gathered, renormalized when norm_topk_prob."""
    w = F.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if hf_api.router_setting(router, "norm_topk_prob"):
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def _mixtral_rule(router: torch.nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mixtral: fp32 softmax gathered and always renormalized; kept in fp32 as the model does."""
    w = F.softmax(logits.float(), dim=-1).gather(1, ids)
    return w / w.sum(dim=-1, keepdim=True)


def _gpt_oss_rule(router: torch.nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the gathered logits (top-k first, softmax after)."""
    v = logits.gather(1, ids)
    return F.softmax(v, dim=1, dtype=v.dtype)


def _sigmoid_rule(router: torch.nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 / GLM-4-MoE: unbiased sigmoid gathered, normalized if norm_topk_prob, scaled."""
    w = logits.sigmoid().gather(1, ids)
    if hf_api.router_setting(router, "norm_topk_prob"):
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * hf_api.router_setting(router, "routed_scaling_factor")


#: The gate-weight rules by name (r3lab.families.ROUTER_RULE_NAMES): the torch side of each family's router_rule.
_RULES: dict[str, Rule] = {"softmax": _softmax_rule, "softmax_renormalized": _mixtral_rule,
                           "softmax_of_topk": _gpt_oss_rule, "sigmoid": _sigmoid_rule}

#: Router class name -> gate-weight rule, from the family table (r3lab.families: router_classes, router_rule).
#: Every entry was checked against transformers 5.12.1 and 5.25.0 source (r3lab.replay.hf_api.CHECKED); the rule's
#: settings come from r3lab.replay.hf_api.router_setting (the router's attribute, else its config's).
ROUTER_RULES: dict[str, Rule] = {cls: _RULES[f.router_rule] for f in FAMILIES.values() if f.router_rule is not None
                                 for cls in f.router_classes}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_hf_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The MoE routers of a supported transformers model, keyed by global decoder-layer index (ascending).

    Raises :class:`ReplayError` when the model has no supported router, or a router outside ``layers.<i>``.
    """
    found: dict[int, torch.nn.Module] = {}
    for name, mod in model.named_modules():
        if type(mod).__name__ not in ROUTER_RULES:
            continue
        m = _LAYER_RE.search(name)
        if m is None:
            raise ReplayError(f"router {name!r} ({type(mod).__name__}) is not under a 'layers.<i>' decoder layer")
        layer = int(m.group(1))
        if layer in found:
            raise ReplayError(f"two routers in decoder layer {layer} ({name!r}); one per layer is supported")
        found[layer] = mod
    if not found:
        raise ReplayError(
            f"no supported MoE router in {type(model).__name__}; supported router classes: {sorted(ROUTER_RULES)}"
        )
    return dict(sorted(found.items()))


def count_replay_hooks(model: torch.nn.Module) -> int:
    """Number of hooks r3lab has installed on ``model`` (0 outside every :func:`hf_replay` context): forward hooks
    on fused routers and selection-method wrappers on the MoE blocks of split ones (:mod:`r3lab.replay.hf_api`)."""
    hooks = sum(1 for m in model.modules() for h in m._forward_hooks.values() if getattr(h, "_r3lab_replay", False))
    wrapped = sum(getattr(m.__dict__.get(hf_api.SPLIT_METHOD), "_r3lab_depth", 0) for m in model.modules())
    return hooks + wrapped


def _router_blocks(model: torch.nn.Module, routers: Mapping[int, torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """The MoE block (parent module) of each router."""
    names = {id(m): n for n, m in model.named_modules()}
    return {g: model.get_submodule(names[id(r)].rpartition(".")[0]) for g, r in routers.items()}


class HFReplay:
    """State of one :func:`hf_replay` context: the routers, the replay ids, and what was recorded.

    :ivar mode: ``"replay"`` or ``"record"``.
    :ivar routers: ``{global_layer_id: router_module}`` of the model's MoE layers.
    :ivar recorded: RECORD mode: ``{layer_id: [indices of call 0, call 1, ...]}``, int64 ``[tokens, top_k]``
        (a recomputation under activation checkpointing is a further call); REPLAY mode with
        ``record_replayed``: the ids each router call was handed (what its experts used).
    :ivar calls: ``{layer_id: number of router calls seen}`` in either mode.
    """

    def __init__(self, model: torch.nn.Module, mode: str, *, record_replayed: bool = False,
                 weights: str | None = None):
        if mode not in ("replay", "record"):
            raise ReplayError(f"mode must be 'replay' or 'record', got {mode!r}")
        if weights not in WEIGHT_REPLAY:
            raise ReplayError(f"weights must be one of {WEIGHT_REPLAY}, got {weights!r}")
        if weights is not None and mode != "replay":
            raise ReplayError("weights applies to mode='replay'")
        self.weights = weights
        self._w: dict[int, torch.Tensor] | None = None
        self.replayed_weights: dict[int, list[torch.Tensor]] = {}
        if record_replayed and mode != "replay":
            raise ReplayError("record_replayed applies to mode='replay' (mode='record' always records)")
        self.model = model
        self.mode = mode
        self.record_replayed = bool(record_replayed)
        self.routers = find_hf_routers(model)
        self.layer_ids = list(self.routers)
        self._blocks = _router_blocks(model, self.routers)
        self._layouts = {g: hf_api.router_layout(r, self._blocks[g]) for g, r in self.routers.items()}
        self.recorded: dict[int, list[torch.Tensor]] = {g: [] for g in self.layer_ids}
        # RECORD mode: the router's own top-k weights of each call, float32 [tokens, top_k] (beside `recorded`)
        self.recorded_weights: dict[int, list[torch.Tensor]] = {g: [] for g in self.layer_ids}
        self.calls: dict[int, int] = {g: 0 for g in self.layer_ids}
        self._ids: dict[int, torch.Tensor] | None = None
        self._on_device: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    # ---- replay data ---------------------------------------------------------------------------
    def set_routes(self, routes: Routes | Mapping[int, Any] | Sequence[Any], *, attention_mask: Any = None) -> None:
        """Set the ids the next forward passes replay (validated here, once, not in the hook).

        ``routes`` is a :class:`~r3lab.routes.Routes` (packed sequences; its ``layer_ids`` must cover
        every MoE layer of the model, extra layers such as dense ones are ignored), a mapping
        ``{global_layer_id: ids}`` or a sequence of ids, one per MoE layer in increasing layer order.
        Ids are ``[tokens, top_k]`` (or ``[B, S, top_k]``, flattened batch-major) integer arrays.
        ``attention_mask`` (``[B, S]``, only with ``Routes``): the forward runs a padded batch; packed
        sequence ``i`` fills the unmasked positions of row ``i`` and padding positions get ``arange(top_k)``.
        """
        if self.mode != "replay":
            raise ReplayError("set_routes is only meaningful in mode='replay'")
        per_layer = self._per_layer(routes, attention_mask)
        checked: dict[int, torch.Tensor] = {}
        n_tokens = None
        for g, router in self.routers.items():
            t = check_route_tensor(per_layer[g], top_k=hf_api.router_setting(router, "top_k"),
                                   num_experts=hf_api.router_setting(router, "num_experts"), what=f"layer {g}")
            if n_tokens is not None and t.shape[0] != n_tokens:
                raise ReplayError(f"layer {g} has {t.shape[0]} token rows but layer {self.layer_ids[0]} has {n_tokens}")
            n_tokens = t.shape[0]
            checked[g] = t
        self._ids = checked
        self._on_device = {}
        self._w = None
        if self.weights is not None:
            if not isinstance(routes, Routes) or routes.weights is None:
                raise ReplayError(f"weights={self.weights!r} replays the engine's routing weights: give Routes that "
                                  "carry them (RolloutEngine(capture_weights=True))")
            have = {int(g): j for j, g in enumerate(routes.layer_ids)}
            w = routes.weights if attention_mask is None else _scatter_padded(routes, attention_mask, routes.weights)
            self._w = {g: torch.from_numpy(np.ascontiguousarray(w[:, have[g], :])) for g in self.layer_ids}

    def _per_layer(self, routes: Any, attention_mask: Any) -> dict[int, Any]:
        if isinstance(routes, Routes):
            have = {int(g): j for j, g in enumerate(routes.layer_ids)}
            missing = [g for g in self.layer_ids if g not in have]
            if missing:
                raise ReplayError(
                    f"routes lack MoE layers {missing}: routes have layer_ids {routes.layer_ids.tolist()}, "
                    f"the model's MoE layers are {self.layer_ids} (global decoder-layer ids, dense layers absent)"
                )
            n_exp = hf_api.router_setting(self.routers[self.layer_ids[0]], "num_experts")
            if routes.num_experts != n_exp:
                raise ReplayError(f"routes are for {routes.num_experts} experts, the model has {n_exp}")
            vals = routes.values
            if attention_mask is not None:
                vals = _scatter_padded(routes, attention_mask)
            return {g: vals[:, have[g], :] for g in self.layer_ids}
        if attention_mask is not None:
            raise ReplayError("attention_mask is only used with Routes input; pass per-layer ids already padded")
        if isinstance(routes, Mapping):
            keys = sorted(int(k) for k in routes)
            if keys != self.layer_ids:
                raise ReplayError(f"per-layer ids given for layers {keys}; the model's MoE layers are {self.layer_ids}")
            return {int(k): v for k, v in routes.items()}
        if isinstance(routes, (str, bytes)) or not isinstance(routes, Sequence):
            raise ReplayError(
                f"routes must be Routes, a mapping or a sequence of per-layer ids, got {type(routes).__name__}"
            )
        if len(routes) != len(self.layer_ids):
            raise ReplayError(
                f"{len(routes)} per-layer id tensors for {len(self.layer_ids)} MoE layers {self.layer_ids}"
            )
        return dict(zip(self.layer_ids, routes, strict=True))

    # ---- recorded data -------------------------------------------------------------------------
    def tensors(self, call: int = 0) -> dict[int, torch.Tensor]:
        """Recorded ids ``{layer_id: int64 [tokens, top_k]}`` of router call ``call`` (0: the first forward)."""
        out = {}
        for g, calls in self.recorded.items():
            if not -len(calls) <= call < len(calls):
                raise ReplayError(f"layer {g} recorded {len(calls)} calls; call {call} does not exist")
            out[g] = calls[call]
        return out

    def to_routes(self, *, attention_mask: Any = None, cu_seqlens: Any = None, call: int = 0,
                  weights: bool = False) -> Routes:
        """The recorded ids as :class:`~r3lab.routes.Routes` (layer_ids = the MoE layers).

        With ``attention_mask`` (``[B, S]``) padding positions are dropped and each row is one sequence;
        otherwise the rows form the sequences given by ``cu_seqlens`` (default: one sequence). ``weights``
        (RECORD mode): the routes carry the routers' own top-k weights too (float32, as ``Routes.weights``).
        """
        per = self.tensors(call)
        vals = np.stack([per[g].cpu().numpy() for g in self.layer_ids], axis=1)
        w = None
        if weights:
            if self.mode != "record":
                raise ReplayError("to_routes(weights=True) returns the routers' own weights: mode='record' only")
            w = np.stack([self.recorded_weights[g][call].cpu().numpy() for g in self.layer_ids], axis=1)
        n_exp = hf_api.router_setting(self.routers[self.layer_ids[0]], "num_experts")
        if attention_mask is not None:
            mask = torch.as_tensor(attention_mask).bool().cpu().numpy()
            if mask.size != vals.shape[0]:
                raise ReplayError(f"attention_mask has {mask.size} positions, the routers saw {vals.shape[0]} tokens")
            cu: Any = np.concatenate([[0], np.cumsum(mask.sum(axis=1))])
            vals = vals[mask.reshape(-1)]
            w = None if w is None else w[mask.reshape(-1)]
        else:
            cu = [0, vals.shape[0]] if cu_seqlens is None else cu_seqlens
        return Routes(vals, cu, n_exp, self.layer_ids, weights=w)

    # ---- hooks ---------------------------------------------------------------------------------
    def _install(self) -> None:
        for g, router in self.routers.items():
            hook = self._make_hook(g, ROUTER_RULES[type(router).__name__])
            hook._r3lab_replay = True  # type: ignore[attr-defined]
            if self._layouts[g] == "split":  # the block selects: wrap its selection method (r3lab.replay.hf_api)
                self._handles.append(hf_api.MethodHook(self._blocks[g], router, hook))
            else:
                self._handles.append(router.register_forward_hook(hook))

    def _remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _make_hook(self, g: int, rule: Rule) -> Callable:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            self.calls[g] += 1
            if not (isinstance(output, tuple) and len(output) == 3):
                raise ReplayError(f"layer {g}: {type(module).__name__} did not return (logits, weights, indices)")
            logits, topk_weights, indices = output
            if self.mode == "record":
                self.recorded[g].append(indices.detach().to(torch.int64).clone())
                self.recorded_weights[g].append(topk_weights.detach().to(torch.float32).clone())
                return None
            if self._ids is None:
                raise ReplayError("replay hook ran before any routes were set (call set_routes)")
            ids = self._on_device.get(g)
            if ids is None or ids.device != logits.device:
                ids = self._ids[g].to(logits.device)
                self._on_device[g] = ids
            if ids.shape[0] != logits.shape[0]:
                raise ReplayError(
                    f"layer {g}: replay ids have {ids.shape[0]} token rows but the router sees {logits.shape[0]} tokens"
                )
            if self.record_replayed:
                self.recorded[g].append(ids.clone())  # what the experts are handed
            live = rule(module, logits, ids)
            if self.weights is None:
                return logits, live, ids
            assert self._w is not None  # set_routes checked it
            ew = self._w[g].to(device=live.device, dtype=live.dtype)
            if ew.shape != live.shape:
                raise ReplayError(f"layer {g}: replay weights {tuple(ew.shape)} vs the router's {tuple(live.shape)}")
            w = ew if self.weights == "stop" else ew + (live - live.detach())
            if self.record_replayed:
                self.replayed_weights.setdefault(g, []).append(w.detach().clone())
            return logits, w, ids

        return hook


@contextmanager
def hf_replay(
    model: torch.nn.Module,
    routes: Routes | Mapping[int, Any] | Sequence[Any] | None = None,
    mode: str = "replay",
    *,
    attention_mask: Any = None,
    record_replayed: bool = False,
    weights: str | None = None,
) -> Iterator[HFReplay]:
    """Replay (or record) the expert ids of every MoE router of a transformers model inside the block.

    ``mode="replay"``: every forward in the block routes with ``routes`` (see :meth:`HFReplay.set_routes`;
    ``routes`` may be ``None`` and set later with ``set_routes``, e.g. once per micro-batch); recomputation
    under ``gradient_checkpointing_enable()`` replays the same ids. ``mode="record"``: the routers route
    natively and the context's :attr:`HFReplay.recorded` / :meth:`HFReplay.to_routes` return what they chose.
    ``record_replayed=True`` (replay mode) also records the ids each router call used, for the same accessors.
    ``weights`` (:data:`WEIGHT_REPLAY`): also replay the routing weights ``routes`` carries (module docstring);
    with ``record_replayed`` the weights each call used land in :attr:`HFReplay.replayed_weights`.
    The hooks are removed on exit, also when the block raises.
    """
    state = HFReplay(model, mode, record_replayed=record_replayed, weights=weights)
    if mode == "record" and (routes is not None or attention_mask is not None):
        raise ReplayError("mode='record' takes no routes")
    if routes is not None:
        state.set_routes(routes, attention_mask=attention_mask)
    try:
        state._install()
        yield state
    finally:
        state._remove()


def _scatter_padded(routes: Routes, attention_mask: Any, weights: np.ndarray | None = None) -> np.ndarray:
    """Place packed sequence i at the unmasked positions of row i of a ``[B, S]`` mask; padding -> arange(k).

    With ``weights`` (``[T, L, K]``) the same placement of the weights, padding -> ``1 / top_k``."""
    mask = torch.as_tensor(attention_mask).bool().cpu().numpy()
    if mask.ndim != 2:
        raise ReplayError(f"attention_mask must be [B, S], got shape {mask.shape}")
    if mask.shape[0] != len(routes):
        raise ReplayError(f"attention_mask has {mask.shape[0]} rows for {len(routes)} sequences")
    row_lens = mask.sum(axis=1)
    if not np.array_equal(row_lens, routes.lengths):
        raise ReplayError(
            f"attention_mask row lengths {row_lens.tolist()} differ from the sequence lengths {routes.lengths.tolist()}"
        )
    if weights is not None:
        wout = np.full((mask.size, routes.num_layers, routes.top_k), 1.0 / routes.top_k, dtype=np.float32)
        wout[mask.reshape(-1)] = weights
        return wout
    out = np.empty((mask.size, routes.num_layers, routes.top_k), dtype=np.int64)
    out[...] = np.arange(routes.top_k)
    out[mask.reshape(-1)] = routes.values
    return out
