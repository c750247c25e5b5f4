"""Drift metrics: pure functions on arrays (no engine, no trainer, no torch).

``delta = logp_train - logp_infer`` on sampled tokens; ``rho = exp(delta)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from r3lab.errors import MetricError
from r3lab.vocabulary import COLLAPSE_RULE, LATE_COLLAPSE_RULE, collapse_prose

__all__ = [
    "k3_kl",
    "extreme_token_fraction",
    "mismatch_metrics",
    "set_differs",
    "set_overlap",
    "routing_weight_l1",
    "token_route_flips",
    "route_agreement",
    "route_change_rate",
    "expert_load",
    "max_violation",
    "extreme_fraction_curve",
    "load_shift",
    "ENGINE_ROWS",
    "TRAINER_ROWS",
    "ROW_CONVENTIONS",
    "response_rows",
    "k3_by_flip",
    "per_layer_flip_drift",
]


def _deltas(logp_train: np.ndarray, logp_infer: np.ndarray) -> np.ndarray:
    a = np.asarray(logp_train, dtype=np.float64)
    b = np.asarray(logp_infer, dtype=np.float64)
    if a.shape != b.shape:
        raise MetricError(f"logprob arrays differ in shape: {a.shape} vs {b.shape}")
    if a.size == 0:
        raise MetricError("no tokens to compare")
    return a - b


def k3_kl(logp_train: np.ndarray, logp_infer: np.ndarray) -> float:
    """The k3 estimator of KL(infer || train) on sampled tokens: ``mean(rho - 1 - delta)`` (>= 0)."""
    d = _deltas(logp_train, logp_infer)
    return float(np.mean(np.expm1(d) - d))


def extreme_token_fraction(logp_train: np.ndarray, logp_infer: np.ndarray, tau: float = 2.0) -> float:
    """F(tau): share of tokens whose probability ratio is beyond ``tau`` either way (``max(rho, 1/rho) > tau``)."""
    d = _deltas(logp_train, logp_infer)
    return float(np.mean(np.abs(d) > np.log(tau)))


def _segments(n: int, cu_seqlens: np.ndarray | None) -> np.ndarray:
    cu = np.asarray([0, n] if cu_seqlens is None else cu_seqlens, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != n or (np.diff(cu) <= 0).any():
        raise MetricError(f"cu_seqlens must rise strictly from 0 to the token count {n}, got {cu.tolist()[:8]}")
    return cu


def mismatch_metrics(
    logp_train: np.ndarray,
    logp_infer: np.ndarray,
    *,
    cu_seqlens: np.ndarray | None = None,
    tis_cap: float = 2.0,
) -> dict[str, float]:
    """Train-inference mismatch on sampled tokens, under the names the field's dashboards use.

    ``rho = exp(logp_train - logp_infer)`` is the importance ratio of the trainer to the rollout policy.
    Per token: ``k3_kl``, ``extreme_frac_tau1.5`` / ``extreme_frac_tau2`` (F(tau)), ``logprob_abs_diff_mean``
    / ``_max``, ``chi2_token`` (``E[rho^2] - 1``), ``probs_pearson_corr`` (of the two probabilities),
    ``is_ratio_mean`` / ``_max``, ``is_eff_sample_size`` (``(sum rho)^2 / (n sum rho^2)``, 1 when equal)
    and ``tis_clipfrac`` (share of tokens with ``rho > tis_cap``). Per sequence (``cu_seqlens``; default:
    one sequence), averaged: ``log_ppl_diff`` (``log_ppl_train - log_ppl_infer``, log-ppl = mean token
    negative log-prob) and ``ppl_ratio`` (``exp`` of it).
    """
    d = _deltas(logp_train, logp_infer)
    if d.ndim != 1:
        raise MetricError(f"log-probs must be 1-D over tokens, got shape {d.shape}")
    if not np.isfinite(d).all():
        raise MetricError(f"{int((~np.isfinite(d)).sum())} non-finite log-prob differences")
    if tis_cap <= 1:
        raise MetricError(f"tis_cap must be > 1, got {tis_cap}")
    cu = _segments(d.size, cu_seqlens)
    rho = np.exp(d)
    pt, pi = np.exp(np.asarray(logp_train, dtype=np.float64)), np.exp(np.asarray(logp_infer, dtype=np.float64))
    corr = float(np.corrcoef(pt, pi)[0, 1]) if d.size > 1 and pt.std() > 0 and pi.std() > 0 else float("nan")
    seq_diff = -np.add.reduceat(d, cu[:-1]) / np.diff(cu)  # log_ppl_train - log_ppl_infer per sequence
    return {
        "k3_kl": float(np.mean(np.expm1(d) - d)),
        "extreme_frac_tau1.5": float(np.mean(np.abs(d) > np.log(1.5))),
        "extreme_frac_tau2": float(np.mean(np.abs(d) > np.log(2.0))),
        "logprob_abs_diff_mean": float(np.mean(np.abs(d))),
        "logprob_abs_diff_max": float(np.max(np.abs(d))),
        "log_ppl_diff": float(seq_diff.mean()),
        "ppl_ratio": float(np.exp(seq_diff).mean()),
        "chi2_token": float(np.mean(rho**2) - 1.0),
        "probs_pearson_corr": corr,
        "is_ratio_mean": float(rho.mean()),
        "is_ratio_max": float(rho.max()),
        "is_eff_sample_size": float(rho.sum() ** 2 / (rho.size * np.sum(rho**2))),
        "tis_clipfrac": float(np.mean(rho > tis_cap)),
        "tokens": int(d.size),
    }


def _route_pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim != 3:
        raise MetricError(f"route arrays must both be [T, L, K] of one shape, got {a.shape} and {b.shape}")
    return a, b


def set_differs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per (token, layer): whether two ``[T, L, K]`` route arrays chose different expert *sets* (order ignored)."""
    a, b = _route_pair(a, b)
    return (np.sort(a, axis=2) != np.sort(b, axis=2)).any(axis=2)


