"""The long-horizon sweep read again, for what its runs can and cannot carry: k3 at fixed entropy, means and tails
beside the medians, the k3 before each collapse, equivalence tests where a null is claimed, a power table, and how
often R3's per-step seed band lies below none's.

Why: the medians of :mod:`r3lab.runs.horizon` describe the typical step, and a policy that sharpens lowers k3 by
itself (fewer tokens carry probability mass away from the sampled one), so "k3 falls" and "no spike preceded the
collapse" need the per-run regression on entropy and the per-step maxima. Every number is a function of the
committed step records (``bench/results/horizon``); nothing is measured again. The statistics are
:mod:`r3lab.runs.stats` (numpy only).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from r3lab.errors import MetricError, R3LabError
from r3lab.metrics import reward_collapse
from r3lab.runs.horizon import TREND_WINDOW, horizon_record
from r3lab.runs.reader import Run
from r3lab.runs.stats import detectable_difference, least_squares, seeds_needed, tost
from r3lab.vocabulary import RLMetric

__all__ = ["ENTROPY", "PRE_DROP_WINDOW", "TOST_MARGIN", "POWER_SEEDS", "POWER_DIFFERENCES", "fixed_entropy_trend",
           "tail_record", "precollapse_rank", "rank_permutation_p", "rank_placement_p", "collapse_precursors",
           "seed_sd", "power_rows", "equivalence_rows", "step_separation", "reanalysis_records", "reanalysis_text"]

ENTROPY = RLMetric.ENTROPY  # the trainer's mean token entropy of the step (nats)
PRE_DROP_WINDOW = 10  # the steps before a collapse whose largest k3 is ranked within its run
TOST_MARGIN = 0.05  # reward: a difference inside +-0.05 (about the seed SD) counts as no difference
POWER_SEEDS = (3, 6, 10, 14, 17, 20)
POWER_DIFFERENCES = (0.15, 0.10, 0.05, 0.025)


def _series(run: Run, key: str) -> np.ndarray:
    return np.array([np.nan if s.get(key) is None else s[key] for s in run.step_records], dtype=float)


def fixed_entropy_trend(run: Run) -> dict[str, float]:
    """``log10 k3 ~ 1 + entropy + step / 100`` over the run's steps with a positive k3: the step slope at fixed
    entropy (log10 per 100 steps: > 0, the mismatch grows at a fixed sharpness), the entropy coefficient (log10 per
    nat) and, beside them, the plain slope on step alone (:func:`r3lab.metrics.k3_trend`'s)."""
    k3, ent = _series(run, RLMetric.K3_KL), _series(run, ENTROPY)
    ok = np.isfinite(k3) & (k3 > 0) & np.isfinite(ent)
    if ok.sum() < 3:
        raise MetricError(f"run {run.name!r}: {int(ok.sum())} steps with k3 and entropy, at least 3 needed")
    steps = np.arange(k3.size, dtype=float)[ok] / 100.0
    y = np.log10(k3[ok])
    both = least_squares(y, ent[ok], steps)
    plain = least_squares(y, steps)
    return {"step_slope": float(both[2]), "entropy_coef": float(both[1]), "plain_slope": float(plain[1]),
            "entropy_first": float(np.nanmean(ent[:TREND_WINDOW])),
            "entropy_last": float(np.nanmean(ent[-TREND_WINDOW:]))}


def tail_record(run: Run, window: int = TREND_WINDOW) -> dict[str, float]:
    """Means and tails over the first and last ``window`` steps: mean k3 (a spike moves it; the median does not),
    the largest |dlogp| between engine and trainer, and the smallest and mean IS effective sample size; over the
    whole run, the largest pre-clip gradient norm of a mini-batch and the steps where it exceeded the clip."""
    k3, dmax, ess = (_series(run, k) for k in (RLMetric.K3_KL, RLMetric.ABS_DIFF_MAX, RLMetric.IS_ESS))
    grad = _series(run, RLMetric.GRAD_NORM_MAX)
    clip = float(run.config.get("max_grad_norm", 1.0))
    out = {"grad_norm_peak": float(np.nanmax(grad)), "clipped_steps": int((grad > clip).sum())}
    for name, sl in (("first", slice(0, window)), ("last", slice(-window, None))):
        out[f"k3_mean_{name}"] = float(np.nanmean(k3[sl]))
        out[f"k3_max_{name}"] = float(np.nanmax(k3[sl]))
        out[f"dlogp_max_{name}"] = float(np.nanmax(dmax[sl]))
        out[f"ess_min_{name}"] = float(np.nanmin(ess[sl]))
        out[f"ess_mean_{name}"] = float(np.nanmean(ess[sl]))
    return out


def precollapse_rank(k3: np.ndarray, drop: int, window: int = PRE_DROP_WINDOW) -> tuple[int, float, int]:
    """The step and value of the largest k3 in the ``window`` steps before ``drop`` (``drop - window .. drop - 1``)
    and its rank among all the run's steps (1: the run's largest; NaN steps rank last)."""
    x = np.asarray(k3, dtype=np.float64)
    if not window <= drop <= x.size:
        raise MetricError(f"a drop at step {drop} leaves no {window}-step window in a run of {x.size} steps")
    w = np.nan_to_num(x[drop - window:drop], nan=-np.inf)
    at = drop - window + int(np.argmax(w))
    filled = np.nan_to_num(x, nan=-np.inf)
    rank = int((filled > filled[at]).sum()) + 1
    return at, float(x[at]), rank


def _window_ranks(k3: np.ndarray, window: int) -> np.ndarray:
    """The rank of :func:`precollapse_rank` for every possible drop step (``window .. steps``)."""
    return np.array([precollapse_rank(k3, d, window)[2] for d in range(window, k3.size + 1)])


def rank_permutation_p(series: Sequence[np.ndarray], drops: Mapping[int, int], *,
                       window: int = PRE_DROP_WINDOW) -> tuple[float, float, int]:
    """Are the collapses' pre-drop k3 maxima higher in their own runs than chance? ``series``: the k3 of every run
    of one setting; ``drops``: run index -> its drop step. The statistic is the mean rank (:func:`precollapse_rank`)
    of the collapsed runs; the null puts the observed drop steps on runs at random: every assignment of the drop steps
    to distinct runs of the setting, counted exactly. Returns (observed mean rank, one-sided p: the share of
    assignments with a mean rank at most the observed, number of assignments)."""
    if not drops:
        raise MetricError("rank_permutation_p: no collapse to rank")
    steps = list(drops.values())
    obs = float(np.mean([precollapse_rank(series[i], d, window)[2] for i, d in drops.items()]))
    ranks = {}  # (run, drop) -> rank, each computed once
    hits = total = 0
    for runs in itertools.permutations(range(len(series)), len(steps)):
        r = []
        for i, d in zip(runs, steps, strict=True):
            if (i, d) not in ranks:
                ranks[(i, d)] = precollapse_rank(series[i], d, window)[2]
            r.append(ranks[(i, d)])
        total += 1
        hits += float(np.mean(r)) <= obs + 1e-9
    return obs, hits / total, total


def rank_placement_p(series: Sequence[np.ndarray], drops: Mapping[int, int], *, window: int = PRE_DROP_WINDOW,
                     earliest: int = PRE_DROP_WINDOW) -> float:
    """The same statistic with the null that each collapsed run's drop could have come at any step from
    ``earliest`` on, uniformly and independently: the exact p that the summed rank is at most the observed one
    (the per-run rank distributions convolved)."""
    if not drops:
        raise MetricError("rank_placement_p: no collapse to rank")
    dist = np.array([1.0])
    obs = 0
    for i, d in drops.items():
        x = np.asarray(series[i], dtype=np.float64)
        ranks = _window_ranks(x, window)[max(earliest, window) - window:]
        pmf = np.bincount(ranks, minlength=x.size + 1).astype(float) / ranks.size
        dist = np.convolve(dist, pmf)
        obs += precollapse_rank(x, d, window)[2]
    return float(dist[:obs + 1].sum())


def collapse_precursors(run: Run, drop: int, window: int = PRE_DROP_WINDOW) -> dict[str, Any]:
    """What the ``window`` steps before a drop held: the largest k3 (step, value, rank in the run), the largest
    engine-trainer |dlogp|, the largest pre-clip gradient norm, the smallest IS ESS, the entropy."""
    k3 = _series(run, RLMetric.K3_KL)
    at, value, rank = precollapse_rank(k3, drop, window)
    sl = slice(drop - window, drop)
    return {"run": run.name, "drop": drop, "k3_step": at, "k3": value, "k3_rank": rank,
            "dlogp_max": float(np.nanmax(_series(run, RLMetric.ABS_DIFF_MAX)[sl])),
            "grad_norm_max": float(np.nanmax(_series(run, RLMetric.GRAD_NORM_MAX)[sl])),
            "ess_min": float(np.nanmin(_series(run, RLMetric.IS_ESS)[sl])),
            "entropy": float(np.nanmean(_series(run, ENTROPY)[sl])), "run_k3_max": float(np.nanmax(k3)),
            "run_k3_max_step": int(np.nanargmax(k3))}


def reanalysis_records(runs: Iterable[Run]) -> list[dict[str, Any]]:
    """Per run: :func:`r3lab.runs.horizon.horizon_record`, :func:`fixed_entropy_trend`, :func:`tail_record` and
    the collapse step of :func:`r3lab.metrics.reward_collapse` with its :func:`collapse_precursors`."""
    out = []
    for run in runs:
        rec = dict(horizon_record(run))
        rec.update(fixed_entropy_trend(run))
        rec.update(tail_record(run))
        rec["k3_series"] = _series(run, RLMetric.K3_KL)
        rec["reward_series"] = _series(run, RLMetric.REWARD)
        drop = reward_collapse(rec["reward_series"]).step
        rec["precursors"] = collapse_precursors(run, drop) if drop is not None and drop >= PRE_DROP_WINDOW else None
        out.append(rec)
    return out


def _base(records: Sequence[Mapping[str, Any]], quant: str, obj: str) -> list[Mapping[str, Any]]:
    return [r for r in records if r["setting"] == "base" and r["engine_quant"] == quant and r["objective"] == obj]


def seed_sd(records: Sequence[Mapping[str, Any]], key: str = "reward_last50") -> tuple[float, int]:
    """The pooled within-arm seed SD of ``key`` over the sweep's base arms (engine x objective), and its degrees of
    freedom."""
    ss, df = 0.0, 0
    for (quant, obj) in dict.fromkeys((r["engine_quant"], r["objective"]) for r in records if r["setting"] == "base"):
        v = np.array([r[key] for r in _base(records, quant, obj)], dtype=float)
        if v.size > 1:
            ss += float(((v - v.mean()) ** 2).sum())
            df += v.size - 1
    if df == 0:
        raise MetricError("seed_sd: no arm with two seeds")
    return math.sqrt(ss / df), df


def power_rows(sd: float) -> tuple[list[tuple[int, float]], list[tuple[float, int]]]:
    """For the seed SD ``sd``: the difference detectable at 80% power (two-sided 5%) per seed count of
    :data:`POWER_SEEDS`, and the seeds an arm each difference of :data:`POWER_DIFFERENCES` needs."""
    return ([(n, detectable_difference(sd, n)) for n in POWER_SEEDS],
            [(d, seeds_needed(sd, d)) for d in POWER_DIFFERENCES])


def equivalence_rows(records: Sequence[Mapping[str, Any]], margin: float = TOST_MARGIN) -> list[dict[str, Any]]:
    """TOST of each objective's last-50 reward against none, per engine, at ``margin`` (alpha 0.05)."""
    rows = []
    for quant in dict.fromkeys(r["engine_quant"] for r in records if r["setting"] == "base"):
        none = [r["reward_last50"] for r in _base(records, quant, "none")]
        for obj in dict.fromkeys(r["objective"] for r in records if r["setting"] == "base"):
            if obj == "none":
                continue
            other = [r["reward_last50"] for r in _base(records, quant, obj)]
            if len(other) >= 2 and len(none) >= 2:
                rows.append({"engine": quant, "objective": obj, "n": (len(other), len(none)),
                             "tost": tost(other, none, margin)})
    return rows


def step_separation(records: Sequence[Mapping[str, Any]], quant: str, a: str = "R3", b: str = "none"
                    ) -> dict[str, float]:
    """Per step over the sweep's base arms at ``quant``: the share of steps where ``a``'s seed median k3 is below
    ``b``'s, and where ``a``'s seed band (min - max) lies wholly below ``b``'s."""
    xa = [r["k3_series"] for r in _base(records, quant, a)]
    xb = [r["k3_series"] for r in _base(records, quant, b)]
    if not xa or not xb:
        raise MetricError(f"step_separation: no {a} or {b} runs at {quant}")
    n = min(x.size for x in xa + xb)
    ma, mb = np.stack([x[:n] for x in xa]), np.stack([x[:n] for x in xb])
    return {"median_below": float(np.mean(np.median(ma, axis=0) < np.median(mb, axis=0))),
            "band_below": float(np.mean(ma.max(axis=0) < mb.min(axis=0))), "steps": n}


def _mmm(vals: Sequence[float], fmt: str) -> str:
    v = [x for x in vals if x is not None and np.isfinite(x)]
    if not v:
        return "-"
    mid = f"{float(np.median(v)):{fmt}}"
    return f"{mid} ({min(v):{fmt}} - {max(v):{fmt}})" if len(v) > 1 else mid


def _groups(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str], list[Mapping[str, Any]]]:
    out: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for r in records:
        out.setdefault((r["engine_quant"], r["setting"], r["objective"]), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1] != "base", kv[0])))


