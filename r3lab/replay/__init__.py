"""Trainer-side routing replay: inject recorded expert ids into the trainer's routers (or record its own).

Two backends share one validation (:func:`check_route_tensor`) and one exception (:class:`~r3lab.errors.ReplayError`),
both in :mod:`r3lab.replay.common`:

* :mod:`r3lab.replay.megatron`: Megatron-core (>= 0.16, ``moe_enable_routing_replay=True``);
  :func:`megatron_replay` / :class:`MegatronReplay` drive ``RouterReplay`` around a training step, one
  micro-batch at a time.
* :mod:`r3lab.replay.hf`: transformers; :func:`hf_replay` / :class:`HFReplay` hook each MoE router of
  Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GPT-OSS, DeepSeek-V3 and GLM-4-MoE models, and the same hooks
  record. :mod:`r3lab.replay.hf_model`: :func:`score_batch` is the trainer's one log-prob forward
  (:func:`hf_token_logprobs` one sequence of it), :func:`recompute_routes` the engine-convention recomputation,
  :func:`load_hf_model` a checkpoint with fp32 routers.

Importing this package imports torch, not megatron-core or transformers (each is imported when used); without
torch it raises :class:`~r3lab.errors.MissingExtraError` naming the ``replay`` extra.
Layer ids are the 0-based global decoder-layer index everywhere (as in :class:`r3lab.routes.Routes`).
"""

from r3lab._extras import importing

with importing("torch", for_="r3lab.replay"):
    import torch  # noqa: F401  (every module below needs it)

from r3lab.replay.common import check_route_tensor
from r3lab.replay.hf import ROUTER_RULES, WEIGHT_REPLAY, HFReplay, count_replay_hooks, find_hf_routers, hf_replay
from r3lab.replay.hf_model import (
    RouterCasts,
    Scores,
    count_router_cast_hooks,
    hf_token_logprobs,
    keep_routers_fp32,
    load_hf_model,
    recompute_routes,
    remove_router_casts,
    score_batch,
)
from r3lab.replay.megatron import (
    MTP_MODES,
    MegatronReplay,
    MegatronRouterMap,
    find_orphaned_router_replays,
    megatron_replay,
    megatron_router_map,
    megatron_routers,
)
from r3lab.replay.megatron_weights import MegatronWeightReplay, megatron_weight_replay

__all__ = [
    "check_route_tensor",
    "MegatronReplay",
    "megatron_replay",
    "megatron_routers",
    "megatron_router_map",
    "MegatronRouterMap",
    "MTP_MODES",
    "MegatronWeightReplay",
    "megatron_weight_replay",
    "find_orphaned_router_replays",
    "hf_replay",
    "HFReplay",
    "find_hf_routers",
    "count_replay_hooks",
    "ROUTER_RULES",
    "WEIGHT_REPLAY",
    "RouterCasts",
    "keep_routers_fp32",
    "remove_router_casts",
    "count_router_cast_hooks",
    "load_hf_model",
    "Scores",
    "score_batch",
    "hf_token_logprobs",
    "recompute_routes",
]
