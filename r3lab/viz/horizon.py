"""The long-horizon figure, from the runs of bench/bench_horizon.py read by :mod:`r3lab.runs.horizon`.

:func:`horizon_figure`: per group (engine, objective), over steps, the train-inference k3 (log axis) and the
reward (a 10-step trailing mean), each the median over seeds with a min - max band; and the spike aftermath: the
mean change of grad norm, IS effective sample size, clip fraction and reward over the 10 steps after a k3 spike,
one point per run, each series in its own panel on its own y axis (a grad norm of 1e5 next to an ESS change of
1e-3 on one axis would draw the ESS, clip fraction and reward as flat zero). It draws the sweep's base setting;
:func:`horizon_search_figure` draws the collapse search, one row per setting (k3 and reward per objective).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from r3lab.config import RLMetric
from r3lab.errors import FigureError
from r3lab.runs.horizon import AFTERMATH_SERIES, AFTERMATH_STEPS, horizon_bands, horizon_records, horizon_setting
from r3lab.viz.phase import OBJECTIVE_STYLES
from r3lab.viz.style import finish, lighter, translucent
from r3lab.viz.ticks import axis_ticks

__all__ = ["horizon_figure", "horizon_search_figure", "HORIZON_SIZE", "AFTERMATH_TITLES"]

HORIZON_SIZE = {"width": 1100, "height": 860}


AFTERMATH_TITLES = {"grad_norm": "grad norm", "is_ess": "IS eff. sample size", "clip_frac": "clip fraction",
                    "reward": "reward"}  # the aftermath panels' titles, per AFTERMATH_SERIES name


def _of_setting(runs: Sequence[Any], setting: str | None) -> list[Any]:
    """The runs of one search setting (``base``: the sweep's own); None: every run."""
    runs = list(runs)
    if not runs:
        raise FigureError("no runs to draw")
    if setting is None:
        return runs
    kept = [r for r in runs if horizon_setting(r.config) == setting]
    if not kept:
        have = sorted({horizon_setting(r.config) for r in runs})
        raise FigureError(f"no runs of the setting {setting!r} among {len(runs)} runs (settings: {have})")
    return kept


def horizon_figure(runs: Sequence[Any], *, smooth: int = 10, setting: str | None = "base") -> go.Figure:
    """k3 and reward over steps with seed bands per (engine, objective), and the spike aftermath per run (one
    panel per series: grad norm, IS ESS, clip fraction, reward), of the runs of one ``setting`` (``base``: the
    sweep's own; None: every run given)."""
    runs = _of_setting(runs, setting)
    names = list(AFTERMATH_SERIES)
    n = len(names)
    wide = [{"colspan": n}] + [None] * (n - 1)
    fig = make_subplots(rows=3, cols=n, specs=[wide, wide, [{} for _ in names]], row_heights=[0.38, 0.34, 0.28],
                        vertical_spacing=0.1, horizontal_spacing=0.07,
                        subplot_titles=("train-inference k3 per step (median and min - max over seeds)",
                                        f"reward ({smooth}-step trailing mean; median and min - max over seeds)",
                                        *(f"after a spike: {AFTERMATH_TITLES.get(m, m)}" for m in names)))
    k3, reward = horizon_bands(runs, RLMetric.K3_KL), horizon_bands(runs, RLMetric.REWARD, smooth=smooth)
    first_engine = next(iter(k3)).split(" ", 1)[0]
    for row, bands in ((1, k3), (2, reward)):
        for name, b in bands.items():
            engine, obj = name.split(" (")[0].split(" ", 1)
            color, dash, _ = OBJECTIVE_STYLES.get(obj, ("#555555", "solid", "circle"))
            if engine != first_engine:  # a second engine: the objective's colour, lighter (open markers below)
                color = lighter(color)
            lo, hi = b["lo"], b["hi"]
            if row == 1:  # a log axis: clip the band's floor above 0
                lo, hi = np.maximum(lo, 1e-14), np.maximum(hi, 1e-14)
            fig.add_trace(go.Scatter(x=np.r_[b["steps"], b["steps"][::-1]], y=np.r_[hi, lo[::-1]], fill="toself",
                                     fillcolor=translucent(color, 0.18), line={"width": 0}, hoverinfo="skip",
                                     showlegend=False, legendgroup=name), row=row, col=1)
            fig.add_trace(go.Scatter(x=b["steps"], y=np.maximum(b["median"], 1e-14) if row == 1 else b["median"],
                                     mode="lines", line={"color": color, "dash": dash, "width": 1.5},
                                     name=f"{name} ({b['seeds']} seed{'s' if b['seeds'] != 1 else ''})",
                                     legendgroup=name, showlegend=row == 1), row=row, col=1)
    records = horizon_records(runs)
    objectives = list(dict.fromkeys(r["objective"] for r in records))
    engines = list(dict.fromkeys(r["engine_quant"] for r in records))
    for rec in records:
        color, _, marker = OBJECTIVE_STYLES.get(rec["objective"], ("#555555", "solid", "circle"))
        if rec["engine_quant"] != records[0]["engine_quant"]:
            marker += "-open"  # a second engine: the same objective's marker, open
        for col, m in enumerate(names, start=1):
            fig.add_trace(go.Scatter(x=[rec["objective"]], y=[rec[f"after_{m}"]], mode="markers",
                                     marker={"color": color, "symbol": marker, "size": 9},
                                     name=rec["run"], showlegend=False,
                                     hovertemplate=f"{rec['run']}: {m} %{{y:+.3g}} ({rec['spikes']} spikes)"
                                                   "<extra></extra>"),
                          row=3, col=col)
    fig.update_yaxes(type="log", title_text="k3 KL", exponentformat="power", row=1, col=1)
    fig.update_yaxes(title_text="reward", row=2, col=1)
    for col in range(1, n + 1):
        fig.update_yaxes(zeroline=True, zerolinecolor="#999999", exponentformat="power", row=3, col=col)
        fig.update_xaxes(categoryorder="array", categoryarray=objectives, row=3, col=col)
    fig.update_yaxes(title_text="change", row=3, col=1)
    fig.update_xaxes(matches="x2", row=1, col=1)  # k3 and reward share the step axis: its title once, below reward
    fig.update_xaxes(title_text="step", title_standoff=4, row=2, col=1)
    fig = finish(fig, HORIZON_SIZE, title="The long horizon: k3 and reward over hundreds of RL steps",
                 subtitle=f"after a spike (a step with k3 above 10x the run's median): the mean over the next "
                          f"{AFTERMATH_STEPS} steps minus the run's mean, one point per run"
                          + (f"; {', '.join(engines[1:])}: lighter lines, open markers" if len(engines) > 1 else ""),
                 legend={"orientation": "h", "x": 0, "xanchor": "left", "y": -0.05, "yanchor": "top"},
                 margin={"b": 40})
    fig.update_layout(margin_t=fig.layout.margin.t + 25)  # the title block clear of the first panel's title
    return fig


def horizon_search_figure(runs: Sequence[Any], *, smooth: int = 10) -> go.Figure:
    """The collapse search: one row per search setting (every setting but ``base``), k3 per step (log axis) on the
    left and the reward (a ``smooth``-step trailing mean) on the right, one line per (engine, objective): the median
    over seeds with a min - max band where a setting has several seeds."""
    runs = list(runs)
    of_setting: dict[str, list[Any]] = {}
    for r in runs:
        of_setting.setdefault(horizon_setting(r.config), []).append(r)
    settings = [s for s in of_setting if s != "base"]
    if not settings:
        raise FigureError(f"no collapse-search runs among {len(runs)} runs (every run has the sweep's base setting)")
    fig = make_subplots(rows=len(settings), cols=2, shared_xaxes=True, vertical_spacing=0.32 / len(settings),
                        horizontal_spacing=0.08,
                        subplot_titles=[f"{s}: {what}" for s in settings for what in ("k3", "reward")])
    shown: set[str] = set()
    for row, setting in enumerate(settings, start=1):
        these = of_setting[setting]
        drawn: list[np.ndarray] = []
        for col, bands in ((1, horizon_bands(these, RLMetric.K3_KL)),
                           (2, horizon_bands(these, RLMetric.REWARD, smooth=smooth))):
            for name, b in bands.items():
                label = name.split(" (")[0]  # "<engine> <objective>": the row's title names the setting
                obj = label.split(" ", 1)[1]
                color, dash, _ = OBJECTIVE_STYLES.get(obj, ("#555555", "solid", "circle"))
                lo, hi, mid = b["lo"], b["hi"], b["median"]
                if col == 1:  # a log axis: clip the floor above 0
                    lo, hi, mid = (np.maximum(v, 1e-14) for v in (lo, hi, mid))
                    drawn += [lo, hi] if b["seeds"] > 1 else [mid]
                if b["seeds"] > 1:
                    fig.add_trace(go.Scatter(x=np.r_[b["steps"], b["steps"][::-1]], y=np.r_[hi, lo[::-1]],
                                             fill="toself", fillcolor=translucent(color, 0.18), line={"width": 0},
                                             hoverinfo="skip", showlegend=False, legendgroup=label),
                                  row=row, col=col)
                fig.add_trace(go.Scatter(x=b["steps"], y=mid, mode="lines",
                                         line={"color": color, "dash": dash, "width": 1.5}, name=label,
                                         legendgroup=label, showlegend=label not in shown,
                                         hovertemplate=f"{setting}, {label} ({b['seeds']} seed"
                                                       f"{'s' if b['seeds'] != 1 else ''}): step %{{x}}, "
                                                       "%{y:.3g}<extra></extra>"),
                              row=row, col=col)
                shown.add(label)
        fig.update_yaxes(type="log", **axis_ticks(np.concatenate(drawn), log=True, target=3), row=row, col=1)
    fig.update_xaxes(title_text="step", title_standoff=4, row=len(settings))
    height = 150 + 190 * len(settings)
    fig = finish(fig, {"width": HORIZON_SIZE["width"], "height": height},
                 title="The collapse search: k3 and reward per setting tried",
                 subtitle="each row one setting that differs from the sweep's base; lines: median over seeds "
                          "(bands: min - max where a setting has several)",
                 legend={"orientation": "h", "x": 0, "xanchor": "left", "y": -0.3 / len(settings),
                         "yanchor": "top"},
                 margin={"b": 40})
    fig.update_layout(margin_t=fig.layout.margin.t + 25)
    return fig
