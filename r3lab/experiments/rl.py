"""A small GRPO loop on CPU that compares routing replay modes: none, R2 and R3.

Each step: the embedded engine (vLLM) samples ``samples_per_prompt`` completions of corpus prompts with
the policy it holds (``staleness`` updates behind the trainer); a verifiable reward scores them; the
transformers trainer recomputes the old log-probabilities, then takes ``mini_batches`` clipped-objective
steps (AdamW) over the batch, and the new weights are pushed into the engine (``update_weights``).

Replay modes (one switch, as verl's ``router_replay.mode``):

* ``none``: the trainer routes natively everywhere.
* ``R2`` (GSPO's Routing Replay): the routes the trainer chose at the old-log-prob recompute are replayed
  in every mini-batch forward and backward of that batch (on the first mini-batch this is a no-op).
* ``R3``: the engine's routes are replayed in the old-log-prob recompute and in every mini-batch forward
  and backward.

Orthogonal: truncated importance sampling (``tis_cap``) weights each token's loss by
``min(pi_old_trainer / pi_engine, cap)``, as verl/slime apply it.

Staleness (``staleness=k``: the engine samples with the weights of k updates ago) and where the old log-probs come
from (``old_logprobs``):

* ``current`` (default): the trainer's current weights recompute them, so their gap to the engine is the policy lag
  and the engine-trainer mismatch together.
* ``behaviour`` (matched weights, as verl's fully-async trainer and slime's ``--keep-old-actor``): a second scorer of
  the trainer's kind holds the snapshot the engine sampled with (:func:`scorer_at`) and scores the batch at those
  weights (R3 replays the engine's routes there and in every later forward; R2 records its routes there). Each step
  reports the engine-trainer mismatch at matched weights (``mismatch/*``, ``async/k3_kl_engine_trainer``: what replay
  addresses) apart from the policy lag (``async/k3_kl_policy_lag``: the current weights against the behaviour
  weights). The objective is decoupled (Hilton et al.; AReaL): the ratio is taken to the proximal policy (the
  current weights before the update, under the mode's routing) and each token is weighted by the truncated
  behaviour -> proximal weight ``min(pi_proximal / pi_engine, behaviour_cap)``; with ``tis_cap`` as well the weight
  is split at the behaviour weights, ``min(pi_proximal / pi_behaviour, behaviour_cap) * min(pi_behaviour /
  pi_engine, tis_cap)``.

Multi-turn (``turns > 1``, :mod:`r3lab.experiments.multiturn`): each trajectory is sampled turn by turn with an
observation of corpus words appended between turns; the routes replayed are stitched per turn (decode routes for
sampled tokens, prefill routes for prompt and observation tokens) and the loss covers sampled tokens only
(``PolicyUpdate.loss_mask``).

Objectives (``loss``): token-level GRPO (the default) or sequence-level GSPO (``r3lab.trainers.loss``); TIS is
orthogonal to both.

Tasks (``task``, :mod:`r3lab.experiments.tasks`): ``letter`` (distinct words starting with a target letter) and
``edges`` (distinct uncommon corpus transitions), on the made-up words of the shipped Markov corpus; responses of
``max_tokens`` tokens (up to 256 on CPU).

Collapse (:func:`r3lab.metrics.reward_collapse`): the reward stays below half its running peak for 5 steps after
a 10-step warm-up; every step logs the detector's state (``collapse/*``) and the precursors the field reports
(clip fraction, F(2), the largest |dlogp|, the IS effective sample size, on the engine-trainer and on the policy
side); the summary gives ``collapse/step`` and ``collapse/reason``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.config import MODES, OLD_LOGPROBS, RLConfig, RLMetric, run_name
from r3lab.corpus import corpus_prompts
from r3lab.doctor import diagnose
from r3lab.errors import ConfigError, R3LabError
from r3lab.experiments.multiturn import engine_prefix_cache, prefill_vs_decode, rollout_turns
from r3lab.experiments.tasks import LetterTask, make_task
from r3lab.labels import label
from r3lab.paths import model_dir
from r3lab.rollout import RolloutEngine, RolloutResult, SamplingConfig, append_last_row
from r3lab.routes import Routes
from r3lab.runs import RunWriter, Samples
from r3lab.trainer_registry import TRAINER_REGISTRY, TrainerOptions
from r3lab.trainer_registry import load_trainer as load_registered
from r3lab.trainers import PolicyUpdate, Scorer, TokenBatch, Trainer
from r3lab.trainers.base import LoadsWeights

__all__ = [
    "MODES",
    "OLD_LOGPROBS",
    "RLConfig",
    "LetterTask",
    "RolloutBatch",
    "OldPolicy",
    "StepResult",
    "RLRun",
    "load_trainer",
    "scorer_at",
    "trainer_notes",
    "old_policy",
    "policy_updates",
    "train_step",
    "run_rl",
    "run_comparison",
    "collapse_summary",
    "comparison_rows",
    "comparison_table",
    "COMPARISON_METRICS",
]


@dataclass(frozen=True)
class RolloutBatch:
    """A rollout batch as the trainer sees it: the samples, the engine's view of them, rewards and advantages."""

    tokens: TokenBatch
    logp_infer: np.ndarray  # [N] the engine's log-probs of the sampled tokens, sample-major
    engine_routes: Routes  # one sequence per sample, P + R rows (the trainer's row convention)
    advantages: np.ndarray  # [B] group-normalised rewards (GRPO)
    rewards: np.ndarray  # [B]
    loss_mask: np.ndarray | None = None  # [N] multi-turn: True at sampled tokens (logp_infer is NaN elsewhere)

    @classmethod
    def from_results(cls, results: Sequence[RolloutResult], rewards: np.ndarray, group: int) -> RolloutBatch:
        """The engine's samples in prompt-major groups of ``group`` completions, with their rewards."""
        g = np.asarray(rewards, dtype=np.float64).reshape(-1, group)
        adv = ((g - g.mean(axis=1, keepdims=True)) / (g.std(axis=1, keepdims=True) + 1e-6)).reshape(-1)
        routes = Routes.concat([append_last_row(r.routes) for r in results])
        logp = np.concatenate([np.asarray(r.logprobs, dtype=np.float64) for r in results])
        return cls(TokenBatch.from_results(results), logp, routes, adv, np.asarray(rewards))

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Any], rewards: np.ndarray, group: int) -> RolloutBatch:
        """Multi-turn trajectories (:class:`r3lab.experiments.multiturn.Trajectory`) as a batch: every token after the
        first prompt is scored, the loss mask keeps the sampled ones, the routes are the stitched per-turn ones."""
        g = np.asarray(rewards, dtype=np.float64).reshape(-1, group)
        adv = ((g - g.mean(axis=1, keepdims=True)) / (g.std(axis=1, keepdims=True) + 1e-6)).reshape(-1)
        tokens = TokenBatch.from_ids([t.token_ids for t in trajectories], [len(t.prompt_ids) for t in trajectories])
        routes = Routes.concat([append_last_row(t.routes) for t in trajectories])
        logp = np.concatenate([t.logprobs for t in trajectories])
        mask = np.concatenate([t.sampled for t in trajectories])
        return cls(tokens, logp, routes, adv, np.asarray(rewards), mask)

    def sampled(self, values: np.ndarray) -> np.ndarray:
        """``values`` (one per scored token) at the sampled tokens: all of them, or the loss mask's."""
        return values if self.loss_mask is None else values[self.loss_mask]

    @property
    def cu_sampled(self) -> np.ndarray:
        """Offsets of each sample's sampled tokens in ``sampled(...)`` arrays."""
        if self.loss_mask is None:
            return self.cu_tokens
        per = np.add.reduceat(self.loss_mask.astype(np.int64), self.cu_tokens[:-1])
        return np.concatenate([[0], np.cumsum(per)])

    @property
    def cu_tokens(self) -> np.ndarray:
        """Offsets of each sample's sampled tokens in the flat token arrays."""
        return np.concatenate([[0], np.cumsum(self.tokens.response_lengths)])


