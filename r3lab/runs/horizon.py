"""The long-horizon sweep's runs read back (bench/bench_horizon.py): per run, the trend of k3 over training, its
spikes and what followed them, and the collapse detectors; per mode, those over seeds, with the seed statistics;
and the per-step bands (median, min, max over seeds) the figures draw.

A run's place comes from its config (engine_quant, the objective its mode and TIS cap make, and the setting of
the collapse search that differs from the sweep's base config), never from its folder name. The numbers are
:mod:`r3lab.metrics` functions on the runs' step records; nothing here is measured again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import MetricError
from r3lab.metrics import (
    bootstrap_mean_diff,
    k3_trend,
    late_collapse,
    mann_whitney_exact,
    reward_collapse,
    spike_aftermath,
    spike_steps,
)
from r3lab.paths import results_dir
from r3lab.runs.phase import phase_objective
from r3lab.runs.reader import Run
from r3lab.vocabulary import LATE_COLLAPSE_RULE, RLMetric, RunKind, TaskName, collapse_prose

__all__ = ["HORIZON_BASE", "TREND_WINDOW", "SPIKE_FACTOR", "AFTERMATH_STEPS", "AFTERMATH_SERIES", "horizon_setting",
           "horizon_record", "horizon_records", "horizon_bands", "horizon_table", "horizon_runs_dir",
           "mode_comparison", "curve_at"]

# the sweep's base config (bench/bench_horizon.py's base_config): a run differing in these is a search setting
HORIZON_BASE = {"task": TaskName.CHAIN, "lr": 3e-4, "mini_batches": 2, "max_tokens": 32, "staleness": 0,
                "old_logprobs": "current"}
TREND_WINDOW = 50  # k3 medians over the first and last 50 steps
SPIKE_FACTOR = 10.0  # a k3 spike: a step above 10x the run's median k3
AFTERMATH_STEPS = 10  # what follows a spike: the means over the next 10 steps
AFTERMATH_SERIES = {"grad_norm": RLMetric.GRAD_NORM, "is_ess": RLMetric.IS_ESS, "clip_frac": RLMetric.CLIP_FRAC,
                    "reward": RLMetric.REWARD}  # name -> step key
CURVE_STEPS = (0, 50, 100, 200, 300)  # the reward curve the table quotes (means of the 10 steps from each)


def horizon_runs_dir() -> Path:
    """The committed runs (``bench/results/horizon``); missing: an error naming the command that makes them."""
    p = results_dir() / "horizon"
    if not p.is_dir():
        raise MetricError(f"no long-horizon runs at {p}: `python bench/bench_horizon.py --work DIR` makes them")
    return p


def horizon_setting(config: Mapping[str, Any]) -> str:
    """``base`` for the sweep's config, else the fields that differ from it (``lr=0.01``, ``staleness=2``...)."""
    diff = [f"{k}={config.get(k)}" for k, v in HORIZON_BASE.items() if config.get(k, v) != v]
    return ", ".join(diff) if diff else "base"


def _series(run: Run, key: str) -> np.ndarray:
    return np.array([np.nan if s.get(key) is None else s[key] for s in run.step_records], dtype=float)


def curve_at(reward: np.ndarray, step: int, width: int = 10) -> float | None:
    """The mean reward of the ``width`` steps from ``step`` (the last ``width`` for a step at or past the end)."""
    r = np.asarray(reward, dtype=float)
    if r.size == 0:
        return None
    lo = min(step, max(r.size - width, 0))
    return float(np.nanmean(r[lo:lo + width]))


def horizon_record(run: Run) -> dict[str, Any]:
    """One finished RL run's long-horizon numbers (``None`` where it is too short or did not log them)."""
    run.require_kind(RunKind.RL)
    if not run.finished:
        raise MetricError(f"run {run.name!r} is {run.state}: the horizon table reads finished runs only")
    cfg = run.config
    reward, k3 = _series(run, RLMetric.REWARD), _series(run, RLMetric.K3_KL)
    rec: dict[str, Any] = {"run": run.name, "model": cfg["model"], "engine_quant": cfg.get("engine_quant", "none"),
                           "objective": phase_objective(cfg), "setting": horizon_setting(cfg),
                           "seed": int(cfg["seed"]), "steps": int(reward.size), "task": cfg.get("task")}
    rec["curve"] = [curve_at(reward, s) for s in CURVE_STEPS]
    rec["reward_last50"] = float(np.nanmean(reward[-TREND_WINDOW:])) if reward.size else None
    if k3.size >= 2 * TREND_WINDOW:
        t = k3_trend(k3, window=TREND_WINDOW)
        rec.update(k3_first=t.first, k3_last=t.last, k3_ratio=t.ratio, k3_slope=t.slope)
    else:
        rec.update(k3_first=None, k3_last=None, k3_ratio=None, k3_slope=None)
    spikes = spike_steps(k3, factor=SPIKE_FACTOR)
    rec["spikes"] = int(spikes.size)
    rec["spike_steps"] = [int(s) for s in spikes]
    after = spike_aftermath(spikes, {n: _series(run, k) for n, k in AFTERMATH_SERIES.items()},
                            horizon=AFTERMATH_STEPS)
    rec.update({f"after_{n}": (v if np.isfinite(v) else None) for n, v in after.items()})
    rec["collapse_step"] = reward_collapse(reward).step
    rec["late_collapse_step"] = late_collapse(reward).step if reward.size > LATE_COLLAPSE_RULE.warmup else None
    rec["s_per_step"] = float(np.nanmedian(_series(run, RLMetric.TIME_STEP)))
    return rec


