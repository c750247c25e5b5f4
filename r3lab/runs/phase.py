"""The phase diagram's runs read back: one record per run (where it sits in the grid, and what it measured), and
the table ``bench/results/phase.md`` is rendered from.

A run's place in the grid comes from its config (model, ``engine_quant``, the objective its mode / loss / TIS cap
make, staleness, seed), never from its folder name, so runs a user starts from the dial widget sit in the same
diagram as the committed ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from r3lab.config import ENGINE_QUANTS, MODES
from r3lab.errors import MetricError
from r3lab.paths import results_dir
from r3lab.runs.reader import Run, load_runs
from r3lab.vocabulary import RLMetric, RunKind, collapse_prose

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["PHASE_OBJECTIVES", "phase_objective", "phase_run_name", "staleness_run_name", "phase_record",
           "phase_records", "phase_table", "phase_summary", "phase_runs_dir", "PRECISION_ORDER", "LAST_STEPS",
           "SUMMARY_COLUMNS", "PRECURSORS", "r3w_phase_runs"]

# the phase diagram's objectives (bench/bench_phase.py, notebook 05's dial): name -> the RLConfig fields it sets
PHASE_OBJECTIVES: dict[str, dict[str, Any]] = {
    "none": {"mode": "none", "loss": "grpo"},
    "R2": {"mode": "R2", "loss": "grpo"},
    "R3": {"mode": "R3", "loss": "grpo"},
    "R3W": {"mode": "R3W", "loss": "grpo"},  # ids and weights replayed, router gradient stopped (bench_r3w's runs)
    "none+TIS": {"mode": "none", "loss": "grpo", "tis_cap": 2.0},  # FlashRL / TIS's truncation cap
    "R3+TIS": {"mode": "R3", "loss": "grpo", "tis_cap": 2.0},
    "GSPO": {"mode": "none", "loss": "gspo"},  # GSPO's claim: sequence ratios need no routing replay
}
PRECISION_ORDER = ENGINE_QUANTS  # the dial from full engine precision down to int4
LAST_STEPS = 3  # "final reward": the mean over the run's last 3 steps (one step's 32 samples are noisy)


def phase_objective(config: Mapping[str, Any]) -> str:
    """The phase diagram's objective (a key of ``PHASE_OBJECTIVES``) an RL run's config makes."""
    for name, fields in PHASE_OBJECTIVES.items():
        if all(config.get(k, None if k == "tis_cap" else "") == v for k, v in fields.items()) and (
                "tis_cap" in fields or config.get("tis_cap") is None):
            return name
    raise MetricError(f"an RL run with mode={config.get('mode')!r}, loss={config.get('loss')!r}, "
                      f"tis_cap={config.get('tis_cap')!r} is none of the phase diagram's objectives "
                      f"{list(PHASE_OBJECTIVES)}")


def _short(model: str) -> str:
    return model.removeprefix("tiny-").removesuffix("-moe").replace("-moe-", "-")


def phase_run_name(model: str, engine_quant: str, objective: str, seed: int) -> str:
    """``qwen3-fp8-R3_TIS-s0`` (objective R3+TIS): the folder name of one run of the grid."""
    return f"{_short(model)}-{engine_quant}-{objective.replace('+', '_')}-s{int(seed)}"


def staleness_run_name(model: str, engine_quant: str, staleness: int, mode: str, seed: int) -> str:
    """``qwen3-fp8-stale2-R3-s0``: one run of the staleness figure (matched weights)."""
    return f"{_short(model)}-{engine_quant}-stale{int(staleness)}-{mode}-s{int(seed)}"


def _series(run: Run, key: str) -> np.ndarray:
    return np.array([s[key] for s in run.step_records if s.get(key) is not None], dtype=float)


def _mean(x: np.ndarray) -> float | None:
    return float(x.mean()) if x.size else None


def phase_record(run: Run) -> dict[str, Any]:
    """Where a finished RL run sits in the diagram and what it measured (``None`` where the run did not log it)."""
    run.require_kind(RunKind.RL)
    if not run.finished:
        raise MetricError(f"run {run.name!r} is {run.state}: the phase diagram reads finished runs only")
    cfg = run.config
    stale = int(cfg.get("staleness", 0))
    start = stale  # from step `staleness` on, the rollouts are `staleness` updates behind
    def tail(key: str, start: int = start) -> np.ndarray:
        return _series(run, key)[start:]
    reward = _series(run, RLMetric.REWARD)
    summary = run.summary or {}
    rec: dict[str, Any] = {
        "run": run.name, "model": cfg["model"], "engine_quant": cfg.get("engine_quant", "none"),
        "objective": phase_objective(cfg), "mode": cfg["mode"], "seed": int(cfg["seed"]), "staleness": stale,
        "old_logprobs": cfg.get("old_logprobs", "current"), "steps": len(run.step_records),
        "reward_final": _mean(reward[-LAST_STEPS:]), "reward_first": _mean(reward[:LAST_STEPS]),
        "reward_peak": float(reward.max()) if reward.size else None,
        "collapse_step": summary.get(RLMetric.COLLAPSE_STEP),
        "k3": _mean(tail(RLMetric.K3_KL)), "k3_max": float(tail(RLMetric.K3_KL).max(initial=0.0)),
        "f2": _mean(tail(RLMetric.F_2)),
        "abs_dlogp_max": float(tail(RLMetric.ABS_DIFF_MAX).max(initial=0.0)),
        "routing_disagreement": _mean(tail(RLMetric.ENGINE_TRAINER_DISAGREEMENT)),
        "clip_frac_max": float(tail(RLMetric.CLIP_FRAC_MAX).max(initial=0.0)),
        "is_ess_min": float(tail(RLMetric.IS_ESS).min(initial=1.0)) if tail(RLMetric.IS_ESS).size else None,
        "policy_ess_min": (float(tail(RLMetric.POLICY_IS_ESS).min()) if tail(RLMetric.POLICY_IS_ESS).size
                           else None),
        "k3_policy_lag": _mean(tail(RLMetric.K3_POLICY_LAG)),
        "k3_engine_vs_current": _mean(tail(RLMetric.K3_ENGINE_CURRENT)),
    }
    return rec


def phase_runs_dir() -> Path:
    """The committed runs of the phase diagram (``bench/results/phase``); missing: an error naming the command that
    makes them."""
    p = results_dir() / "phase"
    if not p.is_dir():
        raise MetricError(f"no phase-diagram runs at {p}: `python bench/bench_phase.py` makes them (or pass a folder "
                          "of your own runs)")
    return p


def r3w_phase_runs(folder: str | Path | None = None) -> list[Run]:
    """The R3W runs at the diagram's setting (``folder``, default the committed ``bench/results/r3w_rl`` of
    ``python bench/bench_r3w.py --rl``: fp8 and int4, 3 seeds, 16 steps), for drawing beside the diagram's runs.
    Only the R3W runs: that sweep's none and R3 runs are the diagram's own cells run again (and do not reproduce
    them bit for bit: other thread settings), so pooling them would count those cells twice."""
    root = Path(folder) if folder is not None else results_dir() / "r3w_rl"
    if not root.is_dir():
        raise MetricError(f"no R3W runs at {root}: `python bench/bench_r3w.py --rl` makes them")
    runs = [r for r in load_runs(root) if r.kind == RunKind.RL and phase_objective(r.config) == "R3W"]
    if not runs:
        raise MetricError(f"{root} holds no finished R3W run (mode R3W, the phase diagram's setting)")
    return runs


def phase_records(runs: Iterable[Run]) -> list[dict[str, Any]]:
    """:func:`phase_record` of every finished RL run whose config is one of the diagram's objectives."""
    return [phase_record(r) for r in runs]


