"""The live figures both widgets draw, and the follower's status as HTML.

Each figure is a plain ``plotly.graph_objects.Figure`` (:attr:`LiveFigure.figure`) shown in an ipywidgets
``Output`` as one plotly display (the notebook's own plotly renderer), replaced whole when the data changes.

Why not plotly's ``FigureWidget``: it is an anywidget, and anywidget drops every message to a model whose
front-end module did not load within 2 s of the model's creation (its ``Runtime`` rejects ``ready`` after a
2 s timeout and ``_handle_comm_msg`` awaits ``ready`` for good). plotly's widget module is ~5 MB, so on a
cold page (a first Run All) that happens: the figure keeps its creation state (no title, no data) while the
kernel has everything, and displaying it again does not help. Its ``_py2js_*`` edits (a value set and reset
to None) are also lost when another thread holds the widget's trait notifications. A whole figure in an
``Output`` is one state value: a later one carries everything, whatever came before.
"""

from __future__ import annotations

import html
import json
import math
import threading
from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
import plotly.io as pio

from r3lab.labels import axis_title
from r3lab.runs import FollowedRun, RunFollower
from r3lab.viz import TEMPLATE, axis_ticks, mode_color
from r3lab.viz.style import wrap
from r3lab.vocabulary import RLMetric

DEFAULT_METRICS = (RLMetric.K3_KL, RLMetric.F_2, RLMetric.REWARD, RLMetric.ROUTE_CHANGE_LAST_MB, RLMetric.CLIP_FRAC)
LAYER_METRIC = RLMetric.ENGINE_TRAINER_DISAGREEMENT_PER_LAYER  # {layer id: share of (token) rows that differ}
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")
LOG_METRICS = ("mismatch/k3",)
LEGEND = {"orientation": "h", "yanchor": "top", "y": -0.22, "x": 0}  # below the x title, inside the margin
MARGIN = {"l": 60, "r": 10, "t": 40, "b": 90}  # room for the x title and a row of legend entries
PLOTLY_MIME = "application/vnd.plotly.v1+json"


def value(rec: dict[str, Any], metric: str, layer: int | None = None) -> float | None:
    v = rec.get(metric)
    if isinstance(v, dict):
        v = v.get(str(layer)) if layer is not None else None
    return None if v is None else float(v)


