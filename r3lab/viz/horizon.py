"""The long-horizon figure, from the runs of bench/bench_horizon.py read by :mod:`r3lab.runs.horizon`.

:func:`horizon_figure`: per group (engine, objective), over steps, the train-inference k3 (log axis) and the
reward (a 10-step trailing mean), each the median over seeds with a min - max band; and the spike aftermath: the
mean change of grad norm, IS effective sample size, clip fraction and reward over the 10 steps after a k3 spike,
one point per run.
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

__all__ = ["horizon_figure", "HORIZON_SIZE"]

HORIZON_SIZE = {"width": 1100, "height": 900}


def _band_color(color: str, alpha: float = 0.18) -> str:
    c = color.lstrip("#")
    if len(c) != 6:
        return color
    r, g, b = (int(c[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def horizon_figure(runs: Sequence[Any], *, smooth: int = 10) -> go.Figure:
    """k3 and reward over steps with seed bands per (engine, objective), and the spike aftermath per run."""
    runs = list(runs)
    if not runs:
        raise R3LabError("no runs to draw")
    fig = make_subplots(rows=3, cols=1, vertical_spacing=0.09,
                        subplot_titles=("train-inference k3 per step (median and min - max over seeds)",
                                        f"reward ({smooth}-step trailing mean; median and min - max over seeds)",
                                        f"after a k3 spike (> 10x the run's median): mean over the next "
                                        f"{AFTERMATH_STEPS} steps minus the run's mean, one point per run"))
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
    names = list(AFTERMATH_SERIES)
    for rec in records:
        color, _, marker = OBJECTIVE_STYLES.get(rec["objective"], ("#555555", "solid", "circle"))
        fig.add_trace(go.Scatter(x=names, y=[rec[f"after_{n}"] for n in names], mode="markers",
                                 marker={"color": color, "symbol": marker, "size": 9},
                                 name=rec["run"], showlegend=False,
                                 hovertemplate=f"{rec['run']}: %{{x}} %{{y:+.3f}} ({rec['spikes']} spikes)"),
                      row=3, col=1)
    fig.update_yaxes(type="log", title_text="k3 KL", row=1, col=1)
    fig.update_yaxes(title_text="reward", row=2, col=1)
    fig.update_yaxes(title_text="change after a spike", zeroline=True, row=3, col=1)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    return finish(fig, HORIZON_SIZE, title="The long horizon: k3 and reward over hundreds of RL steps")
