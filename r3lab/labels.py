"""One table of metric labels and units, for figures, widgets and tables alike (no torch, no plotly).

A record key such as ``routing/engine_max_vio`` maps to a :class:`Metric`: a human label, a unit, how its
values read (``kind``: a share shown in percent, a plain number, a count, seconds) and the axis it is best
drawn on (``scale``). The run summary's ``mean/<key>`` and ``last_quarter/<key>`` take their key's metric.
A key outside the table still displays (its label is the key itself); :func:`is_known` tells the two apart.

    >>> label("routing/engine_max_vio"), unit("routing/engine_max_vio")
    ('engine load imbalance (max_vio)', '')
    >>> axis_title("mismatch/extreme_frac_tau2")
    'F(2): tokens with ratio beyond 2x (%)'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["Metric", "METRICS", "metric", "label", "unit", "axis_title", "kind", "scale", "is_known", "format_value"]

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
METRICS: dict[str, Metric] = {
    # the RL step records (r3lab.experiments.rl): mismatch of the trainer's old policy against the engine
    "mismatch/k3_kl": Metric("train-inference k3 KL", _K3, scale="log"),
    "mismatch/k3_kl_flipped": Metric("k3 KL of route-flipped tokens", _K3, scale="log"),
    "mismatch/k3_kl_agreeing": Metric("k3 KL of agreeing tokens", _K3, scale="log"),
    "mismatch/extreme_frac_tau1.5": _share("F(1.5): tokens with ratio beyond 1.5x"),
    "mismatch/extreme_frac_tau2": _share("F(2): tokens with ratio beyond 2x"),
    "mismatch/logprob_abs_diff_mean": Metric("mean |Δ log p|", "nats"),
    "mismatch/logprob_abs_diff_max": Metric("max |Δ log p|", "nats"),
    "mismatch/log_ppl_diff": Metric("log-perplexity difference (trainer - engine)", "nats"),
    "mismatch/ppl_ratio": Metric("perplexity ratio (trainer / engine)"),
    "mismatch/chi2_token": Metric("token χ² (E[ρ²] - 1)", scale="log"),
    "mismatch/probs_pearson_corr": Metric("Pearson correlation of token probabilities"),
    "mismatch/is_ratio_mean": Metric("mean importance ratio ρ"),
    "mismatch/is_ratio_max": Metric("max importance ratio ρ"),
    "mismatch/is_eff_sample_size": _share("effective sample size of ρ"),
    "mismatch/tis_clipfrac": _share("tokens with ρ above the TIS cap"),
    "mismatch/tokens": Metric("sampled tokens", "tokens", "count"),
    "routing/engine_trainer_disagreement": _share("engine-trainer routing differs (token x layer)"),
    "routing/engine_trainer_disagreement_per_layer": _share("engine-trainer routing differs, per layer"),
    "routing/engine_trainer_token_any": _share("tokens routed differently in some layer"),
    "routing/flipped_token_share": _share("sampled tokens route-flipped"),
    "routing/engine_max_vio": Metric("engine load imbalance (max_vio)"),
    "routing/route_change_first_mb": _share("policy route change vs old policy (first mini-batch)"),
    "routing/route_change_last_mb": _share("policy route change vs old policy (last mini-batch)"),
    "routing/used_route_change_last_mb": _share("used routes vs old policy (last mini-batch)"),
    "router/live_vs_replayed_ids": _share("live router vs replayed ids (token x layer)"),
    "router/live_vs_engine_ids": _share("live router vs engine ids (token x layer)"),
    "router/live_vs_engine_weights_l1": Metric("L1 live vs engine routing weights (over experts)"),
    "train/loss": Metric("policy loss"),
    "train/clip_frac": _share("clipped tokens"),
    "train/approx_kl": Metric("approx. KL to the old policy", _K3),
    "train/grad_norm": Metric("gradient norm (before clipping)"),
    "train/entropy": Metric("policy entropy", "nats"),
    "train/route_change": _share("policy route change vs old policy (mean over mini-batches)"),
    "train/used_route_change": _share("used routes vs old policy (mean over mini-batches)"),
    "train/tis_weight_mean": Metric("mean TIS weight"),
    "train/first_mb_logp_gap_to_native": Metric("first mini-batch |log p - native log p| max", "nats", scale="log"),
    "train/clip_frac_max": _share("clipped tokens (largest mini-batch)"),
    "train/grad_norm_max": Metric("gradient norm, largest mini-batch (before clipping)"),
    "train/policy_abs_dlogp_max": Metric("max |Δ log p| current vs old policy", "nats"),
    "train/policy_is_ess": _share("effective sample size of π / π_old (smallest mini-batch)"),
    # the collapse detector (r3lab.metrics.reward_collapse)
    "collapse/reward_peak": Metric("running reward peak"),
    "collapse/streak": Metric("steps below half the reward peak", "", "count"),
    "collapse/collapsed": Metric("collapsed (reward below half its peak for 5 steps)", "", "count"),
    "collapse/step": Metric("collapse step", "", "count"),
    "collapse/reason": Metric("collapse reason"),
    # matched-weights staleness (old_logprobs="behaviour"): the mismatch and the policy lag apart
    "async/k3_kl_engine_trainer": Metric("k3 KL engine vs trainer at the behaviour weights", _K3, scale="log"),
    "async/k3_kl_policy_lag": Metric("k3 KL policy lag (current vs behaviour weights)", _K3, scale="log"),
    "async/k3_kl_engine_vs_current": Metric("k3 KL engine vs current weights", _K3, scale="log"),
    "async/extreme_frac_tau2_policy_lag": _share("F(2) of the policy lag"),
    "async/route_change_lag": _share("routes changed between behaviour and current weights"),
    "async/behaviour_weight_mean": Metric("mean behaviour -> proximal weight"),
    "async/behaviour_weight_truncated": _share("behaviour weights truncated"),
    # multi-turn RL (turns > 1): a later turn's prefill against the routes held for earlier tokens
    "multiturn/prefill_vs_held_decode_rows": _share("later-turn prefill differs from held routes (decode rows)"),
    "multiturn/prefill_vs_held_prefill_rows": _share("later-turn prefill differs from held routes (prefill rows)"),
    "multiturn/prefill_vs_held_token_any_decode": _share("decode tokens with a prefill difference in any layer"),
    "multiturn/prefill_vs_held_rows_compared": Metric("rows compared with a later prefill", "rows", "count"),
    "multiturn/prefix_cache_block_size": Metric("prefix cache block size (0: off)", "tokens", "count"),
    "multiturn/longest_trajectory": Metric("longest trajectory", "tokens", "count"),
    "noise/k3_kl_engine_vs_engine": Metric("noise floor: engine vs engine k3 KL", _K3, scale="log"),
    "noise/k3_kl_trainer_vs_trainer": Metric("noise floor: trainer vs trainer k3 KL", _K3, scale="log"),
    "reward_mean": Metric("reward (mean over samples)"),
    "reward_std": Metric("reward (std over samples)"),
    "reward_first_quarter": Metric("reward, first quarter of the run"),
    "reward_last_quarter": Metric("reward, last quarter of the run"),
    "reward_rise": Metric("reward rise (last - first quarter)"),
    "engine_weight_version": Metric("engine weight version", "", "count"),
    "time_generate_s": Metric("generation time", "s", "seconds"),
    "time_weight_sync_s": Metric("weight sync time", "s", "seconds"),
    "time_step_s": Metric("step time", "s", "seconds"),
    "step": Metric("RL step", "", "count"),
    "steps": Metric("RL steps", "", "count"),
    "seeds": Metric("seeds", "", "count"),
    # the drift run's cells (r3lab.experiments.drift): trainer without replay ("none") and replaying (R3)
    "tokens": Metric("sampled tokens", "tokens", "count"),
    "flipped_share": _share("sampled tokens route-flipped"),
    "k3_none": Metric("k3 KL, no replay", _K3, scale="log"),
    "k3_r3": Metric("k3 KL, R3", _K3, scale="log"),
    "k3_flipped_none": Metric("k3 KL of route-flipped tokens, no replay", _K3, scale="log"),
    "k3_flipped_r3": Metric("k3 KL of route-flipped tokens, R3", _K3, scale="log"),
    "k3_agreeing_none": Metric("k3 KL of agreeing tokens, no replay", _K3, scale="log"),
    "k3_agreeing_r3": Metric("k3 KL of agreeing tokens, R3", _K3, scale="log"),
    "f2_none": _share("F(2), no replay"),
    "f2_r3": _share("F(2), R3"),
    "abs_diff_none": Metric("mean |Δ log p|, no replay", "nats"),
    "abs_diff_r3": Metric("mean |Δ log p|, R3", "nats"),
    "k3_trainer_floor": Metric("noise floor: trainer vs trainer k3 KL", _K3, scale="log"),
    "k3_engine_floor": Metric("noise floor: engine vs engine k3 KL", _K3, scale="log"),
    "cut_overall": Metric("R3's cut of k3 (none / R3)", "x"),
    "cut_flipped": Metric("R3's cut of k3 on route-flipped tokens", "x"),
    "agreeing_r3_over_none": Metric("k3 of agreeing tokens, R3 / none", "x"),
}
_PREFIXES = {"mean/": "{} (run mean)", "last_quarter/": "{} (last-quarter mean)"}


def metric(key: str) -> Metric:
    """The :class:`Metric` of a record key (a summary's ``mean/``/``last_quarter/`` key takes its metric's
    unit); a key outside the table gets its own name as label, no unit, plain numbers."""
    if key in METRICS:
        return METRICS[key]
    for prefix, words in _PREFIXES.items():
        if key.startswith(prefix):
            m = metric(key[len(prefix):])
            return Metric(words.format(m.label), m.unit, m.kind, m.scale)
    return Metric(key)


def is_known(key: str) -> bool:
    """Whether ``key`` (or the key under its summary prefix) is in :data:`METRICS`."""
    for prefix in _PREFIXES:
        key = key.removeprefix(prefix)
    return key in METRICS


def label(key: str) -> str:
    """The human label of a record key (the key itself when it is not in the table)."""
    return metric(key).label


def unit(key: str) -> str:
    """The unit of a record key's values ("" when dimensionless; "%" for shares stored as fractions)."""
    return metric(key).unit


