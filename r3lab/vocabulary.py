"""The names that cross layers, each written once: record keys with their labels and units, run kinds, task names
and the reward-collapse rule.

An experiment writes a record key and a figure, a widget, the doctor and a table read it; a run's kind is written by
the experiment that made it and checked by every reader; a task is named by the config and built by the task
registry; the collapse rule is computed by :mod:`r3lab.metrics` and told in words by tables, figures and labels.
Each of these names is a constant here, and every other module uses the constant (``tests/test_vocabulary.py``
fails when one of these strings is written as a literal anywhere else in the package). The collapse rule's words
are generated from its numbers by :func:`collapse_prose`, so a changed number changes every sentence that tells it.

Nothing but the standard library: every layer of the package may import this module.

    >>> RLMetric.K3_KL, METRICS[RLMetric.K3_KL].unit
    ('mismatch/k3_kl', 'nats/token')
    >>> collapse_prose()
    'reward below half its running peak for 5 steps after a 10-step warm-up'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from r3lab.errors import ConfigError

__all__ = ["RLMetric", "DriftMetric", "Metric", "METRICS", "PLAIN_WORD_KEYS", "RunKind", "RUN_KINDS",
           "CAPTURE_LOG_KEY", "TaskName", "TASKS", "CollapseRule", "COLLAPSE_RULE", "LATE_COLLAPSE_RULE",
           "collapse_prose"]


# ---- record keys ---------------------------------------------------------------------------------------------------
class RLMetric:
    """Keys of the RL loop's step records (a run's steps.jsonl) and its summary: one name for the loop that writes
    them and the table, figures, widgets, doctor and notebooks that read them."""

    REWARD = "reward_mean"
    REWARD_FIRST_QUARTER = "reward_first_quarter"  # the run summary's reward over its first and last quarter
    REWARD_LAST_QUARTER = "reward_last_quarter"
    REWARD_RISE = "reward_rise"  # a comparison's last quarter minus first quarter
    K3_KL = "mismatch/k3_kl"  # train-inference k3 KL of the old policy against the engine
    F_1_5 = "mismatch/extreme_frac_tau1.5"
    F_2 = "mismatch/extreme_frac_tau2"
    ABS_DIFF = "mismatch/logprob_abs_diff_mean"
    MISMATCH_TOKENS = "mismatch/tokens"  # the tokens the step's mismatch metrics are over
    ENGINE_TRAINER_DISAGREEMENT = "routing/engine_trainer_disagreement"
    ENGINE_TRAINER_DISAGREEMENT_PER_LAYER = "routing/engine_trainer_disagreement_per_layer"  # {layer id: share}
    ENGINE_TRAINER_TOKEN_ANY = "routing/engine_trainer_token_any"  # tokens routed differently in some layer
    FLIPPED_TOKEN_SHARE = "routing/flipped_token_share"  # sampled tokens whose routing differs in any layer
    ENGINE_MAX_VIO = "routing/engine_max_vio"
    LOW_PROB = "mismatch/trainer_prob_below_1e-4"  # share of engine-sampled tokens the trainer gives p < 1e-4
    ZERO_ADVANTAGE_GROUPS = "train/zero_advantage_groups"  # share of prompt groups whose rewards are all equal
    ROUTE_CHANGE_FIRST_MB = "routing/route_change_first_mb"
    ROUTE_CHANGE_LAST_MB = "routing/route_change_last_mb"
    USED_ROUTE_CHANGE_LAST_MB = "routing/used_route_change_last_mb"
    # the router's own drift (per step, mean over its mini-batches): the trainer's live routing (the current policy
    # routing natively) against the routing its forwards replay
    ROUTER_IDS_DRIFT = "router/live_vs_replayed_ids"  # share of (token, layer) whose top-k set differs (not "none")
    ROUTER_ENGINE_IDS = "router/live_vs_engine_ids"  # the same against the engine's ids (every mode)
    ROUTER_WEIGHTS_L1 = "router/live_vs_engine_weights_l1"  # L1 over experts, live vs the engine's weights (the
    # engine captured them: R3W always; R3W's replayed weights)
    CLIP_FRAC = "train/clip_frac"
    GRAD_NORM = "train/grad_norm"  # mean over the step's mini-batches, before clipping
    ENTROPY = "train/entropy"  # the trainer's mean token entropy of the step (nats)
    FIRST_MB_LOGP_GAP = "train/first_mb_logp_gap_to_native"  # first mini-batch |log p - native log p| max
    # old_logprobs="behaviour": the two parts of the staleness mismatch, measured apart
    K3_ENGINE_TRAINER_MATCHED = "async/k3_kl_engine_trainer"  # engine vs trainer at the behaviour weights (replay's)
    K3_POLICY_LAG = "async/k3_kl_policy_lag"  # trainer at the current weights vs at the behaviour weights
    K3_ENGINE_CURRENT = "async/k3_kl_engine_vs_current"  # engine vs the current weights (both together)
    F_2_POLICY_LAG = "async/extreme_frac_tau2_policy_lag"
    ROUTE_CHANGE_LAG = "async/route_change_lag"  # routes changed between behaviour and current weights
    BEHAVIOUR_WEIGHT_MEAN = "async/behaviour_weight_mean"
    BEHAVIOUR_WEIGHT_TRUNCATED = "async/behaviour_weight_truncated"
    # what precedes collapse (the R3, TIS and GSPO reports): bursts of clipping, growing max |dlogp|, falling ESS
    ABS_DIFF_MAX = "mismatch/logprob_abs_diff_max"  # engine vs trainer (old policy)
    IS_ESS = "mismatch/is_eff_sample_size"  # of pi_old / pi_engine over the batch's tokens
    CLIP_FRAC_MAX = "train/clip_frac_max"  # the largest mini-batch clip fraction of the step
    GRAD_NORM_MAX = "train/grad_norm_max"  # the largest mini-batch gradient norm of the step, before clipping
    POLICY_ABS_DIFF_MAX = "train/policy_abs_dlogp_max"  # current vs old policy, over the step's updates
    POLICY_IS_ESS = "train/policy_is_ess"  # of pi_current / pi_old, the smallest over the step's mini-batches
    # the collapse detector (r3lab.metrics.reward_collapse): per step, and in the run summary
    COLLAPSE_PEAK = "collapse/reward_peak"
    COLLAPSE_STREAK = "collapse/streak"
    COLLAPSED = "collapse/collapsed"
    COLLAPSE_STEP = "collapse/step"
    COLLAPSE_REASON = "collapse/reason"
    # multi-turn RL (turns > 1)
    PREFIX_CACHE_BLOCK_SIZE = "multiturn/prefix_cache_block_size"
    LONGEST_TRAJECTORY = "multiturn/longest_trajectory"
    # noise floors: the same side scoring the same tokens twice
    ENGINE_NOISE_FLOOR = "noise/k3_kl_engine_vs_engine"
    TRAINER_NOISE_FLOOR = "noise/k3_kl_trainer_vs_trainer"
    ENGINE_WEIGHT_VERSION = "engine_weight_version"
    # timings (the RL step's, and a capture run's generation)
    TIME_GENERATE = "time_generate_s"
    TIME_WEIGHT_SYNC = "time_weight_sync_s"
    TIME_STEP = "time_step_s"


class DriftMetric:
    """Keys of the drift run's cells (its step records and summary), without replay ("none") and replaying (R3),
    and of its spread over seeds: written by :mod:`r3lab.experiments.drift` and ``r3lab rescore``, read by the
    drift figures and tables."""

    FLIPPED_SHARE = "flipped_share"
    K3_NONE = "k3_none"
    K3_R3 = "k3_r3"
    K3_FLIPPED_NONE = "k3_flipped_none"
    K3_FLIPPED_R3 = "k3_flipped_r3"
    K3_AGREEING_NONE = "k3_agreeing_none"
    K3_AGREEING_R3 = "k3_agreeing_r3"
    F2_NONE = "f2_none"
    F2_R3 = "f2_r3"
    ABS_DIFF_NONE = "abs_diff_none"
    ABS_DIFF_R3 = "abs_diff_r3"
    K3_TRAINER_FLOOR = "k3_trainer_floor"
    K3_ENGINE_FLOOR = "k3_engine_floor"
    CUT_OVERALL = "cut_overall"
    CUT_FLIPPED = "cut_flipped"
    AGREEING_R3_OVER_NONE = "agreeing_r3_over_none"


# ---- the reward-collapse rule --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CollapseRule:
    """The numbers of the reward-collapse detector (:func:`r3lab.metrics.reward_collapse`): after ``warmup`` steps,
    the step's mean reward below ``fraction`` of its running peak for ``patience`` consecutive steps, the peak being
    at least ``min_peak``. Bad numbers raise :class:`~r3lab.errors.ConfigError` naming them."""

    warmup: int
    patience: int
    fraction: float
    min_peak: float

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.patience < 1 or not 0 < self.fraction < 1 or self.min_peak < 0:
            raise ConfigError(f"a collapse rule needs warmup >= 0, patience >= 1, fraction in (0, 1) and min_peak "
                              f">= 0, got {self.warmup}, {self.patience}, {self.fraction}, {self.min_peak}")

    def parameters(self) -> dict[str, int | float]:
        """The detector's keyword arguments, ``{"warmup", "patience", "fraction", "min_peak"}`` in that order."""
        return dataclasses.asdict(self)


