"""The live figures both widgets draw: ``FigureWidget`` objects extended in place as steps land, one colour per
replay mode (:data:`r3lab.viz.MODE_COLORS`), and the follower's status as HTML."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from r3lab.runs import RunFollower
from r3lab.viz import TEMPLATE, mode_color

__all__ = ["DEFAULT_METRICS", "LAYER_METRIC"]

DEFAULT_METRICS = ("mismatch/k3_kl", "mismatch/extreme_frac_tau2", "reward_mean", "routing/route_change_last_mb",
                   "train/clip_frac")
LAYER_METRIC = "routing/engine_trainer_disagreement_per_layer"  # {layer id: share of (token) rows that differ}
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")
LOG_METRICS = ("mismatch/k3",)


def value(rec: dict[str, Any], metric: str, layer: int | None = None) -> float | None:
    v = rec.get(metric)
    if isinstance(v, dict):
        v = v.get(str(layer)) if layer is not None else None
    return None if v is None else float(v)


def figure(title: str, metric: str, width: int = 470, height: int = 340) -> go.FigureWidget:
    fig = go.FigureWidget()
    fig.update_layout(template=TEMPLATE, title=title, xaxis_title="RL step", yaxis_title=metric, width=width,
                      height=height,
                      yaxis_type="log" if metric.startswith(LOG_METRICS) else "linear",
                      margin={"l": 60, "r": 10, "t": 40, "b": 40}, legend={"orientation": "h", "y": -0.3})
    return fig


Series = tuple[str, str, str, str, list[int], list[float | None]]  # key, label, mode, dash, x, y


def set_traces(fig: go.FigureWidget, series: Sequence[Series]) -> None:
    """Make ``fig`` hold ``series``, extending traces in place; a trace is keyed by ``meta`` (FigureWidget sets uid)."""
    with fig.batch_update():
        have = {t.meta: t for t in fig.data}
        for key, label, mode, dash, x, y in series:
            t = have.get(key)
            if t is None:
                fig.add_scatter(x=x, y=y, name=label, meta=key, mode="lines+markers", legendgroup=mode,
                                line={"color": mode_color(mode), "dash": dash}, marker={"size": 4})
            elif list(t.x or ()) != x or list(t.y or ()) != y:
                t.x, t.y = x, y


def set_steps(fig: go.FigureWidget, total: int | None) -> None:
    """Fix the x axis to the run's steps once (plotly.js autoranges y as data lands).

    Checked in a browser: layout edits sent from the follower's thread after the first one can be lost on
    the way to the page, while data edits arrive; so the x range is set once, before or with the first data.
    """
    if total and tuple(fig.layout.xaxis.range or ()) != (-0.5, total - 0.5):
        fig.update_layout(xaxis_range=[-0.5, total - 0.5], yaxis_autorange=True)


def status_html(follower: RunFollower, extra: str = "") -> str:
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td>"
        f"<td>{len(r.records)}{'' if r.total_steps is None else f' / {r.total_steps}'}</td>"
        f"<td>{'finished' if r.finished else 'running'}</td></tr>"
        for r in follower.snapshot())
    err = f"<br><b style='color:#d62728'>{html.escape(repr(follower.error))}</b>" if follower.error else ""
    return (f"<div class='r3lab-status'><b>{html.escape(follower.state)}</b> &middot; "
            f"{follower.steps_landed()} steps from {len(follower.runs)} run(s) in {html.escape(str(follower.root))}"
            f"{err}{extra}<table>{rows}</table></div>")