def horizon_records(runs: Iterable[Run]) -> list[dict[str, Any]]:
    """:func:`horizon_record` of every run."""
    return [horizon_record(r) for r in runs]


def horizon_bands(runs: Iterable[Run], key: str = RLMetric.K3_KL, *, smooth: int = 1) -> dict[str, dict[str, Any]]:
    """Per-step seed bands of ``key``, per group ``"<engine_quant> <objective>"`` (search settings append theirs):
    ``{"steps", "median", "lo", "hi", "seeds"}``, over the steps every seed of the group has; ``smooth`` > 1 takes
    a trailing moving mean of each seed first (rewards of 32 samples are noisy step to step)."""
    if smooth < 1:
        raise MetricError(f"smooth must be >= 1, got {smooth}")
    groups: dict[str, list[np.ndarray]] = {}
    for run in runs:
        cfg = run.config
        name = f"{cfg.get('engine_quant', 'none')} {phase_objective(cfg)}"
        setting = horizon_setting(cfg)
        if setting != "base":
            name += f" ({setting})"
        x = _series(run, key)
        if smooth > 1 and x.size:
            c = np.cumsum(np.insert(np.nan_to_num(x), 0, 0.0))
            n = np.minimum(np.arange(1, x.size + 1), smooth)
            x = (c[1:] - c[np.arange(x.size) + 1 - n]) / n
        groups.setdefault(name, []).append(x)
    out = {}
    for name, xs in groups.items():
        n = min(x.size for x in xs)
        m = np.stack([x[:n] for x in xs])
        out[name] = {"steps": np.arange(n), "median": np.nanmedian(m, axis=0), "lo": np.nanmin(m, axis=0),
                     "hi": np.nanmax(m, axis=0), "seeds": len(xs)}
    return out


def _cell(vals: Sequence[float | None], fmt: str) -> str:
    v = [x for x in vals if x is not None and np.isfinite(x)]
    if not v:
        return "-"
    med = float(np.median(v))
    if fmt == "d":  # integer counts: the median of an even count of seeds may fall between two
        return (f"{med:g} ({min(v):d} - {max(v):d})" if len(set(v)) > 1 else f"{v[0]:d}")
    mid = f"{med:{fmt}}"
    return f"{mid} ({min(v):{fmt}} - {max(v):{fmt}})" if len(v) > 1 else mid


def _group(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str], list[Mapping[str, Any]]]:
    out: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for r in records:
        out.setdefault((r["engine_quant"], r["setting"], r["objective"]), []).append(r)
    return out


def mode_comparison(records: Sequence[Mapping[str, Any]], key: str, a: str, b: str, *, engine_quant: str,
                    setting: str = "base") -> dict[str, Any] | None:
    """``key`` of objective ``a`` against ``b`` over seeds: the mean difference with its bootstrap 95% interval
    and the exact Mann-Whitney two-sided p (None when a side has no value)."""
    def vals(obj: str) -> list[float]:
        return [r[key] for r in records if r["objective"] == obj and r["engine_quant"] == engine_quant
                and r["setting"] == setting and r[key] is not None]
    x, y = vals(a), vals(b)
    if not x or not y:
        return None
    diff, lo, hi = bootstrap_mean_diff(np.array(x), np.array(y))
    u, p = mann_whitney_exact(np.array(x), np.array(y))
    return {"a": a, "b": b, "key": key, "n_a": len(x), "n_b": len(y), "diff": diff, "lo": lo, "hi": hi, "u": u,
            "p": p}