COLLAPSE_RULE = CollapseRule(warmup=10, patience=5, fraction=0.5, min_peak=0.05)  # every RL run's summary
# the long runs' variant (r3lab.metrics.late_collapse): the noisy first tens of steps neither set the peak nor count
LATE_COLLAPSE_RULE = dataclasses.replace(COLLAPSE_RULE, warmup=50, patience=10)


def _share_words(fraction: float) -> str:
    return "half" if fraction == 0.5 else f"{100 * fraction:g}% of"


def collapse_prose(rule: CollapseRule = COLLAPSE_RULE, *, subject: str = "reward", peak: str = "its running peak",
                   threshold: bool = True, streak: bool = True, warm_up: bool = True) -> str:
    """The collapse rule in words, generated from ``rule``'s numbers.

    The default reads "reward below half its running peak for 5 steps after a 10-step warm-up"; ``subject`` and
    ``peak`` change the words around the numbers ("seeds whose reward fell", "its peak"), and ``threshold``,
    ``streak`` and ``warm_up`` leave out "below half its running peak", "for 5 steps" or "after a 10-step warm-up"
    where a sentence tells that part already.

        >>> collapse_prose(LATE_COLLAPSE_RULE, subject="", threshold=False)
        'for 10 steps after a 50-step warm-up'
    """
    parts = [subject] if subject else []
    if threshold:
        parts.append(f"below {_share_words(rule.fraction)} {peak}")
    if streak:
        parts.append(f"for {rule.patience} step{'' if rule.patience == 1 else 's'}")
    if warm_up:
        parts.append(f"after a {rule.warmup}-step warm-up" if rule.warmup else "with no warm-up")
    return " ".join(parts)