def reanalysis_text(records: Sequence[Mapping[str, Any]]) -> str:
    """The re-analysis sections of horizon.md (markdown), every number computed here from ``records``
    (:func:`reanalysis_records`)."""
    if not records:
        raise MetricError("no records to re-analyse")
    lines = ["## k3 at fixed entropy", "",
             "Per run, least squares of log10 k3 on the step's policy entropy (`train/entropy`, nats) and the step "
             "(r3lab.runs.reanalysis.fixed_entropy_trend): the step slope at fixed entropy (log10 per 100 steps; "
             "> 0: the mismatch grows at a fixed sharpness), beside the plain slope on step alone and the entropy over "
             f"the first / last {TREND_WINDOW} steps. Cells: median (min - max) over seeds; positive: seeds with a "
             "positive step slope at fixed entropy.", "",
             "| engine | setting | objective | seeds | entropy first -> last | plain slope | step slope at fixed "
             "entropy | positive | entropy coefficient (log10 / nat) |", "|" + "---|" * 9]
    for (quant, setting, obj), sel in _groups(records).items():
        def col(key: str, fmt: str, sel: Sequence[Mapping[str, Any]] = sel) -> str:
            return _mmm([r[key] for r in sel], fmt)
        lines.append(f"| {quant} | {setting} | {obj} | {len(sel)} | {col('entropy_first', '.2f')} -> "
                     f"{col('entropy_last', '.2f')} | {col('plain_slope', '+.2f')} | {col('step_slope', '+.2f')} | "
                     f"{sum(r['step_slope'] > 0 for r in sel)} / {len(sel)} | {col('entropy_coef', '+.2f')} |")
    lines += ["", "## Means and tails beside the medians", "",
              f"Over the first / last {TREND_WINDOW} steps of each run: the mean k3 (a spike moves it, the median "
              "does not), the largest k3, the largest engine-trainer |dlogp| (`mismatch/logprob_abs_diff_max`) and the "
              "smallest IS effective sample size of pi_old / pi_engine. Cells: median (min - max) over seeds.", "",
              "| engine | setting | objective | seeds | k3 median first -> last | k3 mean first -> last | k3 max last "
              "| max \\|dlogp\\| first -> last | IS ESS min first -> last |", "|" + "---|" * 9]
    for (quant, setting, obj), sel in _groups(records).items():
        def fl(key: str, fmt: str, sel: Sequence[Mapping[str, Any]] = sel) -> str:
            return (f"{_mmm([r[f'{key}_first'] for r in sel], fmt)} -> {_mmm([r[f'{key}_last'] for r in sel], fmt)}")
        lines.append(f"| {quant} | {setting} | {obj} | {len(sel)} | "
                     f"{_mmm([r['k3_first'] for r in sel], '.2e')} -> {_mmm([r['k3_last'] for r in sel], '.2e')} | "
                     f"{fl('k3_mean', '.2e')} | {_mmm([r['k3_max_last'] for r in sel], '.2e')} | "
                     f"{fl('dlogp_max', '.2f')} | {fl('ess_min', '.3f')} |")
    lines += _collapse_section(records)
    lines += _separation_section(records)
    lines += _equivalence_section(records)
    return "\n".join(lines) + "\n"


