"""The collapse experiment's figures, from RL runs such as those of bench/bench_collapse.py.

:func:`collapse_survival_figure`: the Kaplan-Meier curve of the late-collapse step per arm (the share of runs without
a late collapse against step; a run without one is censored at its last step, marked with a tick), the statistic
the experiment's secondary log-rank test compares. :func:`collapse_k3_figure`: the train-inference k3 of every run
that collapsed, aligned at its drop (the first step of the late-collapse streak), to show whether k3 rose before the
reward fell. A run's arm comes from its config (replay mode and engine setting), never from its name; the collapse
is :func:`r3lab.metrics.late_collapse` on the run's reward series, as the experiment's table computes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np
import plotly.graph_objects as go

from r3lab import labels
from r3lab.errors import FigureError
from r3lab.metrics import late_collapse
from r3lab.runs.stats import kaplan_meier
from r3lab.viz.style import TWO_COLUMN, finish, mode_color, plural
from r3lab.viz.ticks import axis_ticks
from r3lab.vocabulary import LATE_COLLAPSE_RULE, RLMetric, RunKind, collapse_prose

__all__ = ["collapse_survival_figure", "collapse_k3_figure"]

_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_ENGINE_DASHES = ("solid", "dash", "dot", "dashdot")  # one per engine setting, in the order the runs bring them
_DROP_COLOR = "#444444"
_LEGEND = {"orientation": "h", "x": 0, "xanchor": "left", "y": -0.18, "yanchor": "top"}


def _arm(config: dict[str, Any]) -> str:
    """An RL run's arm from its config: ``"<mode>, <engine> engine"``, the engine its simulated quantization
    (``engine_quant``) or, unquantised, its dtype (``"none, int4 engine"``, ``"R3, int4 engine"``,
    ``"none, bf16 engine"``)."""
    quant = config.get("engine_quant", "none")
    dtype = config.get("engine_dtype", "bfloat16")
    engine = quant if quant != "none" else _DTYPE_SHORT.get(dtype, dtype)
    return f"{config.get('mode', 'none')}, {engine} engine"


@dataclass(frozen=True)
class _Collapse:
    """One run as both figures read it: its arm, steps, late-collapse step (None: none) and k3 series."""

    name: str
    arm: str
    mode: str
    engine: str
    steps: int
    drop: int | None
    k3: np.ndarray


def _series(run: Any, key: str) -> np.ndarray:
    return np.array([np.nan if s.get(key) is None else s[key] for s in run.step_records], dtype=float)


def _collapses(runs: Sequence[Any]) -> list[_Collapse]:
    runs = list(runs)
    if not runs:
        raise FigureError("no runs to draw: the collapse figures need RL runs (bench/bench_collapse.py's)")
    out = []
    for run in runs:
        run.require_kind(RunKind.RL)
        reward = _series(run, RLMetric.REWARD)
        if reward.size == 0:
            raise FigureError(f"run {run.name!r} has no steps: nothing to place on the survival curve")
        arm = _arm(run.config)
        out.append(_Collapse(run.name, arm, str(run.config.get("mode", "none")), arm.split(", ", 1)[1],
                             int(reward.size), late_collapse(reward).step, _series(run, RLMetric.K3_KL)))
    return out


def _styles(collapses: Sequence[_Collapse]) -> dict[str, tuple[str, str]]:
    """Arm -> (colour, dash): the replay mode's colour (as in every figure), one dash per engine setting."""
    engines = list(dict.fromkeys(c.engine for c in collapses))
    return {c.arm: (mode_color(c.mode), _ENGINE_DASHES[engines.index(c.engine) % len(_ENGINE_DASHES)])
            for c in collapses}


def _by_arm(collapses: Sequence[_Collapse]) -> dict[str, list[_Collapse]]:
    out: dict[str, list[_Collapse]] = {}
    for c in collapses:
        out.setdefault(c.arm, []).append(c)
    return out