class LiveFigure:
    """A plotly figure shown in an ipywidgets ``Output`` (:attr:`widget`); :meth:`draw` shows its current state.

    Edit :attr:`figure` (a ``go.Figure``) from any thread, then call :meth:`draw`: the whole figure is sent as
    one value, so what the page shows is always the latest figure, never a sum of edits that may be lost.

    ``empty_note``: what the figure says in place while it has no data (what will appear, and how to make it
    appear), drawn instead of an empty axis box; it goes as soon as the figure holds a trace.
    """

    def __init__(self, title: str, metric: str, height: int = 380, empty_note: str | None = None):
        self.empty_note = empty_note
        self.figure = go.Figure()
        log = metric.startswith(LOG_METRICS)
        # the y title wrapped to the plot's height (a long one ran into the figure's title); before any point, a
        # log axis labels whole decades only (plotly's own log ticks repeat "2", "5" in every decade)
        self.figure.update_layout(template=TEMPLATE, title=title, xaxis_title="RL step",
                                  yaxis_title=wrap(axis_title(metric), max(20, (height - 150) // 8)),
                                  height=height, autosize=True, showlegend=True,
                                  yaxis_type="log" if log else "linear", margin=MARGIN, legend=LEGEND)
        if log:
            self.figure.update_layout(yaxis_tickmode="linear", yaxis_tick0=0, yaxis_dtick=1)
        self.widget = widgets.Output(layout=widgets.Layout(min_width="0", overflow="hidden"))
        self._lock = threading.Lock()
        self._shown: str | None = None
        self.draw()

    def draw(self) -> bool:
        """Show the figure as it is now (nothing is sent if the page already shows exactly this); True if sent."""
        with self._lock:
            spec = pio.to_json(self._shown_figure(), validate=False)
            if spec == self._shown:
                return False
            data = json.loads(spec)
            data["config"] = {"responsive": True, "displaylogo": False}
            title = self.figure.layout.title.text or "figure"
            self.widget.outputs = ({"output_type": "display_data", "metadata": {},
                                    "data": {PLOTLY_MIME: data, "text/plain": f"<plotly figure: {title}>"}},)
            self._shown = spec
            return True

    def _shown_figure(self) -> go.Figure:
        """The figure as the page should show it: with no data and an :attr:`empty_note`, the note in place of
        the axes (plotly would draw an empty -1..6 by -1..4 box)."""
        if self.figure.data or not self.empty_note:
            return self.figure
        shown = go.Figure(self.figure)
        shown.update_xaxes(visible=False)
        shown.update_yaxes(visible=False)
        shown.add_annotation(text=self.empty_note, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                             align="center", font={"size": 14})
        return shown


Series = tuple[str, str, str, str, list[int], list[float | None]]  # key, label, mode, dash, x, y


def set_traces(fig: go.Figure, series: Sequence[Series]) -> None:
    """Make ``fig`` hold ``series``, one trace per key (``meta``), and its y range fit them (:func:`fit_y`)."""
    with fig.batch_update():
        have = {t.meta: t for t in fig.data}
        for key, label, mode, dash, x, y in series:
            t = have.get(key)
            if t is None:
                fig.add_scatter(x=x, y=y, name=label, meta=key, mode="lines+markers", legendgroup=mode,
                                line={"color": mode_color(mode), "dash": dash}, marker={"size": 5})
            elif list(t.x or ()) != x or list(t.y or ()) != y:
                t.x, t.y = x, y
    fit_y(fig)


def fit_y(fig: go.Figure) -> None:
    """Fit the y axis to the data with ticks chosen from its range (``viz.axis_ticks``: never crowded or repeated
    labels, e.g. on a log axis over a decade). A constant series is drawn around its value (plotly would span
    value ± 1, so 0.1 drawn from -0.9): ± 10 % of it, ± half a decade on a log axis."""
    ys = [float(v) for t in fig.data for v in (t.y or ()) if v is not None and math.isfinite(float(v))]
    log = fig.layout.yaxis.type == "log"
    if log:
        ys = [v for v in ys if v > 0]
    if not ys:
        fig.update_layout(yaxis_autorange=True, yaxis_range=None)
        if log:
            fig.update_layout(yaxis_tickmode="linear", yaxis_tick0=0, yaxis_dtick=1)  # whole decades, no repeats
        else:
            fig.update_layout(yaxis_tickmode="auto")
        return
    if max(ys) == min(ys):
        v = ys[0]
        ys = [v / 10**0.5, v * 10**0.5] if log else [v - (abs(v) * 0.1 or 0.1), v + (abs(v) * 0.1 or 0.1)]
        ticks = axis_ticks(ys, log=log, pad=0.0)
    else:
        ticks = axis_ticks(ys, log=log)
    fig.update_layout(yaxis_autorange=False, yaxis=ticks)


def set_steps(fig: go.Figure, total: int | None) -> None:
    """Fix the x axis to the run's steps (so the curves grow into a fixed frame)."""
    if total:
        fig.update_layout(xaxis_range=[-0.5, total - 0.5], xaxis_autorange=False,
                          xaxis_dtick=1 if total <= 12 else None)  # whole steps only, never "0.5"


def _run_state(r: FollowedRun) -> str:
    return "finished" if r.finished else ("stopped" if r.stopped else "running")


def status_html(follower: RunFollower, extra: str = "", snapshot: Sequence[FollowedRun] | None = None) -> str:
    """The follower's state, the steps landed and one row per run; from ``snapshot`` (default: a new one), so
    the counts say what the figures drawn from the same snapshot show."""
    snap = follower.snapshot() if snapshot is None else snapshot
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td>"
        f"<td>{len(r.records)}{'' if r.total_steps is None else f' / {r.total_steps}'} steps</td>"
        f"<td>{_run_state(r)}</td></tr>"
        for r in snap)
    err = f"<br><b style='color:#d62728'>{html.escape(repr(follower.error))}</b>" if follower.error else ""
    steps = sum(len(r.records) for r in snap)
    return (f"<div class='r3lab-status'><b>{html.escape(follower.state)}</b> &middot; "
            f"{steps} step{'' if steps == 1 else 's'} from {len(snap)} run{'' if len(snap) == 1 else 's'} in "
            f"{html.escape(str(follower.root))}{err}{extra}<table>{rows}</table></div>")