def routing_weight_l1(ids_a: np.ndarray, w_a: np.ndarray, ids_b: np.ndarray, w_b: np.ndarray,
                      num_experts: int) -> np.ndarray:
    """Per (token, layer): the L1 distance between two routings as weight vectors over all ``num_experts`` experts.

    Each routing is ``[T, L, K]`` expert ids and their top-k weights; an expert not chosen has weight 0. So the
    distance is 0 exactly when both chose the same set with the same weights, and a changed choice counts with the
    weight it moved (at most ``sum(w_a) + sum(w_b)``, 2 for renormalised weights)."""
    a, b = _route_pair(ids_a, ids_b)
    wa, wb = np.asarray(w_a, dtype=np.float64), np.asarray(w_b, dtype=np.float64)
    if wa.shape != a.shape or wb.shape != b.shape:
        raise MetricError(f"routing weights {wa.shape} / {wb.shape} do not match their ids {a.shape} / {b.shape}")
    if a.size and (max(int(a.max()), int(b.max())) >= num_experts or min(int(a.min()), int(b.min())) < 0):
        raise MetricError(f"expert ids outside [0, {num_experts})")
    dense = np.zeros(a.shape[:2] + (num_experts,), dtype=np.float64)
    np.put_along_axis(dense, a.astype(np.int64), wa, axis=2)
    other = np.zeros_like(dense)
    np.put_along_axis(other, b.astype(np.int64), wb, axis=2)
    out: np.ndarray = np.abs(dense - other).sum(axis=2)
    return out


