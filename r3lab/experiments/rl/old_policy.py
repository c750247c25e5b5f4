"""The old policy on a rollout batch: the log-probs the loss divides by, the trainer's own routes (R2's replay data),
the engine-trainer mismatch and routing diagnostics, and, at matched weights (``old_logprobs="behaviour"``), the
proximal policy, the split of the staleness mismatch and the decoupled objective's token weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.config import RLConfig, RLMetric
from r3lab.errors import ConfigError
from r3lab.experiments.rl.batch import RolloutBatch
from r3lab.routes import Routes
from r3lab.trainers import Scorer, Trainer

__all__ = ["replay_weights"]


def replay_weights(config: RLConfig) -> dict[str, Any]:
    """The keyword a trainer's forward takes under the mode: R3W replays the engine's routing weights beside its ids
    (``weights=config.weight_replay``: ``"stop"``, the router's gradient stopped as prime-rl #3509, or
    ``"straight"``); every other mode passes nothing (the live router's weights at the ids it uses)."""
    if config.mode != "R3W":
        return {}
    from r3lab.trainer_registry import trainer_spec

    if not trainer_spec(config.trainer).weight_replay:
        raise ConfigError(f"mode R3W replays the engine's routing weights; the {config.trainer} trainer replays ids "
                          "only (--trainer hf or megatron)")
    return {"weights": config.weight_replay}


@dataclass(frozen=True)
class OldPolicy:
    """The old policy on a rollout batch: the log-probs the loss divides by, its own routes, and their diagnostics."""

    logp_old: np.ndarray  # [N] the loss's old log-probs (R3: replaying the engine's routes, R3W its ids and
    # weights; else native)
    logp_native: np.ndarray  # [N] the trainer's own routing
    native_routes: Routes  # what the trainer routed natively: R2's replay data
    metrics: dict[str, Any]  # mismatch/* and routing/* of the step
    tokens: dict[str, np.ndarray]  # per sampled token: flipped, flipped_layers
    logp_behaviour: np.ndarray | None = None  # [N] old_logprobs="behaviour": the trainer at the behaviour weights
    weights: np.ndarray | None = None  # [N] old_logprobs="behaviour": the decoupled objective's token weights



def old_policy(trainer: Trainer, batch: RolloutBatch, config: RLConfig, *,
               behaviour: Scorer | None = None) -> OldPolicy:
    """The old log-probs, and routing diagnostics: engine vs the trainer's own choice, per (token, layer).

    ``old_logprobs="behaviour"``: ``behaviour`` (the trainer's kind at the weights the engine sampled with,
    :func:`scorer_at`) scores the batch for the diagnostics and R2's routes; the trainer's current weights give the
    proximal log-probs the loss divides by, and the step's ``async/*`` metrics split the staleness mismatch.
    """
    matched = config.old_logprobs == "behaviour"
    if matched and behaviour is None:
        raise ConfigError("old_logprobs='behaviour' needs the behaviour scorer (scorer_at(config, path, weights))")
    ref = behaviour if matched and behaviour is not None else trainer
    native = ref.score(batch.tokens, record=True)
    if config.mode in ("R3", "R3W"):
        logp_old = ref.score(batch.tokens, routes=batch.engine_routes, **replay_weights(config)).logprobs
    else:
        logp_old = native.logprobs
    mismatch = metrics.mismatch_metrics(batch.sampled(logp_old), batch.sampled(batch.logp_infer),
                                        cu_seqlens=batch.cu_sampled, tis_cap=config.tis_cap or 2.0)
    rec: dict[str, Any] = {f"mismatch/{k}": v for k, v in mismatch.items()}
    own = native.routes
    differs = metrics.set_differs(batch.engine_routes.select_layers(own.layer_ids).values, own.values)
    rec[RLMetric.ENGINE_TRAINER_DISAGREEMENT] = float(differs.mean())
    rec[RLMetric.ENGINE_TRAINER_DISAGREEMENT_PER_LAYER] = {
        int(g): float(v) for g, v in zip(own.layer_ids, differs.mean(axis=0), strict=True)}
    rec[RLMetric.ENGINE_TRAINER_TOKEN_ANY] = float(differs.any(axis=1).mean())
    rows = metrics.response_rows(batch.engine_routes.cu_seqlens, batch.tokens.response_lengths, metrics.TRAINER_ROWS)
    flipped = differs.any(axis=1)[rows]
    sampled_flipped = batch.sampled(flipped)
    for name, k3 in metrics.k3_by_flip(batch.sampled(logp_old), batch.sampled(batch.logp_infer),
                                       sampled_flipped).items():
        rec[f"mismatch/k3_kl_{name}"] = k3
    rec[RLMetric.FLIPPED_TOKEN_SHARE] = float(sampled_flipped.mean())
    load = metrics.expert_load(batch.engine_routes.values, batch.engine_routes.num_experts)
    rec[RLMetric.ENGINE_MAX_VIO] = float(metrics.max_violation(load).max())
    tokens = {"flipped": flipped, "flipped_layers": differs.sum(axis=1)[rows]}
    if not matched:
        return OldPolicy(logp_old, native.logprobs, own, rec, tokens)
    return _proximal(trainer, batch, config, native, logp_old, rec, tokens)


def _proximal(trainer: Trainer, batch: RolloutBatch, config: RLConfig, behaviour_native: Any,
              logp_behaviour: np.ndarray, rec: dict[str, Any], tokens: dict[str, np.ndarray]) -> OldPolicy:
    """Matched weights: the proximal policy (the current weights, the mode's routing: R3 the engine's routes, R2 the
    routes recorded at the behaviour weights), the split of the mismatch, and the decoupled objective's weights."""
    current = trainer.score(batch.tokens, record=True)
    replay = {"R2": behaviour_native.routes, "R3": batch.engine_routes, "R3W": batch.engine_routes}.get(config.mode)
    logp_prox = current.logprobs if replay is None else trainer.score(batch.tokens, routes=replay,
                                                                      **replay_weights(config)).logprobs
    prox, behav, infer = (batch.sampled(a) for a in (logp_prox, logp_behaviour, batch.logp_infer))
    rec[RLMetric.K3_ENGINE_TRAINER_MATCHED] = metrics.k3_kl(behav, infer)
    rec[RLMetric.K3_POLICY_LAG] = metrics.k3_kl(prox, behav)
    rec[RLMetric.K3_ENGINE_CURRENT] = metrics.k3_kl(prox, infer)
    rec[RLMetric.F_2_POLICY_LAG] = metrics.extreme_token_fraction(prox, behav, 2.0)
    lag_routes: Any = current.routes  # recorded (record=True)
    rec[RLMetric.ROUTE_CHANGE_LAG] = float(metrics.set_differs(behaviour_native.routes.values,
                                                               lag_routes.values).mean())
    if config.tis_cap is None:
        raw = np.exp(logp_prox - batch.logp_infer)
        weights = np.minimum(raw, config.behaviour_cap)
    else:
        raw = np.exp(logp_prox - logp_behaviour)
        weights = np.minimum(raw, config.behaviour_cap) * np.minimum(np.exp(logp_behaviour - batch.logp_infer),
                                                                     config.tis_cap)
    rec[RLMetric.BEHAVIOUR_WEIGHT_MEAN] = float(batch.sampled(weights).mean())
    rec[RLMetric.BEHAVIOUR_WEIGHT_TRUNCATED] = float((batch.sampled(raw) > config.behaviour_cap).mean())
    return OldPolicy(logp_prox, current.logprobs, behaviour_native.routes, rec, tokens, logp_behaviour, weights)