def horizon_table(runs: Iterable[Run], *, header: str = "") -> str:
    """The long-horizon table as markdown: the sweep per (engine, objective), cells median (min - max) over seeds;
    the seed statistics of each objective against none; the collapse search, one row per setting and mode."""
    records = horizon_records(runs)
    if not records:
        raise MetricError("no finished RL runs to tabulate")
    curve = " / ".join(str(s) for s in CURVE_STEPS)
    lines = ["# The long horizon: k3, spikes and collapse over hundreds of RL steps", "", header, "",
             f"Cells: median (min - max) over seeds. Reward at {curve}: the mean of the 10 steps from each (the "
             f"last 10 for the end). k3 first / last: the median k3 over the first / last {TREND_WINDOW} steps; "
             "ratio: last / first; slope: the least-squares slope of log10 k3 per 100 steps. Spikes: steps with k3 "
             f"above {SPIKE_FACTOR:g}x the run's median; after a spike: the mean over the next {AFTERMATH_STEPS} "
             "steps minus the run's mean, averaged over spikes (grad norm, IS effective sample size of "
             f"pi_old / pi_engine, PPO clip fraction, reward). Collapse: {collapse_prose()} "
             "(r3lab.metrics.reward_collapse); late collapse: "
             f"{collapse_prose(LATE_COLLAPSE_RULE, subject='', threshold=False)} "
             "(r3lab.metrics.late_collapse); seeds flagged, of all seeds.", ""]
    head = ("| engine | setting | objective | seeds | steps | reward at " + curve + " | reward last 50 | k3 first "
            "| k3 last | k3 ratio | k3 slope (log10 / 100 steps) | spikes | after spike: grad norm / IS ESS / "
            "clip frac / reward | collapsed | late collapsed | s / step |")
    lines += [head, "|" + "---|" * 16]
    by = _group(records)
    order = sorted(by, key=lambda k: (k[1] != "base", k[0], k[1], k[2]))
    for key in order:
        sel = by[key]
        curve_cells = " / ".join(_cell([r["curve"][i] for r in sel], ".2f").split(" (")[0]
                                 for i in range(len(CURVE_STEPS)))
        after = " / ".join(_cell([r[f"after_{n}"] for r in sel], "+.3f").split(" (")[0] for n in AFTERMATH_SERIES)
        cells = [key[0], key[1], key[2], str(len(sel)), _cell([r["steps"] for r in sel], "d"), curve_cells,
                 _cell([r["reward_last50"] for r in sel], ".3f"), _cell([r["k3_first"] for r in sel], ".2e"),
                 _cell([r["k3_last"] for r in sel], ".2e"), _cell([r["k3_ratio"] for r in sel], ".2f"),
                 _cell([r["k3_slope"] for r in sel], "+.3f"), _cell([r["spikes"] for r in sel], "d"), after,
                 f"{sum(r['collapse_step'] is not None for r in sel)} / {len(sel)}",
                 f"{sum(r['late_collapse_step'] is not None for r in sel)} / {len(sel)}",
                 _cell([r["s_per_step"] for r in sel], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    stats = []
    for quant in dict.fromkeys(r["engine_quant"] for r in records if r["setting"] == "base"):
        objs = [o for o in dict.fromkeys(r["objective"] for r in records
                                         if r["setting"] == "base" and r["engine_quant"] == quant) if o != "none"]
        for obj in objs:
            for metric in ("reward_last50", "k3_last", "k3_slope"):
                c = mode_comparison(records, metric, obj, "none", engine_quant=quant)
                if c:
                    stats.append(f"| {quant} | {obj} - none | {metric} | {c['n_a']} vs {c['n_b']} | {c['diff']:+.3g} "
                                 f"| [{c['lo']:+.3g}, {c['hi']:+.3g}] | {c['p']:.2f} |")
    if stats:
        lines += ["", "## Do the modes separate beyond the seed spread?", "",
                  "Each objective against none, per engine: the difference of the seed means, its percentile "
                  "bootstrap 95% interval (seeds resampled within each side, 10000 draws, seed 0) and the exact "
                  "two-sided Mann-Whitney p over seeds (r3lab.metrics.mann_whitney_exact). The smallest possible p is "
                  "0.33 with 2 seeds a side and 0.10 with 3: these runs cannot pass a 5% test whatever they do, and "
                  "an interval from 2 or 3 values is a description of the seeds, not a guarantee.", "",
                  "| engine | comparison | number | seeds | difference | bootstrap 95% | Mann-Whitney p |",
                  "|---|---|---|---|---|---|---|"] + stats
    return "\n".join(lines) + "\n"