@dataclass(frozen=True)
class OldPolicy:
    """The old policy on a rollout batch: the log-probs the loss divides by, its own routes, and their diagnostics."""

    logp_old: np.ndarray  # [N] the loss's old log-probs (R3: replaying the engine's routes; else native)
    logp_native: np.ndarray  # [N] the trainer's own routing
    native_routes: Routes  # what the trainer routed natively: R2's replay data
    metrics: dict[str, Any]  # mismatch/* and routing/* of the step
    tokens: dict[str, np.ndarray]  # per sampled token: flipped, flipped_layers
    logp_behaviour: np.ndarray | None = None  # [N] old_logprobs="behaviour": the trainer at the behaviour weights
    weights: np.ndarray | None = None  # [N] old_logprobs="behaviour": the decoupled objective's token weights


@dataclass(frozen=True)
class StepResult:
    """One RL step's trainer side: its metrics (one step line of the run) and its per-token table."""

    metrics: dict[str, Any]
    tokens: dict[str, np.ndarray]


def load_trainer(config: RLConfig, path: str | os.PathLike) -> Trainer:
    """The RL trainer of ``config``: transformers (``trainer_dtype`` with ``router_dtype`` routers) or Megatron-core
    on ``tp * pp * dp`` CPU ranks (``config.trainer == "megatron"``, fp32 routers), each with AdamW at ``lr``."""
    return load_registered(config.trainer, path, TrainerOptions(dtype=config.trainer_dtype, router_dtype=config.router_dtype, tp=config.tp, pp=config.pp, ep=config.ep, lr=config.lr))  # noqa: E501