# ---- labels and units of the record keys ---------------------------------------------------------------------------
Kind = Literal["percent", "number", "count", "seconds"]


@dataclass(frozen=True)
class Metric:
    """How one record key reads: ``label`` (human words), ``unit`` ("" when dimensionless; "%" for shares,
    whose values are fractions), ``kind`` (how values format) and ``scale`` (the axis it is drawn on)."""

    label: str
    unit: str = ""
    kind: Kind = "number"
    scale: Literal["linear", "log"] = "linear"


def _share(text: str, scale: Literal["linear", "log"] = "linear") -> Metric:
    return Metric(text, "%", "percent", scale)


_K3 = "nats/token"
_M, _D = RLMetric, DriftMetric
METRICS: dict[str, Metric] = {
    # the RL step records (r3lab.experiments.rl): mismatch of the trainer's old policy against the engine
    _M.K3_KL: Metric("train-inference k3 KL", _K3, scale="log"),
    _M.LOW_PROB: _share("engine-sampled tokens the trainer gives p < 1e-4"),
    _M.ZERO_ADVANTAGE_GROUPS: _share("prompt groups with equal rewards (zero advantage)"),
    "mismatch/k3_kl_flipped": Metric("k3 KL of route-flipped tokens", _K3, scale="log"),
    "mismatch/k3_kl_agreeing": Metric("k3 KL of agreeing tokens", _K3, scale="log"),
    _M.F_1_5: _share("F(1.5): tokens with ratio beyond 1.5x"),
    _M.F_2: _share("F(2): tokens with ratio beyond 2x"),
    _M.ABS_DIFF: Metric("mean |Δ log p|", "nats"),
    _M.ABS_DIFF_MAX: Metric("max |Δ log p|", "nats"),
    "mismatch/log_ppl_diff": Metric("log-perplexity difference (trainer - engine)", "nats"),
    "mismatch/ppl_ratio": Metric("perplexity ratio (trainer / engine)"),
    "mismatch/chi2_token": Metric("token χ² (E[ρ²] - 1)", scale="log"),
    "mismatch/probs_pearson_corr": Metric("Pearson correlation of token probabilities"),
    "mismatch/is_ratio_mean": Metric("mean importance ratio ρ"),
    "mismatch/is_ratio_max": Metric("max importance ratio ρ"),
    _M.IS_ESS: _share("effective sample size of ρ"),
    "mismatch/tis_clipfrac": _share("tokens with ρ above the TIS cap"),
    _M.MISMATCH_TOKENS: Metric("sampled tokens", "tokens", "count"),
    _M.ENGINE_TRAINER_DISAGREEMENT: _share("engine-trainer routing differs (token x layer)"),
    _M.ENGINE_TRAINER_DISAGREEMENT_PER_LAYER: _share("engine-trainer routing differs, per layer"),
    _M.ENGINE_TRAINER_TOKEN_ANY: _share("tokens routed differently in some layer"),
    _M.FLIPPED_TOKEN_SHARE: _share("sampled tokens route-flipped"),
    _M.ENGINE_MAX_VIO: Metric("engine load imbalance (max_vio)"),
    _M.ROUTE_CHANGE_FIRST_MB: _share("policy route change vs old policy (first mini-batch)"),
    _M.ROUTE_CHANGE_LAST_MB: _share("policy route change vs old policy (last mini-batch)"),
    _M.USED_ROUTE_CHANGE_LAST_MB: _share("used routes vs old policy (last mini-batch)"),
    _M.ROUTER_IDS_DRIFT: _share("live router vs replayed ids (token x layer)"),
    _M.ROUTER_ENGINE_IDS: _share("live router vs engine ids (token x layer)"),
    _M.ROUTER_WEIGHTS_L1: Metric("L1 live vs engine routing weights (over experts)"),
    "train/loss": Metric("policy loss"),
    _M.CLIP_FRAC: _share("clipped tokens"),
    "train/approx_kl": Metric("approx. KL to the old policy", _K3),
    _M.GRAD_NORM: Metric("gradient norm (before clipping)"),
    _M.ENTROPY: Metric("policy entropy", "nats"),
    "train/route_change": _share("policy route change vs old policy (mean over mini-batches)"),
    "train/used_route_change": _share("used routes vs old policy (mean over mini-batches)"),
    "train/tis_weight_mean": Metric("mean TIS weight"),
    _M.FIRST_MB_LOGP_GAP: Metric("first mini-batch |log p - native log p| max", "nats", scale="log"),
    _M.CLIP_FRAC_MAX: _share("clipped tokens (largest mini-batch)"),
    _M.GRAD_NORM_MAX: Metric("gradient norm, largest mini-batch (before clipping)"),
    _M.POLICY_ABS_DIFF_MAX: Metric("max |Δ log p| current vs old policy", "nats"),
    _M.POLICY_IS_ESS: _share("effective sample size of π / π_old (smallest mini-batch)"),
    # the collapse detector (r3lab.metrics.reward_collapse)
    _M.COLLAPSE_PEAK: Metric("running reward peak"),
    _M.COLLAPSE_STREAK: Metric(collapse_prose(subject="steps", peak="the reward peak", streak=False, warm_up=False),
                               "", "count"),
    _M.COLLAPSED: Metric(f"collapsed ({collapse_prose(peak='its peak', warm_up=False)})", "", "count"),
    _M.COLLAPSE_STEP: Metric("collapse step", "", "count"),
    _M.COLLAPSE_REASON: Metric("collapse reason"),
    # matched-weights staleness (old_logprobs="behaviour"): the mismatch and the policy lag apart
    _M.K3_ENGINE_TRAINER_MATCHED: Metric("k3 KL engine vs trainer at the behaviour weights", _K3, scale="log"),
    _M.K3_POLICY_LAG: Metric("k3 KL policy lag (current vs behaviour weights)", _K3, scale="log"),
    _M.K3_ENGINE_CURRENT: Metric("k3 KL engine vs current weights", _K3, scale="log"),
    _M.F_2_POLICY_LAG: _share("F(2) of the policy lag"),
    _M.ROUTE_CHANGE_LAG: _share("routes changed between behaviour and current weights"),
    _M.BEHAVIOUR_WEIGHT_MEAN: Metric("mean behaviour -> proximal weight"),
    _M.BEHAVIOUR_WEIGHT_TRUNCATED: _share("behaviour weights truncated"),
    # multi-turn RL (turns > 1): a later turn's prefill against the routes held for earlier tokens
    "multiturn/prefill_vs_held_decode_rows": _share("later-turn prefill differs from held routes (decode rows)"),
    "multiturn/prefill_vs_held_prefill_rows": _share("later-turn prefill differs from held routes (prefill rows)"),
    "multiturn/prefill_vs_held_token_any_decode": _share("decode tokens with a prefill difference in any layer"),
    "multiturn/prefill_vs_held_rows_compared": Metric("rows compared with a later prefill", "rows", "count"),
    _M.PREFIX_CACHE_BLOCK_SIZE: Metric("prefix cache block size (0: off)", "tokens", "count"),
    _M.LONGEST_TRAJECTORY: Metric("longest trajectory", "tokens", "count"),
    _M.ENGINE_NOISE_FLOOR: Metric("noise floor: engine vs engine k3 KL", _K3, scale="log"),
    _M.TRAINER_NOISE_FLOOR: Metric("noise floor: trainer vs trainer k3 KL", _K3, scale="log"),
    _M.REWARD: Metric("reward (mean over samples)"),
    "reward_std": Metric("reward (std over samples)"),
    _M.REWARD_FIRST_QUARTER: Metric("reward, first quarter of the run"),
    _M.REWARD_LAST_QUARTER: Metric("reward, last quarter of the run"),
    _M.REWARD_RISE: Metric("reward rise (last - first quarter)"),
    _M.ENGINE_WEIGHT_VERSION: Metric("engine weight version", "", "count"),
    _M.TIME_GENERATE: Metric("generation time", "s", "seconds"),
    _M.TIME_WEIGHT_SYNC: Metric("weight sync time", "s", "seconds"),
    _M.TIME_STEP: Metric("step time", "s", "seconds"),
    "step": Metric("RL step", "", "count"),
    "steps": Metric("RL steps", "", "count"),
    "seeds": Metric("seeds", "", "count"),
    # the drift run's cells (r3lab.experiments.drift): trainer without replay ("none") and replaying (R3)
    "tokens": Metric("sampled tokens", "tokens", "count"),
    _D.FLIPPED_SHARE: _share("sampled tokens route-flipped"),
    _D.K3_NONE: Metric("k3 KL, no replay", _K3, scale="log"),
    _D.K3_R3: Metric("k3 KL, R3", _K3, scale="log"),
    _D.K3_FLIPPED_NONE: Metric("k3 KL of route-flipped tokens, no replay", _K3, scale="log"),
    _D.K3_FLIPPED_R3: Metric("k3 KL of route-flipped tokens, R3", _K3, scale="log"),
    _D.K3_AGREEING_NONE: Metric("k3 KL of agreeing tokens, no replay", _K3, scale="log"),
    _D.K3_AGREEING_R3: Metric("k3 KL of agreeing tokens, R3", _K3, scale="log"),
    _D.F2_NONE: _share("F(2), no replay"),
    _D.F2_R3: _share("F(2), R3"),
    _D.ABS_DIFF_NONE: Metric("mean |Δ log p|, no replay", "nats"),
    _D.ABS_DIFF_R3: Metric("mean |Δ log p|, R3", "nats"),
    _D.K3_TRAINER_FLOOR: Metric("noise floor: trainer vs trainer k3 KL", _K3, scale="log"),
    _D.K3_ENGINE_FLOOR: Metric("noise floor: engine vs engine k3 KL", _K3, scale="log"),
    _D.CUT_OVERALL: Metric("R3's cut of k3 (none / R3)", "x"),
    _D.CUT_FLIPPED: Metric("R3's cut of k3 on route-flipped tokens", "x"),
    _D.AGREEING_R3_OVER_NONE: Metric("k3 of agreeing tokens, R3 / none", "x"),
}
# keys of the table that are also the run format's and the configs' ordinary words (a step record's "step", a
# config's "seeds", a column of "tokens"): labelled here, but written wherever those words mean something else
PLAIN_WORD_KEYS = frozenset({"step", "steps", "seeds", "tokens"})