def kind(key: str) -> Kind:
    """How a record key's values format: "percent", "number", "count" or "seconds"."""
    return metric(key).kind


def scale(key: str) -> Literal["linear", "log"]:
    """The axis type a record key is drawn on by default."""
    return metric(key).scale


def axis_title(key: str) -> str:
    """``label (unit)``, or the label alone for a dimensionless metric."""
    m = metric(key)
    return f"{m.label} ({m.unit})" if m.unit else m.label


def format_value(key: str, value: float | None, digits: int = 3) -> str:
    """One value of ``key`` for a table: shares in percent, counts whole, others to ``digits`` significant
    digits (scientific below 1e-3 or from 1e5); ``None``/NaN as "n/a"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    k = kind(key)
    if k == "count":
        return f"{int(round(value)):d}"
    if k == "percent":
        return _number(100 * value, digits) + "%"
    text = _number(value, digits)
    return text + " s" if k == "seconds" else text


def _number(v: float, digits: int) -> str:
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    if abs(v) < 1e-3 or abs(v) >= 1e5:
        m, e = f"{v:.{digits - 1}e}".split("e")
        return f"{m.rstrip('0').rstrip('.')}e{int(e)}"
    return f"{v:.{digits}g}" if abs(v) >= 10 ** (digits - 1) else f"{float(f'{v:.{digits}g}'):g}"
