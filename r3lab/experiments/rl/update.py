"""The policy update of one step: ``mini_batches`` clipped-objective steps over a shuffled split of the batch, each
replaying per the mode, with the route change of the policy, the collapse precursors and the trainer's noise floor;
:func:`train_step` joins it to the old policy and the step's per-token table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.config import RLConfig, RLMetric
from r3lab.experiments.rl.batch import RolloutBatch
from r3lab.experiments.rl.old_policy import OldPolicy, old_policy, replay_weights
from r3lab.routes import Routes
from r3lab.trainers import PolicyUpdate, Scorer, TokenBatch, Trainer

UPDATE_STATS = ("loss", "clip_frac", "approx_kl", "grad_norm", "entropy", "route_change", "used_route_change",
                 "tis_weight_mean")
# collapse precursors on the policy side, per mini-batch (the maximum over the update is what bursts)
_PRECURSORS = ("clip_frac", "grad_norm", "policy_abs_dlogp", "policy_is_ess")


@dataclass(frozen=True)
class StepResult:
    """One RL step's trainer side: its metrics (one step line of the run) and its per-token table."""

    metrics: dict[str, Any]
    tokens: dict[str, np.ndarray]


def policy_updates(trainer: Trainer, batch: RolloutBatch, old: OldPolicy, config: RLConfig,
                   rng: np.random.Generator) -> tuple[dict[str, Any], np.ndarray]:
    """``mini_batches`` clipped policy steps over a shuffled split of the batch; replays per ``config.mode``.

    Returns the update's metrics (``train/*``, the route change of the policy, the noise floor of the trainer) and the
    samples of the first mini-batch.
    """
    chunks = np.array_split(rng.permutation(len(batch.tokens)), config.mini_batches)
    tok_sample = batch.tokens.token_sample
    stats: dict[str, list[float]] = {k: [] for k in UPDATE_STATS}
    precursors: dict[str, list[float]] = {k: [] for k in _PRECURSORS}
    first_mb_gap = trainer_floor = 0.0
    drift: dict[str, list[float]] = {k: [] for k in _ROUTER_DRIFT}
    # the live router's weights too, where the engine captured its own (R3W; any mode on an engine capturing them)
    with_weights = bool(getattr(trainer, "records_weights", False)) and batch.engine_routes.weights is not None
    for mb, idx in enumerate(np.sort(c) for c in chunks):
        sub = batch.tokens.take(idx)
        sel = np.isin(tok_sample, idx)
        # what the current policy would route natively, against the old policy's routes (what R2 freezes)
        weighing: Any = trainer  # records_weights: score() takes record_weights (HFTrainer)
        now = weighing.score(sub, record=True, record_weights=True) if with_weights else trainer.score(sub, record=True)
        old_sub = old.native_routes.take(idx)
        stats["route_change"].append(float(metrics.set_differs(old_sub.values, now.routes.values).mean()))
        engine_sub = batch.engine_routes.take(idx)
        replay = {"R2": old_sub, "R3": engine_sub, "R3W": engine_sub}.get(config.mode)
        _router_drift(drift, now.routes, replay, engine_sub)
        step = trainer.policy_step(sub, _policy_update(batch, old, config, sub, sel), routes=replay,
                                   **replay_weights(config))
        # the routes this forward actually used, against the old policy's: 0 for R2 by construction
        used = now.routes if replay is None else replay.select_layers(now.routes.layer_ids)
        stats["used_route_change"].append(float(metrics.set_differs(old_sub.values, used.values).mean()))
        if mb == 0:  # the policy is still the old one: R2 must equal no replay here (its definition)
            gap = step.logprobs.astype(np.float32) - now.logprobs.astype(np.float32)  # the trainer's fp32
            first_mb_gap = float(np.abs(gap).max())
            trainer_floor = metrics.k3_kl(now.logprobs, old.logp_native[sel])
        for k in ("loss", "clip_frac", "approx_kl", "grad_norm", "entropy"):
            stats[k].append(getattr(step, k))
        if step.tis_weight_mean is not None:
            stats["tis_weight_mean"].append(step.tis_weight_mean)
        # the current policy (this forward, before its step) against the old policy on these tokens
        dlogp = step.logprobs - old.logp_old[sel]
        precursors["clip_frac"].append(step.clip_frac)
        precursors["grad_norm"].append(step.grad_norm)
        precursors["policy_abs_dlogp"].append(float(np.abs(dlogp).max()))
        precursors["policy_is_ess"].append(metrics.effective_sample_size(dlogp))
    rec: dict[str, Any] = {f"train/{k}": float(np.mean(v)) if v else None for k, v in stats.items()}
    rec.update({k: float(np.mean(v)) if v else None for k, v in drift.items()})
    rec[RLMetric.CLIP_FRAC_MAX] = max(precursors["clip_frac"])
    rec[RLMetric.GRAD_NORM_MAX] = max(precursors["grad_norm"])
    rec[RLMetric.POLICY_ABS_DIFF_MAX] = max(precursors["policy_abs_dlogp"])
    rec[RLMetric.POLICY_IS_ESS] = min(precursors["policy_is_ess"])
    rec[RLMetric.ROUTE_CHANGE_FIRST_MB] = stats["route_change"][0]
    rec[RLMetric.ROUTE_CHANGE_LAST_MB] = stats["route_change"][-1]
    rec[RLMetric.USED_ROUTE_CHANGE_LAST_MB] = stats["used_route_change"][-1]
    rec[RLMetric.FIRST_MB_LOGP_GAP] = first_mb_gap
    # the trainer against itself: the same tokens under the same weights, scored in another batch composition
    rec[RLMetric.TRAINER_NOISE_FLOOR] = trainer_floor
    return rec, np.sort(chunks[0])