def set_overlap(a: np.ndarray, b: np.ndarray, num_experts: int) -> np.ndarray:
    """Per (token, layer): how many expert ids two ``[T, L, K]`` route arrays share (0..K, order ignored)."""
    a, b = _route_pair(a, b)
    if a.size and (max(int(a.max()), int(b.max())) >= num_experts or min(int(a.min()), int(b.min())) < 0):
        raise MetricError(f"expert ids outside [0, {num_experts})")
    ha = np.zeros(a.shape[:2] + (num_experts,), dtype=bool)
    hb = np.zeros_like(ha)
    np.put_along_axis(ha, a.astype(np.int64), True, axis=2)
    np.put_along_axis(hb, b.astype(np.int64), True, axis=2)
    return (ha & hb).sum(axis=2)


def token_route_flips(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per token: whether any layer's expert set differs between two ``[T, L, K]`` route arrays."""
    return set_differs(a, b).any(axis=1)


def route_agreement(a: np.ndarray, b: np.ndarray, num_experts: int, layer_ids=None) -> dict:
    """Set-based agreement of two ``[T, L, K]`` route arrays over the same tokens (order inside top-k ignored).

    Returns ``per_layer_agreement`` (layer id -> share of tokens with the same expert set),
    ``per_layer_overlap`` (mean shared ids / k), ``router_disagreement`` (share of (token, layer) rows
    that differ), ``token_disagreement`` (share of tokens where any layer differs), ``chance`` = k / E
    (the overlap of unrelated routes) and ``tokens``. ``layer_ids`` names the layer axis (default 0..L-1).
    """
    differs = set_differs(a, b)
    shared = set_overlap(a, b, num_experts)
    T, L, K = np.asarray(a).shape
    lids = list(range(L)) if layer_ids is None else [int(g) for g in layer_ids]
    if len(lids) != L:
        raise MetricError(f"{len(lids)} layer ids for {L} layers")
    if T == 0:
        raise MetricError("no tokens to compare")
    return {
        "per_layer_agreement": {g: float(1.0 - differs[:, j].mean()) for j, g in enumerate(lids)},
        "per_layer_overlap": {g: float(shared[:, j].mean() / K) for j, g in enumerate(lids)},
        "router_disagreement": float(differs.mean()),
        "token_disagreement": float(differs.any(axis=1).mean()),
        "chance": K / num_experts,
        "tokens": int(T),
    }


def route_change_rate(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Per layer: share of tokens whose expert set changed between two ``[T, L, K]`` route arrays.

    Between the old policy and the updated policy this is what R2 freezes; between engine and trainer it
    is the router disagreement rate.
    """
    return set_differs(before, after).mean(axis=0)


def expert_load(values: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, E]``: the share of each layer's routed (token, slot) assignments that went to each expert."""
    v = np.asarray(values)
    if v.ndim != 3:
        raise MetricError(f"routes must be [T, L, K], got shape {v.shape}")
    if v.shape[0] == 0:
        raise MetricError("no tokens to count")
    if v.min() < 0 or v.max() >= num_experts:
        raise MetricError(f"expert ids outside [0, {num_experts})")
    T, L, K = v.shape
    flat = v.transpose(1, 0, 2).reshape(L, T * K).astype(np.int64) + np.arange(L)[:, None] * num_experts
    counts = np.bincount(flat.ravel(), minlength=L * num_experts).reshape(L, num_experts)
    return counts / float(T * K)


def max_violation(load: np.ndarray) -> np.ndarray:
    """Per layer, verl's ``max_vio``: ``(max load - mean load) / mean load`` (0 when perfectly balanced)."""
    ld = np.asarray(load, dtype=np.float64)
    if ld.ndim != 2 or ld.shape[1] == 0:
        raise MetricError(f"load must be [L, E], got shape {ld.shape}")
    mean = ld.mean(axis=1)
    if (mean <= 0).any():
        raise MetricError("a layer has no load")
    return (ld.max(axis=1) - mean) / mean


def extreme_fraction_curve(logp_train: np.ndarray, logp_infer: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """F(tau) for every ``tau`` of ``taus`` (each > 1): :func:`extreme_token_fraction` as a curve, in one sort."""
    d = np.sort(np.abs(_deltas(logp_train, logp_infer)).ravel())
    t = np.asarray(taus, dtype=np.float64)
    if t.ndim != 1 or t.size == 0 or (t <= 1).any():
        raise MetricError(f"taus must be a non-empty 1-D array of values > 1, got {t.tolist()[:8]}")
    return 1.0 - np.searchsorted(d, np.log(t), side="right") / d.size


def load_shift(load: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per layer, the total-variation distance ``0.5 * sum |load - reference|`` of two ``[L, E]`` loads (0..1)."""
    a, b = np.asarray(load, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise MetricError(f"loads must both be [L, E] of one shape, got {a.shape} and {b.shape}")
    return 0.5 * np.abs(a - b).sum(axis=1)


# Route rows of a sample of P prompt and R sampled tokens come in two conventions. The engine records a row per
# token it ran a forward on: P + R - 1 (its last sampled token is never fed back). The trainer's forward sees all
# P + R tokens: P + R rows (``r3lab.rollout.append_last_row`` turns the first into the second). Either way, the
# sampled token r (0-based) is scored from the logits at its input position P + r - 1: that row carries its routing.
ENGINE_ROWS = "engine"  # P + R - 1 rows per sample
TRAINER_ROWS = "trainer"  # P + R rows per sample
ROW_CONVENTIONS = (ENGINE_ROWS, TRAINER_ROWS)


def response_rows(cu_seqlens: np.ndarray, response_lengths: np.ndarray, convention: str = ENGINE_ROWS) -> np.ndarray:
    """Route rows of every sampled token's input position (the row whose routing produced the token's logits).

    Sample i's sampled token r (0-based) is predicted from position ``P_i + r - 1``: row ``cu_seqlens[i] + P_i - 1
    + r``, with ``P_i = rows_i - R_i + 1`` (``ENGINE_ROWS``) or ``rows_i - R_i`` (``TRAINER_ROWS``). Returns int64
    ``[sum R_i]``, sample-major.
    """
    if convention not in ROW_CONVENTIONS:
        raise MetricError(f"row convention must be one of {ROW_CONVENTIONS}, got {convention!r}")
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    n = np.asarray(response_lengths, dtype=np.int64)
    if cu.ndim != 1 or n.shape != (cu.size - 1,):
        raise MetricError(f"{n.size} response lengths for {cu.size - 1} route sequences")
    rows = np.diff(cu)
    extra = 1 if convention == ENGINE_ROWS else 0  # engine rows lack the last sampled token's row
    if (n < 1).any() or (n + 1 - extra > rows).any():
        want = "P + R - 1" if extra else "P + R"
        raise MetricError(f"every sample needs 1 <= response tokens and {want} route rows with P >= 1 "
                          f"({convention} rows)")
    starts = cu[:-1] + rows - n - 1 + extra  # row of the first sampled token's input position
    return np.repeat(starts - np.concatenate([[0], np.cumsum(n)[:-1]]), n) + np.arange(n.sum())


def k3_by_flip(logp_train: np.ndarray, logp_infer: np.ndarray, flipped: np.ndarray) -> dict[str, float | None]:
    """k3 KL on route-flipped and on agreeing tokens: ``{"flipped": ..., "agreeing": ...}`` (None: no such token).

    A token is route-flipped when engine and trainer chose a different expert set in some layer at its input
    position (``token_route_flips`` of the rows ``response_rows`` selects).
    """
    a, b = np.asarray(logp_train, dtype=np.float64), np.asarray(logp_infer, dtype=np.float64)
    f = np.asarray(flipped, dtype=bool)
    if f.shape != a.shape or a.shape != b.shape:
        raise MetricError(f"flipped {f.shape} and the log-probs {a.shape}, {b.shape} must have one shape")
    return {name: k3_kl(a[m], b[m]) if m.any() else None for name, m in (("flipped", f), ("agreeing", ~f))}


def per_layer_flip_drift(differs: np.ndarray, logp_train: np.ndarray, logp_infer: np.ndarray) -> dict[str, np.ndarray]:
    """Drift against routing, per layer: ``differs`` ``[N, L]`` says where engine and trainer chose different sets.

    Returns ``disagreement`` (share of tokens flipped at each layer), ``k3_flipped`` / ``k3_agreeing`` (k3 KL of
    the tokens flipped / not flipped at that layer; NaN where there are none) and ``abs_diff_flipped`` (mean
    ``|delta|`` of the flipped ones).
    """
    f = np.asarray(differs, dtype=bool)
    d = _deltas(logp_train, logp_infer)
    if f.ndim != 2 or f.shape[0] != d.size:
        raise MetricError(f"differs must be [tokens, layers] with {d.size} tokens, got shape {f.shape}")
    k3 = np.expm1(d) - d
    out = {"disagreement": f.mean(axis=0)}
    for name, m, vals in (("k3_flipped", f, k3), ("k3_agreeing", ~f, k3), ("abs_diff_flipped", f, np.abs(d))):
        cnt = m.sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[name] = np.where(cnt > 0, (vals[:, None] * m).sum(axis=0) / cnt, np.nan)
    return out


# ---- routing analysis of one batch (r3lab.viz keeps the forms that take Routes) ---------------------------------
def response_differs(engine: np.ndarray, trainer: np.ndarray, cu_seqlens: np.ndarray,
                     response_lengths: np.ndarray) -> np.ndarray:
    """``[sampled tokens, layers]``: whether engine and trainer chose different sets at each sampled token's input
    position (``[T, L, K]`` routes in the engine's row convention, ``response_lengths`` sampled tokens per sample)."""
    rows = response_rows(cu_seqlens, np.asarray(response_lengths))
    return set_differs(np.asarray(engine)[rows], np.asarray(trainer)[rows])


def most_flipped_sample(engine: np.ndarray, trainer: np.ndarray, cu_seqlens: np.ndarray) -> int:
    """The sample with the most (token, layer) cells where engine and trainer chose different expert sets."""
    per_row = set_differs(engine, trainer).sum(axis=1)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    return int(np.argmax(np.add.reduceat(per_row, cu[:-1]))) if per_row.size else 0


__all__ += ["response_differs", "most_flipped_sample"]


# ---- doctor statistics (r3lab.doctor): pure functions on arrays --------------------------------------------------
__all__ += ["constant_layers", "jump_steps", "outlier_layers"]


def constant_layers(values: np.ndarray) -> np.ndarray:
    """Per layer of ``[T, L, K]`` routes: whether every row holds the same expert set (a dead capture: all-zero or
    constant rows); False where there are fewer than two rows."""
    v = np.asarray(values)
    if v.ndim != 3:
        raise MetricError(f"routes must be [T, L, K], got shape {v.shape}")
    if v.shape[0] < 2:
        return np.zeros(v.shape[1], dtype=bool)
    s = np.sort(v, axis=2)
    return (s == s[:1]).all(axis=(0, 2))


def jump_steps(series: np.ndarray, *, window: int = 5, factor: float = 10.0, floor: float = 0.0) -> np.ndarray:
    """Per step of a metric series: whether it exceeds ``factor`` times the median of the ``window`` steps before
    it and ``floor`` (the rise that precedes collapse in the R3 and TIS reports). NaNs never jump; the first
    step has nothing before it."""
    x = np.asarray(series, dtype=np.float64)
    if x.ndim != 1:
        raise MetricError(f"series must be 1-D, got shape {x.shape}")
    if window < 1 or factor <= 1:
        raise MetricError(f"window must be >= 1 and factor > 1, got {window}, {factor}")
    out = np.zeros(x.size, dtype=bool)
    for i in range(1, x.size):
        prev = x[max(0, i - window):i]
        prev = prev[np.isfinite(prev)]
        if prev.size and np.isfinite(x[i]):
            out[i] = x[i] > factor * max(float(np.median(prev)), 1e-300) and x[i] > floor
    return out


def outlier_layers(per_layer: np.ndarray, *, factor: float = 3.0, floor: float = 0.0) -> np.ndarray:
    """Per layer: whether its value exceeds ``factor`` times the median of the other layers and ``floor`` (a layer
    whose engine-vs-trainer disagreement stands out from the rest)."""
    x = np.asarray(per_layer, dtype=np.float64)
    if x.ndim != 1:
        raise MetricError(f"per_layer must be 1-D, got shape {x.shape}")
    out = np.zeros(x.size, dtype=bool)
    if x.size < 3:
        return out
    for j in range(x.size):
        rest = np.delete(x, j)
        out[j] = x[j] > factor * float(np.median(rest)) and x[j] > floor
    return out


# ---- collapse and its precursors (the RL loop's step log and summary): pure functions on series -----------------
__all__ += ["effective_sample_size", "RewardCollapse", "reward_collapse", "first_step", "COLLAPSE_DEFINITION"]

# the rule in words, its threshold from COLLAPSE_RULE (r3lab.vocabulary): what every RL run's summary says it used
COLLAPSE_DEFINITION = ("reward collapse: after a warm-up, "
                       + collapse_prose(subject="the step's mean reward stays", streak=False, warm_up=False)
                       + " for `patience` consecutive steps, the peak being at least `min_peak`; the collapse step is "
                       "the first step of that streak")


def effective_sample_size(log_ratio: np.ndarray) -> float:
    """Normalised effective sample size of importance weights ``exp(log_ratio)``: ``(sum w)^2 / (n sum w^2)``, in
    (0, 1], 1 when all weights are equal (the IS ESS that falls before collapse). Computed stably (max shifted)."""
    x = np.asarray(log_ratio, dtype=np.float64).ravel()
    if x.size == 0:
        raise MetricError("no tokens to weigh")
    if not np.isfinite(x).all():
        raise MetricError(f"{int((~np.isfinite(x)).sum())} non-finite log-ratios")
    w = np.exp(x - x.max())
    return float(w.sum() ** 2 / (x.size * np.sum(w**2)))


@dataclass(frozen=True)
class RewardCollapse:
    """What :func:`reward_collapse` finds: the detector's state per step, and the collapse (None: none)."""

    peak: np.ndarray  # float64 [steps], the running peak from the warm-up on (NaN before)
    streak: np.ndarray  # int64 [steps], consecutive steps below fraction * peak
    collapsed: np.ndarray  # bool [steps], True from the step the collapse was confirmed
    step: int | None  # the first step of the first streak that reached patience
    detected: int | None  # the step it reached patience


def reward_collapse(rewards: np.ndarray, *, warmup: int = COLLAPSE_RULE.warmup, patience: int = COLLAPSE_RULE.patience,
                    fraction: float = COLLAPSE_RULE.fraction, min_peak: float = COLLAPSE_RULE.min_peak
                    ) -> RewardCollapse:
    """The reward-collapse detector of :data:`COLLAPSE_DEFINITION` on a per-step reward series (the defaults:
    :data:`r3lab.vocabulary.COLLAPSE_RULE`).

    Why this definition: a collapse in the R3 and GSPO reports is the outcome (the score falls and stays down),
    while k3, grad-norm and clipping bursts are precursors that runs can recover from; half the running peak for
    ``patience`` steps ignores a single bad batch (the step-to-step noise of a small batch is a few percent), the
    warm-up lets the peak form, and ``min_peak`` keeps a run that never learned from "collapsing" on noise.

    NaN rewards count as below.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise MetricError(f"rewards must be 1-D over steps, got shape {r.shape}")
    if warmup < 0 or patience < 1 or not 0 < fraction < 1:
        raise MetricError(f"warmup must be >= 0, patience >= 1 and fraction in (0, 1), got {warmup}, {patience}, "
                          f"{fraction}")
    peak = np.full(r.size, np.nan)
    streak = np.zeros(r.size, dtype=np.int64)
    collapsed = np.zeros(r.size, dtype=bool)
    best = -np.inf
    step = detected = None
    for t in range(r.size):
        if np.isfinite(r[t]):
            best = max(best, r[t])
        if t < warmup:
            continue
        peak[t] = best
        below = best >= min_peak and not (r[t] >= fraction * best)  # NaN is below
        streak[t] = streak[t - 1] + 1 if below and t > 0 else int(below)
        if detected is None and streak[t] >= patience:
            detected, step = t, t - patience + 1
        collapsed[t] = detected is not None
    return RewardCollapse(peak, streak, collapsed, step, detected)


def first_step(flags: np.ndarray) -> int | None:
    """The index of the first True of a per-step boolean series, or None."""
    f = np.asarray(flags, dtype=bool)
    hits = np.flatnonzero(f)
    return int(hits[0]) if hits.size else None


# ---- the long horizon (bench/bench_horizon.py, r3lab.runs.horizon): trends, spikes and seed statistics ----------
__all__ += ["K3Trend", "k3_trend", "spike_steps", "spike_aftermath", "late_collapse", "LATE_COLLAPSE",
            "bootstrap_mean_diff", "mann_whitney_exact"]

# late_collapse's detector settings (r3lab.vocabulary.LATE_COLLAPSE_RULE: a longer warm-up and streak)
LATE_COLLAPSE = {"warmup": LATE_COLLAPSE_RULE.warmup, "patience": LATE_COLLAPSE_RULE.patience}


@dataclass(frozen=True)
class K3Trend:
    """How a run's k3 moved over training (:func:`k3_trend`)."""

    first: float  # median k3 over the first ``window`` steps
    last: float  # median k3 over the last ``window`` steps
    ratio: float  # last / first (> 1: the mismatch grew)
    slope: float  # least-squares slope of log10(k3) per 100 steps, over every finite positive step


def k3_trend(k3: np.ndarray, *, window: int = 50) -> K3Trend:
    """The trend of a per-step k3 series: medians of its first and last ``window`` steps, their ratio, and the
    slope of log10 k3 per 100 steps (k3 spans decades and spikes, so the medians and the log slope are what a few
    spikes do not move). Non-finite and non-positive steps are left out of the slope; a series shorter than two
    windows is an error (the two medians would share steps)."""
    x = np.asarray(k3, dtype=np.float64)
    if x.ndim != 1:
        raise MetricError(f"k3 must be 1-D over steps, got shape {x.shape}")
    if window < 1 or x.size < 2 * window:
        raise MetricError(f"k3_trend needs at least 2 x window = {2 * window} steps, got {x.size}")
    first, last = float(np.nanmedian(x[:window])), float(np.nanmedian(x[-window:]))
    t = np.arange(x.size, dtype=np.float64)
    ok = np.isfinite(x) & (x > 0)
    if ok.sum() < 2:
        raise MetricError("k3_trend: fewer than two finite positive steps")
    slope = float(np.polyfit(t[ok], np.log10(x[ok]), 1)[0] * 100)
    return K3Trend(first, last, last / first if first > 0 else float("inf"), slope)


def spike_steps(series: np.ndarray, *, factor: float = 10.0) -> np.ndarray:
    """The steps where ``series`` exceeds ``factor`` times its own median over the whole run (k3 spikes: a step
    whose mismatch is ten times the run's usual). NaNs never spike."""
    x = np.asarray(series, dtype=np.float64)
    if x.ndim != 1:
        raise MetricError(f"series must be 1-D over steps, got shape {x.shape}")
    if factor <= 1:
        raise MetricError(f"factor must be > 1, got {factor}")
    med = float(np.nanmedian(x)) if np.isfinite(x).any() else np.nan
    if not np.isfinite(med):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.isfinite(x) & (x > factor * med))


def spike_aftermath(spikes: np.ndarray, series: dict[str, np.ndarray], *, horizon: int = 10) -> dict[str, float]:
    """What follows spikes: per named series, the mean over spikes of its mean over the ``horizon`` steps after
    each spike (``t + 1 .. t + horizon``, cut at the run's end), minus the series' mean over the whole run (so 0 is
    "no different from usual"; NaN where no spike has a step after it). NaN steps are left out."""
    s = np.asarray(spikes, dtype=np.int64)
    if horizon < 1:
        raise MetricError(f"horizon must be >= 1, got {horizon}")
    out = {}
    for name, values in series.items():
        v = np.asarray(values, dtype=np.float64)
        if v.ndim != 1:
            raise MetricError(f"series {name!r} must be 1-D over steps, got shape {v.shape}")
        if s.size and (s.min() < 0 or s.max() >= v.size):
            raise MetricError(f"spike steps {s.min()}..{s.max()} fall outside series {name!r} of {v.size} steps")
        after = [np.nanmean(v[t + 1:t + 1 + horizon]) for t in s if t + 1 < v.size
                 and np.isfinite(v[t + 1:t + 1 + horizon]).any()]
        out[name] = float(np.mean(after) - np.nanmean(v)) if after else float("nan")
    return out


def late_collapse(rewards: np.ndarray) -> RewardCollapse:
    """The late-collapse variant of :func:`reward_collapse` (:data:`r3lab.vocabulary.LATE_COLLAPSE_RULE`: a longer
    warm-up and streak below the running peak), so the noisy first tens of steps of a long run neither set a peak
    that is noise nor count as a collapse."""
    rule = LATE_COLLAPSE_RULE
    return reward_collapse(rewards, warmup=rule.warmup, patience=rule.patience, fraction=rule.fraction,
                           min_peak=rule.min_peak)


def bootstrap_mean_diff(a: np.ndarray, b: np.ndarray, *, n: int = 10000, level: float = 0.95,
                        seed: int = 0) -> tuple[float, float, float]:
    """``mean(a) - mean(b)`` with a percentile bootstrap interval at ``level`` (each side resampled with
    replacement, ``n`` times, a fixed ``seed``). With 3 values a side the interval is coarse: it is a description
    of the seeds, not a test."""
    x, y = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if x.size < 1 or y.size < 1 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise MetricError(f"bootstrap_mean_diff needs finite values on both sides, got {x.size} and {y.size}")
    if not 0 < level < 1:
        raise MetricError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    d = (x[rng.integers(0, x.size, (n, x.size))].mean(axis=1) - y[rng.integers(0, y.size, (n, y.size))].mean(axis=1))
    lo, hi = np.quantile(d, [(1 - level) / 2, (1 + level) / 2])
    return float(x.mean() - y.mean()), float(lo), float(hi)


def mann_whitney_exact(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """The Mann-Whitney U of ``a`` against ``b`` (pairs with ``a > b``, ties half) and its exact two-sided p-value,
    by enumerating every split of the pooled values (small samples only: at most 20 values). With 3 against 3 the
    smallest two-sided p is 0.1 (2 of the 20 splits are as extreme as a complete separation): no 5% test can
    reject, whatever the runs do."""
    from itertools import combinations

    x, y = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if x.size < 1 or y.size < 1 or x.size + y.size > 20:
        raise MetricError(f"mann_whitney_exact takes 1..20 values in all, got {x.size} and {y.size}")

    def u(p: np.ndarray, q: np.ndarray) -> float:
        return float((p[:, None] > q[None, :]).sum() + 0.5 * (p[:, None] == q[None, :]).sum())

    pooled = np.concatenate([x, y])
    u_obs = u(x, y)
    centre = x.size * y.size / 2
    dev = abs(u_obs - centre)
    count = total = 0
    for idx in combinations(range(pooled.size), x.size):
        mask = np.zeros(pooled.size, dtype=bool)
        mask[list(idx)] = True
        total += 1
        count += abs(u(pooled[mask], pooled[~mask]) - centre) >= dev - 1e-12
    return u_obs, count / total