def _collapse_section(records: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["", "## The k3 before each collapse", "",
             f"Every run the collapse detector flags (r3lab.metrics.reward_collapse; the drop is the first step of "
             f"the streak): the largest k3 in the {PRE_DROP_WINDOW} steps before the drop, its step, and its rank "
             "among all the run's steps (1: the run's largest k3); the largest |dlogp|, the largest pre-clip gradient "
             "norm (`train/grad_norm_max`) and the smallest IS ESS in the same steps, and the mean entropy there.", "",
             "| run | setting | objective | drop | largest k3 before (step) | rank in run | run's largest k3 (step) "
             "| max \\|dlogp\\| | grad norm max | IS ESS min | entropy |", "|" + "---|" * 11]
    for r in records:
        p = r["precursors"]
        if p is None:
            continue
        lines.append(f"| {r['run']} | {r['setting']} | {r['objective']} | {p['drop']} | {p['k3']:.3g} ({p['k3_step']})"
                     f" | {p['k3_rank']} of {r['steps']} | {p['run_k3_max']:.3g} ({p['run_k3_max_step']}) | "
                     f"{p['dlogp_max']:.2f} | {p['grad_norm_max']:.1f} | {p['ess_min']:.3f} | {p['entropy']:.3f} |")
    tests = []
    for setting in dict.fromkeys(r["setting"] for r in records if r["precursors"] is not None):
        sel = [r for r in records if r["setting"] == setting]
        drops = {i: r["precursors"]["drop"] for i, r in enumerate(sel) if r["precursors"] is not None}
        series = [r["k3_series"] for r in sel]
        obs, p_runs, total = rank_permutation_p(series, drops)
        p_place = rank_placement_p(series, drops)
        tests.append(f"| {setting} | {len(drops)} of {len(sel)} | {obs:.1f} | {p_runs:.3f} ({total} assignments) | "
                     f"{p_place:.2g} |")
    if tests:
        lines += ["", "Is the pre-drop k3 high for its run by chance? The statistic is the mean rank over a setting's "
                  "collapses. Over runs: every assignment of the observed drop steps to distinct runs of the setting "
                  "(r3lab.runs.reanalysis.rank_permutation_p; a drop step on another run ranks that run's k3 before "
                  "it). Over placements: each drop anywhere from step "
                  f"{PRE_DROP_WINDOW} on, uniformly (rank_placement_p). One-sided p: the share at most the observed "
                  "mean rank.", "",
                  "| setting | collapses | mean rank | p over runs | p over placements |", "|---|---|---|---|---|"]
        lines += tests
    return lines


def _separation_section(records: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["", "## Does R3 lower k3 at every step?", "",
             "Per step over the sweep's 3 seeds: the share of steps where R3's seed median k3 is below none's, and "
             "where R3's whole seed band (max) lies below none's (min).", "",
             "| engine | steps | R3 median below none | R3 band below none's |", "|---|---|---|---|"]
    for quant in dict.fromkeys(r["engine_quant"] for r in records if r["setting"] == "base"):
        try:
            s = step_separation(records, quant)
        except R3LabError:
            continue
        lines.append(f"| {quant} | {s['steps']} | {100 * s['median_below']:.1f}% | {100 * s['band_below']:.1f}% |")
    return lines


def _equivalence_section(records: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = equivalence_rows(records)
    sd, df = seed_sd(records)
    arms = len({(r["engine_quant"], r["objective"]) for r in records if r["setting"] == "base"})
    detect, needed = power_rows(sd)
    lines = ["", "## Equivalence and power", "",
             f"Where the table above shows no reward difference, is there evidence of none? Two one-sided Welch t "
             f"tests (TOST, r3lab.runs.stats.tost) of each objective's last-50 reward against none with the margin "
             f"+-{TOST_MARGIN} (about one seed SD): equivalence is shown when p < 0.05, i.e. when the 90% interval "
             "lies inside the margin.", "",
             "| engine | comparison | seeds | difference | 90% interval | TOST p | equivalent at +-"
             f"{TOST_MARGIN} |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        t = row["tost"]
        lines.append(f"| {row['engine']} | {row['objective']} - none | {row['n'][0]} vs {row['n'][1]} | "
                     f"{t.diff:+.3f} | [{t.lo:+.3f}, {t.hi:+.3f}] | {t.p:.2f} | {'yes' if t.equivalent else 'no'} |")
    lines += ["", f"The seed SD of the last-50 reward, pooled within the {arms} base arms: {sd:.4f} "
              f"({df} degrees of freedom). The difference a two-sided 5% two-sample t test detects with 80% power "
              "(r3lab.runs.stats.detectable_difference: (t_0.975 + t_0.8 at 2n - 2 df) x SD x sqrt(2 / n)), and the "
              "seeds an arm a difference needs:", "",
              "| seeds an arm | " + " | ".join(str(n) for n, _ in detect) + " |", "|---|" + "---|" * len(detect),
              "| detectable at 80% | " + " | ".join(f"{d:.3f}" for _, d in detect) + " |", "",
              "| difference | " + " | ".join(f"{d:g}" for d, _ in needed) + " |", "|---|" + "---|" * len(needed),
              "| seeds an arm | " + " | ".join(str(n) for _, n in needed) + " |"]
    return lines