# ---- run kinds -----------------------------------------------------------------------------------------------------
class RunKind:
    """The kind a run's config.json names (``Run.kind``): which experiment or importer wrote it, and so which
    records and tables it holds. The experiments' commands are named after the kind they write (``r3lab rl``)."""

    RL = "rl"  # r3lab.experiments.rl: one RL run per mode and seed
    DRIFT = "drift"  # r3lab.experiments.drift and r3lab rescore: one cell per (model, trainer setting, seed)
    CAPTURE = "capture"  # r3lab capture: an engine-only run, step 0 only, no trainer's tables or routes
    IMPORTED = "imported"  # r3lab.importers: a run written from another framework's dump


RUN_KINDS = (RunKind.RL, RunKind.DRIFT, RunKind.CAPTURE, RunKind.IMPORTED)
# the section of an imported run's config.json that holds the importer's capture log (the doctor reads it)
CAPTURE_LOG_KEY = "capture"


# ---- tasks ---------------------------------------------------------------------------------------------------------
class TaskName:
    """The RL tasks (``--task``; their rewards in :mod:`r3lab.experiments.tasks`)."""

    LETTER = "letter"
    EDGES = "edges"
    LADDER = "ladder"
    CHAIN = "chain"


# task name -> what the reward counts (the --task help; r3lab.experiments.tasks builds each by this name)
TASKS = {TaskName.LETTER: "distinct words starting with --target-letter, per response word",
         TaskName.EDGES: "distinct uncommon corpus transitions (not a word's most frequent successor), per transition",
         TaskName.LADDER: "transitions onto the next first letter of the cycle b d f ... z (then b), per transition",
         TaskName.CHAIN: "distinct words reached by a step onto the next first letter (the ladder's), per transition"}