def scorer_at(config: RLConfig, path: str | os.PathLike, weights: Any, *, scorer: Any = None) -> Scorer:
    """A scorer of ``config``'s trainer kind holding ``weights`` (a snapshot from ``export_weights``): the trainer-side
    copy of the behaviour weights. ``scorer`` (one this returned before) is reused: only the weights are loaded.

    Built by :func:`load_trainer`, so it runs in the trainer's own dtypes, mode and numerics; the trainer kind must
    load weights back (:class:`r3lab.trainers.base.LoadsWeights`).
    """
    if scorer is None:
        scorer = load_trainer(config, path)
    if not isinstance(scorer, LoadsWeights):
        raise ConfigError(f"old_logprobs='behaviour' needs a trainer that loads exported weights back "
                          f"(load_weights); the {getattr(scorer, 'name', type(scorer).__name__)!r} trainer does not")
    scorer.load_weights(weights)
    loaded: Any = scorer  # a Scorer that also loads weights
    return loaded


def trainer_notes(config: Mapping[str, Any]) -> dict[str, str]:
    """What the run summary and the comparison table must say about the trainer: ``note/group_routing`` when the
    Megatron trainer routes the model natively differently from the engine by construction (group-limited routing,
    :func:`r3lab.families.group_routing_mismatch`; the drift table says the same)."""
    if not getattr(TRAINER_REGISTRY.get(str(config.get("trainer"))), "group_routing_notes", False):
        return {}
    from r3lab.families import group_routing_note, model_group_routing

    try:
        why = model_group_routing(model_dir(config["model"], config.get("data")))
    except R3LabError as e:  # a run read on a machine without its model: say so, never drop the question
        return {"note/group_routing": f"{config['model']}: not checked ({e})"}
    if why is None:
        return {}
    return {"note/group_routing": group_routing_note(Path(str(config["model"])).name, why, "Its \"none\" and R2 runs' engine-trainer mismatch includes")}  # noqa: E501


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
    if config.mode == "R3":
        logp_old = ref.score(batch.tokens, routes=batch.engine_routes).logprobs
    else:
        logp_old = native.logprobs
    mismatch = metrics.mismatch_metrics(batch.sampled(logp_old), batch.sampled(batch.logp_infer),
                                        cu_seqlens=batch.cu_sampled, tis_cap=config.tis_cap or 2.0)
    rec: dict[str, Any] = {f"mismatch/{k}": v for k, v in mismatch.items()}
    own = native.routes
    differs = metrics.set_differs(batch.engine_routes.select_layers(own.layer_ids).values, own.values)
    rec[RLMetric.ENGINE_TRAINER_DISAGREEMENT] = float(differs.mean())
    rec["routing/engine_trainer_disagreement_per_layer"] = {
        int(g): float(v) for g, v in zip(own.layer_ids, differs.mean(axis=0), strict=True)}
    rec["routing/engine_trainer_token_any"] = float(differs.any(axis=1).mean())
    rows = metrics.response_rows(batch.engine_routes.cu_seqlens, batch.tokens.response_lengths, metrics.TRAINER_ROWS)
    flipped = differs.any(axis=1)[rows]
    sampled_flipped = batch.sampled(flipped)
    for name, k3 in metrics.k3_by_flip(batch.sampled(logp_old), batch.sampled(batch.logp_infer),
                                       sampled_flipped).items():
        rec[f"mismatch/k3_kl_{name}"] = k3
    rec["routing/flipped_token_share"] = float(sampled_flipped.mean())
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
    replay = {"R2": behaviour_native.routes, "R3": batch.engine_routes}.get(config.mode)
    logp_prox = current.logprobs if replay is None else trainer.score(batch.tokens, routes=replay).logprobs
    prox, behav, infer = (batch.sampled(a) for a in (logp_prox, logp_behaviour, batch.logp_infer))
    rec[RLMetric.K3_ENGINE_TRAINER_MATCHED] = metrics.k3_kl(behav, infer)
    rec[RLMetric.K3_POLICY_LAG] = metrics.k3_kl(prox, behav)
    rec[RLMetric.K3_ENGINE_CURRENT] = metrics.k3_kl(prox, infer)
    rec["async/extreme_frac_tau2_policy_lag"] = metrics.extreme_token_fraction(prox, behav, 2.0)
    lag_routes: Any = current.routes  # recorded (record=True)
    rec["async/route_change_lag"] = float(metrics.set_differs(behaviour_native.routes.values, lag_routes.values).mean())
    if config.tis_cap is None:
        raw = np.exp(logp_prox - batch.logp_infer)
        weights = np.minimum(raw, config.behaviour_cap)
    else:
        raw = np.exp(logp_prox - logp_behaviour)
        weights = np.minimum(raw, config.behaviour_cap) * np.minimum(np.exp(logp_behaviour - batch.logp_infer),
                                                                     config.tis_cap)
    rec["async/behaviour_weight_mean"] = float(batch.sampled(weights).mean())
    rec["async/behaviour_weight_truncated"] = float((batch.sampled(raw) > config.behaviour_cap).mean())
    return OldPolicy(logp_prox, current.logprobs, behaviour_native.routes, rec, tokens, logp_behaviour, weights)


