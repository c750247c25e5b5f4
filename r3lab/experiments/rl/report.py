"""What an RL run writes and reports: each step into the run folder, the run summary (means, reward quarters, the
collapse detector's verdict, the trainer's notes, the doctor's checks), and the comparison table over modes and
seeds."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.config import MODES, RLConfig, RLMetric
from r3lab.doctor import diagnose
from r3lab.experiments.rl.batch import StepRollout, step_samples
from r3lab.experiments.rl.trainer import trainer_notes
from r3lab.labels import label
from r3lab.runs import RunWriter
from r3lab.vocabulary import COLLAPSE_RULE, collapse_prose

__all__ = ["write_step", "finish_run", "run_summary", "collapse_state"]


def write_step(writer: RunWriter, config: RLConfig, step: int, rollout: StepRollout, tokens: dict[str, np.ndarray],
               record: dict[str, Any]) -> None:
    """One step into the run folder: its per-token table (first and last step, and every ``token_steps``), its
    samples with their engine routes (every step: it can be scored again), and its step line."""
    if step in (0, config.steps - 1) or (config.token_steps and step % config.token_steps == 0):
        writer.write_tokens(step, tokens)
    writer.write_samples(step, step_samples(rollout.results, multiturn=config.turns > 1))
    writer.write_routes(step, "engine", rollout.batch.engine_routes)
    writer.log_step(record)


def finish_run(writer: RunWriter | None, config: RLConfig, history: Sequence[dict[str, Any]], *,
               prior: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The run's summary; with a ``writer``, the doctor's checks on what the run wrote (its report printed when not
    ok) join it and the run is finished. ``prior``: the steps before a resumed run's first (the saved policy's
    rewards), so the collapse block counts steps from 0 as the detector did."""
    summary = run_summary(history)
    summary.update(collapse_summary([*prior, *history]))
    summary.update(trainer_notes(config.to_dict()))
    if writer is not None:
        report = diagnose(writer.path)  # the field's silent failures, checked on what this run wrote
        summary.update(report.summary())
        if not report.ok:
            print(report.text(), file=sys.stderr)
        writer.finish(summary)
    return summary


def run_summary(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means over the run and over its last quarter, and the reward's first and last quarter."""
    keys = sorted({k for h in history for k, v in h.items() if isinstance(v, int | float) and k != "step"})
    q = max(1, len(history) // 4)
    out: dict[str, Any] = {"steps": len(history)}
    for k in keys:
        vals = np.array([h[k] for h in history if h.get(k) is not None], dtype=np.float64)
        if vals.size:
            out[f"mean/{k}"] = float(vals.mean())
            out[f"last_quarter/{k}"] = float(vals[-q:].mean())
    r = np.array([h[RLMetric.REWARD] for h in history])
    out[RLMetric.REWARD_FIRST_QUARTER] = float(r[:q].mean())
    out[RLMetric.REWARD_LAST_QUARTER] = float(r[-q:].mean())
    return out


_COLLAPSE_ARGS: dict[str, Any] = COLLAPSE_RULE.parameters()


def collapse_state(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The detector's state at the last step of ``history`` (it only looks back: the step log can carry it)."""
    c = metrics.reward_collapse(np.array([h[RLMetric.REWARD] for h in history]), **_COLLAPSE_ARGS)
    peak = c.peak[-1]
    return {RLMetric.COLLAPSE_PEAK: None if np.isnan(peak) else float(peak),
            RLMetric.COLLAPSE_STREAK: int(c.streak[-1]), RLMetric.COLLAPSED: bool(c.collapsed[-1])}


def collapse_summary(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run summary's collapse block: ``collapse/step`` and ``collapse/reason`` (None: no collapse), the
    definition and its parameters, and the first step of each precursor blow-up (10x its trailing 5-step median:
    k3, the largest ``|dlogp|`` and the policy's largest ``|dlogp|``; the clip fraction above 0.5; the IS ESS below
    0.5)."""
    r = np.array([h[RLMetric.REWARD] for h in history], dtype=np.float64)
    c = metrics.reward_collapse(r, **_COLLAPSE_ARGS)
    out: dict[str, Any] = {RLMetric.COLLAPSE_STEP: c.step, "collapse/detected_step": c.detected,
                           "collapse/definition": metrics.COLLAPSE_DEFINITION, "collapse/parameters": _COLLAPSE_ARGS,
                           RLMetric.COLLAPSE_REASON: None}
    if c.step is not None and c.detected is not None:
        s, d = c.step, c.detected
        peak = float(c.peak[s])
        fell = collapse_prose(subject=f"reward {r[s]:.3f} at step {s} fell", streak=False, warm_up=False)
        out[RLMetric.COLLAPSE_REASON] = (f"{fell} {peak:.3f} (step {int(np.nanargmax(r[: s + 1]))}) and stayed there "
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
        rise = [float(np.mean([s[RLMetric.REWARD] for s in st[-q:]]) - np.mean([s[RLMetric.REWARD] for s in st[:q]]))
                for st in runs]
        row[RLMetric.REWARD_RISE] = (min(rise), float(np.median(rise)), max(rise))
        rows.append(row)
    return rows


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per (model, mode), every cell min / median / max over seeds of the run's mean (one
    seed: its value alone, no range)."""
    titles = [*[title for _, title, _ in COMPARISON_METRICS], label(RLMetric.REWARD_RISE)]
    head = ["model", "mode", "seeds x steps", *[t.replace("|", "\\|") for t in titles]]  # a "|" would end the cell
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["mode"], f"{r['seeds']} x {r['steps']}"]
        one = r["seeds"] == 1
        for key, _, fmt in COMPARISON_METRICS:
            lo, mid, hi = r[key]
            cells.append(f"{mid:{fmt}}" if one else f"{mid:{fmt}} ({lo:{fmt}} - {hi:{fmt}})")
        lo, mid, hi = r[RLMetric.REWARD_RISE]
        cells.append(f"{mid:+.3f}" if one else f"{mid:+.3f} ({lo:+.3f} - {hi:+.3f})")
        lines.append("| " + " | ".join(cells) + " |")
    said = list(dict.fromkeys(n for r in rows for n in (r.get("notes") or {}).values()))
    lines += [line for n in said for line in ("", f"Note: {n}")]  # e.g. a Megatron trainer's group routing
    return "\n".join(lines) + "\n"
