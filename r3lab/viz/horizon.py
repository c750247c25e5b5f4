"""The long-horizon figure, from the runs of bench/bench_horizon.py read by :mod:`r3lab.runs.horizon`.

:func:`horizon_figure`: per group (engine, objective), over steps, the train-inference k3 (log axis) and the
reward (a 10-step trailing mean), each the median over seeds with a min - max band; and the spike aftermath: the
mean change of grad norm, IS effective sample size, clip fraction and reward over the 10 steps after a k3 spike,
one point per run, each series in its own panel on its own y axis (a grad norm of 1e5 next to an ESS change of
1e-3 on one axis would draw the ESS, clip fraction and reward as flat zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from r3lab.config import RLMetric
from r3lab.errors import R3LabError
from r3lab.runs.horizon import AFTERMATH_SERIES, AFTERMATH_STEPS, horizon_bands, horizon_records
from r3lab.viz.phase import OBJECTIVE_STYLES
from r3lab.viz.style import finish

__all__ = ["horizon_figure", "HORIZON_SIZE", "AFTERMATH_TITLES"]

HORIZON_SIZE = {"width": 1100, "height": 860}


def _band_color(color: str, alpha: float = 0.18) -> str:
    c = color.lstrip("#")
    if len(c) != 6:
        return color
    r, g, b = (int(c[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


AFTERMATH_TITLES = {"grad_norm": "grad norm", "is_ess": "IS eff. sample size", "clip_frac": "clip fraction",
                    "reward": "reward"}  # the aftermath panels' titles, per AFTERMATH_SERIES name


def horizon_figure(runs: Sequence[Any], *, smooth: int = 10) -> go.Figure:
    """k3 and reward over steps with seed bands per (engine, objective), and the spike aftermath per run (one
    panel per series: grad norm, IS ESS, clip fraction, reward)."""
    runs = list(runs)
    if not runs:
        raise R3LabError("no runs to draw")
    names = list(AFTERMATH_SERIES)
    n = len(names)
    wide = [{"colspan": n}] + [None] * (n - 1)
    fig = make_subplots(rows=3, cols=n, specs=[wide, wide, [{} for _ in names]], row_heights=[0.38, 0.34, 0.28],
                        vertical_spacing=0.1, horizontal_spacing=0.07,
                        subplot_titles=("train-inference k3 per step (median and min - max over seeds)",
                                        f"reward ({smooth}-step trailing mean; median and min - max over seeds)",
                                        *(f"after a spike: {AFTERMATH_TITLES.get(m, m)}" for m in names)))
    k3, reward = horizon_bands(runs, RLMetric.K3_KL), horizon_bands(runs, RLMetric.REWARD, smooth=smooth)
    for row, bands in ((1, k3), (2, reward)):
        for name, b in bands.items():
            obj = name.split(" ", 1)[1].split(" (")[0]
            color, dash, _ = OBJECTIVE_STYLES.get(obj, ("#555555", "solid", "circle"))
            lo, hi = b["lo"], b["hi"]
            if row == 1:  # a log axis: clip the band's floor above 0
                lo, hi = np.maximum(lo, 1e-14), np.maximum(hi, 1e-14)
            fig.add_trace(go.Scatter(x=np.r_[b["steps"], b["steps"][::-1]], y=np.r_[hi, lo[::-1]], fill="toself",
                                     fillcolor=_band_color(color), line={"width": 0}, hoverinfo="skip",
                                     showlegend=False, legendgroup=name), row=row, col=1)
            fig.add_trace(go.Scatter(x=b["steps"], y=np.maximum(b["median"], 1e-14) if row == 1 else b["median"],
                                     mode="lines", line={"color": color, "dash": dash, "width": 1.5},
                                     name=f"{name} ({b['seeds']} seed{'s' if b['seeds'] != 1 else ''})",
                                     legendgroup=name, showlegend=row == 1), row=row, col=1)
    records = horizon_records(runs)
    objectives = list(dict.fromkeys(r["objective"] for r in records))
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
                          f"{AFTERMATH_STEPS} steps minus the run's mean, one point per run",
                 legend={"orientation": "h", "x": 0, "xanchor": "left", "y": -0.05, "yanchor": "top"},
                 margin={"b": 40})
    fig.update_layout(margin_t=fig.layout.margin.t + 25)  # the title block clear of the first panel's title
    return fig