UPDATE_STATS = ("loss", "clip_frac", "approx_kl", "grad_norm", "entropy", "route_change", "used_route_change",
                 "tis_weight_mean")
# collapse precursors on the policy side, per mini-batch (the maximum over the update is what bursts)
_PRECURSORS = ("clip_frac", "grad_norm", "policy_abs_dlogp", "policy_is_ess")


def policy_updates(trainer: Trainer, batch: RolloutBatch, old: OldPolicy, config: RLConfig,
                   rng: np.random.Generator) -> tuple[dict[str, Any], np.ndarray]:
    """``mini_batches`` clipped policy steps over a shuffled split of the batch; replays per ``config.mode``.

    Returns the update's metrics (train/*, the route change of the policy, the noise floor of the trainer) and the
    samples of the first mini-batch.
    """
    chunks = np.array_split(rng.permutation(len(batch.tokens)), config.mini_batches)
    tok_sample = batch.tokens.token_sample
    stats: dict[str, list[float]] = {k: [] for k in UPDATE_STATS}
    precursors: dict[str, list[float]] = {k: [] for k in _PRECURSORS}
    gspo = config.loss == "gspo"
    first_mb_gap = trainer_floor = 0.0
    for mb, idx in enumerate(np.sort(c) for c in chunks):
        sub = batch.tokens.take(idx)
        sel = np.isin(tok_sample, idx)
        # what the current policy would route natively, against the old policy's routes (what R2 freezes)
        now = trainer.score(sub, record=True)
        old_sub = old.native_routes.take(idx)
        stats["route_change"].append(float(metrics.set_differs(old_sub.values, now.routes.values).mean()))
        replay = {"R2": old_sub, "R3": batch.engine_routes.take(idx)}.get(config.mode)
        update = PolicyUpdate(old_logprobs=old.logp_old[sel], advantages=batch.advantages[tok_sample[sel]],
                              infer_logprobs=batch.logp_infer[sel],
                              clip_eps=config.gspo_clip_eps if gspo else config.clip_eps,
                              tis_cap=config.tis_cap if old.weights is None else None,  # matched: in the weights
                              max_grad_norm=config.max_grad_norm, loss=config.loss,
                              clip_eps_high=config.gspo_clip_eps_high if gspo else None,
                              token_sample=sub.token_sample,
                              loss_mask=None if batch.loss_mask is None else batch.loss_mask[sel],
                              token_weights=None if old.weights is None else old.weights[sel])
        step = trainer.policy_step(sub, update, routes=replay)
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
        drift = step.logprobs - old.logp_old[sel]
        precursors["clip_frac"].append(step.clip_frac)
        precursors["grad_norm"].append(step.grad_norm)
        precursors["policy_abs_dlogp"].append(float(np.abs(drift).max()))
        precursors["policy_is_ess"].append(metrics.effective_sample_size(drift))
    rec: dict[str, Any] = {f"train/{k}": float(np.mean(v)) if v else None for k, v in stats.items()}
    rec[RLMetric.CLIP_FRAC_MAX] = max(precursors["clip_frac"])
    rec["train/grad_norm_max"] = max(precursors["grad_norm"])
    rec[RLMetric.POLICY_ABS_DIFF_MAX] = max(precursors["policy_abs_dlogp"])
    rec[RLMetric.POLICY_IS_ESS] = min(precursors["policy_is_ess"])
    rec["routing/route_change_first_mb"] = stats["route_change"][0]
    rec[RLMetric.ROUTE_CHANGE_LAST_MB] = stats["route_change"][-1]
    rec[RLMetric.USED_ROUTE_CHANGE_LAST_MB] = stats["used_route_change"][-1]
    rec["train/first_mb_logp_gap_to_native"] = first_mb_gap
    # the trainer against itself: the same tokens under the same weights, scored in another batch composition
    rec["noise/k3_kl_trainer_vs_trainer"] = trainer_floor
    return rec, np.sort(chunks[0])


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