_ROUTER_DRIFT = (RLMetric.ROUTER_IDS_DRIFT, RLMetric.ROUTER_ENGINE_IDS, RLMetric.ROUTER_WEIGHTS_L1)


def _router_drift(out: dict[str, list[float]], live: Any, replay: Routes | None, engine: Routes) -> None:
    """The router's own drift on one mini-batch: the current policy's live routing (``live``, recorded natively)
    against what this mini-batch's forward replays (``replay``: R2 the old policy's ids, R3/R3W the engine's; none
    replays nothing) and against the engine's ids and, where both carry them, weights (R3W: the replayed ones)."""
    layers = live.layer_ids
    eng = engine.select_layers(layers)
    if replay is not None:
        out[RLMetric.ROUTER_IDS_DRIFT].append(float(metrics.set_differs(
            replay.select_layers(layers).values, live.values).mean()))
    out[RLMetric.ROUTER_ENGINE_IDS].append(float(metrics.set_differs(eng.values, live.values).mean()))
    if live.weights is not None and eng.weights is not None:
        out[RLMetric.ROUTER_WEIGHTS_L1].append(float(metrics.routing_weight_l1(
            eng.values, eng.weights, live.values, live.weights, live.num_experts).mean()))


def _policy_update(batch: RolloutBatch, old: OldPolicy, config: RLConfig, sub: TokenBatch,
                   sel: np.ndarray) -> PolicyUpdate:
    """The loss's inputs for the mini-batch ``sub`` (its tokens ``sel`` of the batch's)."""
    gspo = config.loss == "gspo"
    return PolicyUpdate(old_logprobs=old.logp_old[sel], advantages=batch.advantages[batch.tokens.token_sample[sel]],
                        infer_logprobs=batch.logp_infer[sel],
                        clip_eps=config.gspo_clip_eps if gspo else config.clip_eps,
                        tis_cap=config.tis_cap if old.weights is None else None,  # matched: in the weights
                        max_grad_norm=config.max_grad_norm, loss=config.loss,
                        clip_eps_high=config.gspo_clip_eps_high if gspo else None,
                        token_sample=sub.token_sample,
                        loss_mask=None if batch.loss_mask is None else batch.loss_mask[sel],
                        token_weights=None if old.weights is None else old.weights[sel])


def train_step(trainer: Trainer, batch: RolloutBatch, config: RLConfig, rng: np.random.Generator, *,
               behaviour: Scorer | None = None) -> StepResult:
    """Old log-probs and routing diagnostics, then ``mini_batches`` clipped policy updates (``behaviour``: the
    scorer at the behaviour weights, for ``old_logprobs="behaviour"``)."""
    old = old_policy(trainer, batch, config, behaviour=behaviour)
    update, first_mb = policy_updates(trainer, batch, old, config, rng)
    sample = batch.tokens.token_sample
    tokens = {"sample": sample, "position": np.concatenate([np.arange(int(n)) for n in batch.tokens.response_lengths]),
              "logp_infer": batch.logp_infer, "logp_old": old.logp_old, "logp_native": old.logp_native,
              "flipped": old.tokens["flipped"], "flipped_layers": old.tokens["flipped_layers"],
              "reward": batch.rewards[sample], "first_mb_sample": np.isin(sample, first_mb)}
    if old.logp_behaviour is not None:
        tokens["logp_behaviour"] = old.logp_behaviour
        tokens["weight"] = old.weights
    if batch.loss_mask is not None:
        tokens["loss_mask"] = batch.loss_mask  # the doctor reads this column too
    return StepResult({**old.metrics, **update}, tokens)