def _cell(vals: Sequence[float | None], fmt: str) -> str:
    v = [x for x in vals if x is not None]
    if not v:
        return "-"
    mid = f"{float(np.median(v)):{fmt}}"
    return f"{mid} ({min(v):{fmt}} - {max(v):{fmt}})" if len(v) > 1 else mid


def _group(records: Sequence[Mapping[str, Any]], *keys: str) -> dict[tuple[Any, ...], list[Mapping[str, Any]]]:
    out: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in records:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def phase_table(runs: Iterable[Run], *, header: str = "") -> str:
    """The phase diagram as markdown: one row per (model, engine precision, objective), cells median (min - max)
    over seeds; then the staleness runs (matched weights)."""
    records = phase_records(runs)
    if not records:
        raise MetricError("no finished RL runs to tabulate")
    grid = [r for r in records if r["staleness"] == 0 and r["old_logprobs"] == "current"]
    stale = [r for r in records if r["old_logprobs"] == "behaviour"]
    objectives = list(PHASE_OBJECTIVES)
    models = list(dict.fromkeys(r["model"] for r in grid))
    lines = ["# The phase diagram: none, R2, R3, TIS and GSPO as the engine's precision falls", "", header, "",
             "Cells: median (min - max) over seeds. Reward: the mean of the last "
             f"{LAST_STEPS} steps (first: of the first {LAST_STEPS}). Collapse: "
             f"{collapse_prose(subject='seeds whose reward fell')} (r3lab.metrics.reward_collapse), of all seeds. "
             "k3, F(2) (share of tokens with pi_old/pi_engine outside [1/2, 2]) and routing disagreement: means over "
             "steps; max |dlogp| and clip fraction: the largest over steps; ESS: the smallest per-step IS effective "
             "sample size of pi_old / pi_engine, as a share of tokens.", "",
             "| model | engine | objective | reward first | reward final | collapsed | k3 | F(2) | max \\|dlogp\\| "
             "| routing differs | clip frac max | IS ESS min |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by = _group(grid, "model", "engine_quant", "objective")
    for model in models:
        for quant in PRECISION_ORDER:
            for obj in objectives:
                sel = by.get((model, quant, obj))
                if not sel:
                    continue
                collapsed = sum(r["collapse_step"] is not None for r in sel)
                cells = [_short(model), quant, obj, _cell([r["reward_first"] for r in sel], ".3f"),
                         _cell([r["reward_final"] for r in sel], ".3f"), f"{collapsed} / {len(sel)}",
                         _cell([r["k3"] for r in sel], ".2e"), _cell([r["f2"] for r in sel], ".4f"),
                         _cell([r["abs_dlogp_max"] for r in sel], ".2f"),
                         _cell([r["routing_disagreement"] for r in sel], ".4f"),
                         _cell([r["clip_frac_max"] for r in sel], ".3f"), _cell([r["is_ess_min"] for r in sel], ".3f")]
                lines.append("| " + " | ".join(cells) + " |")
    if stale:
        lines += ["", "## Staleness at matched weights", "",
                  "old_logprobs=behaviour: the trainer's copy of the weights the engine sampled with scores the batch "
                  "(decoupled objective). k3 engine-trainer: at the behaviour weights (what replay addresses); policy "
                  "lag: current against behaviour weights. Means over the steps from `staleness` on.", "",
                  "| model | engine | staleness | mode | k3 engine-trainer | k3 policy lag | reward final "
                  "| collapsed |",
                  "|---|---|---|---|---|---|---|---|"]
        by_s = _group(stale, "model", "engine_quant", "staleness", "mode")
        for key in sorted(by_s, key=lambda k: (k[0], PRECISION_ORDER.index(k[1]), k[2], MODES.index(k[3]))):
            sel = by_s[key]
            collapsed = sum(r["collapse_step"] is not None for r in sel)
            lines.append("| " + " | ".join([_short(key[0]), key[1], str(key[2]), key[3],
                                            _cell([r["k3"] for r in sel], ".2e"),
                                            _cell([r["k3_policy_lag"] for r in sel], ".2e"),
                                            _cell([r["reward_final"] for r in sel], ".3f"),
                                            f"{collapsed} / {len(sel)}"]) + " |")
    return "\n".join(lines) + "\n"


SUMMARY_COLUMNS = {"reward_final": "reward final", "k3": "k3", "f2": "F(2)", "abs_dlogp_max": "max |dlogp|",
                   "routing_disagreement": "routing differs", "clip_frac_max": "clip frac max",
                   "is_ess_min": "IS ESS min"}  # phase_record's keys -> the summary's column titles
PRECURSORS = ("f2", "abs_dlogp_max", "clip_frac_max", "is_ess_min")  # what precedes collapse in the literature


def phase_summary(records: Iterable[Mapping[str, Any]], numbers: Sequence[str] = ("reward_final", "k3"), *,
                  collapsed: bool = True) -> pd.DataFrame:
    """The grid's key numbers as a table: one row per (model, objective), one column per (number, engine precision)
    holding the median over seeds of each of ``numbers`` (keys of :data:`SUMMARY_COLUMNS`; :data:`PRECURSORS` for
    how close a run came to collapse), and (``collapsed``) the seeds that collapsed, ``"0/3"``. Staleness runs are
    left out (:func:`phase_table` lists them)."""
    import pandas as pd

    unknown = [n for n in numbers if n not in SUMMARY_COLUMNS]
    if unknown:
        raise MetricError(f"no summary number(s) {unknown}; the numbers are {list(SUMMARY_COLUMNS)}")
    grid = [r for r in records if r["staleness"] == 0 and r["old_logprobs"] == "current"]
    if not grid:
        raise MetricError("no phase-diagram records (staleness 0, old_logprobs=current) to summarize")
    names = [SUMMARY_COLUMNS[n] for n in numbers] + (["collapsed"] if collapsed else [])
    rows: dict[tuple[str, str], dict[tuple[str, str], Any]] = {}
    for (model, quant, obj), sel in _group(grid, "model", "engine_quant", "objective").items():
        row = rows.setdefault((_short(model), obj), {})
        for key in numbers:
            vals = [r[key] for r in sel if r[key] is not None]
            row[(SUMMARY_COLUMNS[key], quant)] = float(np.median(vals)) if vals else None
        row[("collapsed", quant)] = f"{sum(r['collapse_step'] is not None for r in sel)}/{len(sel)}"
    objectives, models = list(PHASE_OBJECTIVES), list(dict.fromkeys(_short(r["model"]) for r in grid))
    order = sorted(rows, key=lambda k: (models.index(k[0]), objectives.index(k[1])))
    quants = [q for q in PRECISION_ORDER if any(r["engine_quant"] == q for r in grid)]
    columns = pd.MultiIndex.from_tuples([(name, q) for name in names for q in quants], names=["", "engine"])
    return pd.DataFrame([[rows[k].get(c) for c in columns] for k in order], columns=columns,
                        index=pd.MultiIndex.from_tuples(order, names=["model", "objective"]))