def step_samples(results: Sequence[Any], *, multiturn: bool = False) -> Samples:
    """A step's samples (engine results, or multi-turn trajectories) as the run's per-sample table: token ids, the
    engine's log-probs and, multi-turn, which response tokens the engine sampled."""
    return Samples.from_ids([r.prompt_ids for r in results], [r.token_ids[len(r.prompt_ids):] for r in results],
                            [r.logprobs for r in results], [r.sampled for r in results] if multiturn else None)


@dataclass
class RLRun:
    """What ``run_rl`` returns: the per-step records (also in the run folder) and the folder, if written."""

    config: RLConfig
    steps: list[dict[str, Any]]
    path: Any = None


def run_rl(config: RLConfig, *, engine: RolloutEngine | None = None, runs_root: Any = None, run_name: str | None = None,
           progress: bool = True, on_step: Callable[[dict[str, Any]], None] | None = None) -> RLRun:
    """Run one GRPO job in ``config.mode``; write it to ``runs_root/run_name`` when ``runs_root`` is given.

    ``engine`` may be an engine already holding ``config.model``; its weights are reset to the checkpoint
    first, so several runs can share one engine start.
    """
    import torch
    from tqdm.auto import tqdm

    path = model_dir(config.model, config.data)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    own_engine = engine is None
    if not own_engine and getattr(engine, "engine_quant", "none") != config.engine_quant:
        raise ConfigError(f"the engine given runs engine_quant={engine.engine_quant!r}, the config asks for "
                          f"{config.engine_quant!r}: start it with RolloutEngine(..., engine_quant=...)")
    if engine is None:
        engine = RolloutEngine(path, seed=config.seed, dtype=config.engine_dtype, engine_quant=config.engine_quant)
    writer = None
    trainer = behaviour = None
    try:
        trainer = load_trainer(config, path)
        checkpoint = trainer.export_weights()
        engine.update_weights(checkpoint, version=0)  # a shared engine starts from the checkpoint too
        task = make_task(engine.tokenizer, config)
        behaviour_weights = checkpoint  # what the engine holds: the weights its rollouts are sampled with
        behaviour = None
        if runs_root is not None:
            name = run_name or f"rl-{config.model}-{config.mode}-s{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
            writer = RunWriter(runs_root, name, "rl", config.to_dict())
        history: list[dict[str, Any]] = []
        snapshots: list[Any] = [checkpoint]  # weights after update u, for stale rollouts
        G = config.samples_per_prompt
        for step in tqdm(range(config.steps), desc=f"rl {config.mode}", unit="step", disable=not progress):
            t0 = time.perf_counter()
            prompts = corpus_prompts(config.prompts_per_step, words=config.prompt_words,
                                     seed=config.seed * 1_000_003 + step, data=config.data)
            sampling = SamplingConfig(max_tokens=config.max_tokens, temperature=config.temperature, n=G,
                                      seed=config.seed * 1_000_003 + step, ignore_eos=True)
            turn_rec: dict[str, Any] = {}
            if config.turns == 1:
                results: Sequence[Any] = engine.generate(prompts, sampling)
            else:
                results = rollout_turns(engine, prompts, sampling, turns=config.turns,
                                        observation_words=config.observation_words,
                                        seed=config.seed * 1_000_003 + step, data=config.data)
                turn_rec = {f"multiturn/prefill_vs_held_{k}": v for k, v in prefill_vs_decode(results).items()}
                cache = engine_prefix_cache(engine)  # a cached full block returns stored routes, not a new prefill
                turn_rec.update({"multiturn/prefix_cache_block_size": cache["block_size"] if cache["enabled"] else 0,
                                 "multiturn/longest_trajectory": max(len(t.token_ids) for t in results)})
            t_gen = time.perf_counter() - t0
            rewards = np.array([task.reward(r.response_ids) for r in results])
            if config.turns == 1:
                batch = RolloutBatch.from_results(results, rewards, G)
            else:
                batch = RolloutBatch.from_trajectories(results, rewards, G)
            if config.noise_every and step % config.noise_every == 0:
                # the engine against itself: the sampled tokens scored again by prefill, in another batch
                again = engine.score([r.token_ids for r in results], start=[len(r.prompt_ids) for r in results])
                noise = metrics.k3_kl(batch.sampled(np.concatenate(again).astype(np.float64)),
                                      batch.sampled(batch.logp_infer))
            else:
                noise = None
            if config.old_logprobs == "behaviour":
                behaviour = scorer_at(config, path, behaviour_weights, scorer=behaviour)
            result = train_step(trainer, batch, config, rng, behaviour=behaviour)
            rec = result.metrics
            rec.update(turn_rec)
            rec["noise/k3_kl_engine_vs_engine"] = noise
            rec.update(step=step, **{RLMetric.REWARD: float(rewards.mean())}, reward_std=float(rewards.std()),
                       engine_weight_version=engine.weight_version, time_generate_s=t_gen)
            snapshots.append(trainer.export_weights())  # weights after update step + 1
            behind = min(config.staleness, len(snapshots) - 1)
            t1 = time.perf_counter()
            behaviour_weights = snapshots[-1 - behind]
            engine.update_weights(behaviour_weights, version=step + 1 - behind)
            snapshots = snapshots[-(config.staleness + 1) :]
            rec["time_weight_sync_s"] = time.perf_counter() - t1
            rec["time_step_s"] = time.perf_counter() - t0
            history.append(rec)
            rec.update(_collapse_state(history))
            if writer is not None:
                if step in (0, config.steps - 1) or (config.token_steps and step % config.token_steps == 0):
                    writer.write_tokens(step, result.tokens)
                writer.write_samples(step, step_samples(results, multiturn=config.turns > 1))  # every step, with
                writer.write_routes(step, "engine", batch.engine_routes)  # its engine routes: it can be scored again
                writer.log_step(rec)
            if on_step is not None:
                on_step(rec)
        summary = _summary(history)
        summary.update(collapse_summary(history))
        summary.update(trainer_notes(config.to_dict()))
        if writer is not None:
            report = diagnose(writer.path)  # the field's silent failures, checked on what this run wrote
            summary.update(report.summary())
            if not report.ok:
                print(report.text(), file=sys.stderr)
            writer.finish(summary)
        return RLRun(config, history, writer.path if writer is not None else None)
    finally:
        if writer is not None:
            writer.close()
        for held in (trainer, behaviour):  # a multi-process trainer (Megatron's ranks) ends them
            if held is not None:
                held.close()
        if own_engine:
            engine.close()