def collapse_survival_figure(runs: Sequence[Any]) -> go.Figure:
    """Kaplan-Meier survival per arm: the share of its runs without a late collapse against step, a step function
    (:func:`r3lab.runs.stats.kaplan_meier` of each run's late-collapse step, a run without one censored at its last
    step and marked there with a tick); the legend counts each arm's runs and collapses."""
    collapses = _collapses(runs)
    styles = _styles(collapses)
    fig = go.Figure()
    for arm, sel in _by_arm(collapses).items():
        color, dash = styles[arm]
        times = [c.drop if c.drop is not None else c.steps - 1 for c in sel]
        events = [c.drop is not None for c in sel]
        km = kaplan_meier(times, events)
        end = max(times)
        x = np.r_[0, km.times, end]
        y = np.r_[1.0, km.survival, km.survival[-1] if km.survival.size else 1.0]
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", line={"color": color, "dash": dash, "width": 2,
                                                                 "shape": "hv"},
                                 name=f"{arm} ({plural(len(sel), 'run')}, {sum(events)} collapsed)",
                                 legendgroup=arm,
                                 hovertemplate=f"{arm}: step %{{x}}, survival %{{y:.2f}}<extra></extra>"))
        censored = [c for c in sel if c.drop is None]
        if censored:
            at = [c.steps - 1 for c in censored]
            level = [float(km.survival[km.times <= t][-1]) if (km.times <= t).any() else 1.0 for t in at]
            fig.add_trace(go.Scatter(x=at, y=level, mode="markers", legendgroup=arm, showlegend=False,
                                     marker={"symbol": "line-ns-open", "size": 14, "color": color,
                                             "line": {"width": 2, "color": color}},
                                     customdata=[c.name for c in censored],
                                     hovertemplate="%{customdata}: no late collapse by its last step %{x} "
                                                   "(censored)<extra></extra>"))
    last = max(c.steps for c in collapses) - 1
    fig.update_xaxes(title_text="step", **axis_ticks([0, last], integer=True, pad=0.02))
    fig.update_yaxes(title_text="share of runs without a late collapse", **axis_ticks([0.0, 1.0], pad=0.04))
    return finish(fig, TWO_COLUMN, title="Late collapse per arm: Kaplan-Meier survival",
                  subtitle=f"late collapse: {collapse_prose(LATE_COLLAPSE_RULE)} (r3lab.metrics.late_collapse), "
                           "at the first step of the streak; ticks: runs without one, censored at their last step",
                  legend=_LEGEND)


def collapse_k3_figure(runs: Sequence[Any], before: int = 30, after: int = 10) -> go.Figure:
    """The k3 of every run that collapsed, aligned at its drop (x = step - drop step, from ``-before`` to
    ``+after``, as far as the run has steps), log axis, one line per run in its arm's colour, the drop at x = 0
    marked; runs without a late collapse are not drawn, and a set with none says so in the figure."""
    if not all(isinstance(n, Integral) and not isinstance(n, bool) and n >= 0 for n in (before, after)):
        raise FigureError(f"before and after must be whole numbers of steps >= 0, got {before!r} and {after!r}")
    collapses = _collapses(runs)
    styles = _styles(collapses)
    fell = [c for c in collapses if c.drop is not None]
    fig = go.Figure()
    drawn: list[np.ndarray] = []
    for arm, sel in _by_arm(fell).items():
        color, dash = styles[arm]
        for i, (c, drop) in enumerate((c, c.drop) for c in sel if c.drop is not None):
            lo, hi = max(drop - before, 0), min(drop + after, c.steps - 1)
            steps = np.arange(lo, hi + 1)
            y = c.k3[lo:hi + 1]
            drawn.append(y)
            fig.add_trace(go.Scatter(x=steps - drop, y=y, mode="lines", line={"color": color, "dash": dash,
                                                                                   "width": 1.5},
                                     name=f"{arm} ({plural(len(sel), 'collapsed run')})", legendgroup=arm,
                                     showlegend=i == 0, customdata=steps,
                                     hovertemplate=f"{c.name} (drop at step {drop}): step %{{customdata}}, "
                                                   "k3 %{y:.3g}<extra></extra>"))
    fig.update_xaxes(title_text="steps from the drop (the first step of the late-collapse streak)",
                     **axis_ticks([-before, after], integer=True, pad=0.02))
    fig.update_yaxes(type="log", title_text=labels.axis_title(RLMetric.K3_KL),
                     **(axis_ticks(np.concatenate(drawn), log=True, target=4) if drawn else {}))
    fig.add_vline(x=0, line={"color": _DROP_COLOR, "dash": "dot", "width": 1.5})
    n = len(collapses)
    if fell:
        title = f"k3 around each late collapse ({len(fell)} of {plural(n, 'run')} collapsed)"
        fig.add_annotation(x=0, y=1, xref="x", yref="y domain", text="drop", showarrow=False, xanchor="left",
                           yanchor="top", xshift=4, font={"color": _DROP_COLOR})
    else:
        title = f"k3 around each late collapse: none of the {plural(n, 'run')} collapsed"
        fig.add_annotation(x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                           text=f"no late collapse in any of the {plural(n, 'run')}: no k3 series to align")
    return finish(fig, TWO_COLUMN, title=title,
                  subtitle=f"per collapsed run, k3 from {before} steps before its drop to {after} after (fewer where "
                           "the run starts or ends sooner); runs without a late collapse are not drawn",
                  legend=_LEGEND)