def _summary(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means over the run and over its last quarter, and the reward's first and last quarter."""
    keys = sorted({k for h in history for k, v in h.items() if isinstance(v, int | float) and k != "step"})
    q = max(1, len(history) // 4)
    out: dict[str, Any] = {"steps": len(history)}
    for k in keys:
        vals = np.array([h[k] for h in history if h.get(k) is not None], dtype=np.float64)
        if vals.size:
            out[f"mean/{k}"] = float(vals.mean())
            out[f"last_quarter/{k}"] = float(vals[-q:].mean())
    r = np.array([h["reward_mean"] for h in history])
    out["reward_first_quarter"] = float(r[:q].mean())
    out["reward_last_quarter"] = float(r[-q:].mean())
    return out


_COLLAPSE_ARGS: dict[str, Any] = {"warmup": 10, "patience": 5, "fraction": 0.5, "min_peak": 0.05}


def _collapse_state(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The detector's state at the last step of ``history`` (it only looks back: the step log can carry it)."""
    c = metrics.reward_collapse(np.array([h[RLMetric.REWARD] for h in history]), **_COLLAPSE_ARGS)
    peak = c.peak[-1]
    return {RLMetric.COLLAPSE_PEAK: None if np.isnan(peak) else float(peak),
            RLMetric.COLLAPSE_STREAK: int(c.streak[-1]), RLMetric.COLLAPSED: bool(c.collapsed[-1])}


def collapse_summary(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run summary's collapse block: ``collapse/step`` and ``collapse/reason`` (None: no collapse), the
    definition and its parameters, and the first step of each precursor blow-up (10x its trailing 5-step median:
    k3, the largest |dlogp| and the policy's largest |dlogp|; the clip fraction above 0.5; the IS ESS below 0.5)."""
    r = np.array([h[RLMetric.REWARD] for h in history], dtype=np.float64)
    c = metrics.reward_collapse(r, **_COLLAPSE_ARGS)
    out: dict[str, Any] = {RLMetric.COLLAPSE_STEP: c.step, "collapse/detected_step": c.detected,
                           "collapse/definition": metrics.COLLAPSE_DEFINITION, "collapse/parameters": _COLLAPSE_ARGS,
                           RLMetric.COLLAPSE_REASON: None}
    if c.step is not None and c.detected is not None:
        s, d = c.step, c.detected
        peak = float(c.peak[s])
        out[RLMetric.COLLAPSE_REASON] = (f"reward {r[s]:.3f} at step {s} fell below half its running peak "
                                         f"{peak:.3f} (step {int(np.nanargmax(r[: s + 1]))}) and stayed there "
                                         f"through step {d}")

    def series(key: str) -> np.ndarray:
        return np.array([np.nan if h.get(key) is None else h[key] for h in history], dtype=np.float64)

    for key in (RLMetric.K3_KL, RLMetric.ABS_DIFF_MAX, RLMetric.POLICY_ABS_DIFF_MAX):
        out[f"collapse/first_blowup_step/{key}"] = metrics.first_step(metrics.jump_steps(series(key)))
    out[f"collapse/first_blowup_step/{RLMetric.CLIP_FRAC_MAX}"] = metrics.first_step(series(RLMetric.CLIP_FRAC_MAX)
                                                                                     > 0.5)
    for key in (RLMetric.IS_ESS, RLMetric.POLICY_IS_ESS):
        out[f"collapse/first_blowup_step/{key}"] = metrics.first_step(series(key) < 0.5)
    return out


def run_comparison(base: RLConfig, *, modes: Sequence[str] = MODES, seeds: Sequence[int] = (0, 1, 2),
                   runs_root: Any = None, prefix: str | None = None, progress: bool = True) -> list[RLRun]:
    """Every (mode, seed) of ``base`` on one engine start, written to ``runs_root`` as ``<prefix>-<mode>-s<seed>``."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"modes must be among {MODES}, got {list(modes)}")
    path = model_dir(base.model, base.data)
    prefix = prefix or f"rl-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = []
    with RolloutEngine(path, seed=base.seed, dtype=base.engine_dtype, engine_quant=base.engine_quant) as engine:
        for seed in seeds:
            for mode in modes:
                cfg = dataclasses.replace(base, mode=mode, seed=int(seed))
                out.append(run_rl(cfg, engine=engine, runs_root=runs_root, run_name=run_name(prefix, mode, seed),
                                  progress=progress))
    return out


COMPARISON_METRICS = tuple((key, label(key), fmt) for key, fmt in (  # (record key, column title, format)
    (RLMetric.REWARD, ".3f"),
    (RLMetric.K3_KL, ".2e"),
    (RLMetric.F_1_5, ".4f"),
    (RLMetric.ABS_DIFF, ".4f"),
    (RLMetric.ENGINE_TRAINER_DISAGREEMENT, ".3f"),
    (RLMetric.ROUTE_CHANGE_LAST_MB, ".3f"),
    (RLMetric.USED_ROUTE_CHANGE_LAST_MB, ".3f"),
    (RLMetric.CLIP_FRAC, ".3f"),
))


def comparison_rows(steps_by_run: Sequence[tuple[RLConfig | dict, Sequence[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Per (model, mode): each metric's run mean, as min / median / max over seeds, plus the reward's rise."""
    groups: dict[tuple[str, str], list[Sequence[dict[str, Any]]]] = {}
    notes: dict[tuple[str, str], dict[str, str]] = {}
    for cfg, steps in steps_by_run:
        c = cfg if isinstance(cfg, dict) else cfg.to_dict()
        groups.setdefault((c["model"], c["mode"]), []).append(steps)
        notes.setdefault((c["model"], c["mode"]), {}).update(trainer_notes(c))
    rows = []
    for (model, mode), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], MODES.index(kv[0][1]))):
        row: dict[str, Any] = {"model": model, "mode": mode, "seeds": len(runs), "steps": len(runs[0]),
                               "notes": notes.get((model, mode), {})}
        for key, _, _ in COMPARISON_METRICS:
            means = [float(np.mean([s[key] for s in steps if s.get(key) is not None])) for steps in runs]
            row[key] = (min(means), float(np.median(means)), max(means))
        q = max(1, len(runs[0]) // 4)
        rise = [float(np.mean([s["reward_mean"] for s in st[-q:]]) - np.mean([s["reward_mean"] for s in st[:q]]))
                for st in runs]
        row["reward_rise"] = (min(rise), float(np.median(rise)), max(rise))
        rows.append(row)
    return rows


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per (model, mode), every cell min / median / max over seeds of the run's mean (one
    seed: its value alone, no range)."""
    titles = [*[title for _, title, _ in COMPARISON_METRICS], label("reward_rise")]
    head = ["model", "mode", "seeds x steps", *[t.replace("|", "\\|") for t in titles]]  # a "|" would end the cell
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["mode"], f"{r['seeds']} x {r['steps']}"]
        one = r["seeds"] == 1
        for key, _, fmt in COMPARISON_METRICS:
            lo, mid, hi = r[key]
            cells.append(f"{mid:{fmt}}" if one else f"{mid:{fmt}} ({lo:{fmt}} - {hi:{fmt}})")
        lo, mid, hi = r["reward_rise"]
        cells.append(f"{mid:+.3f}" if one else f"{mid:+.3f} ({lo:+.3f} - {hi:+.3f})")
        lines.append("| " + " | ".join(cells) + " |")
    said = list(dict.fromkeys(n for r in rows for n in (r.get("notes") or {}).values()))
    lines += [line for n in said for line in ("", f"Note: {n}")]  # e.g. a Megatron trainer's group routing
    return "\n".join(lines) + "\n"
