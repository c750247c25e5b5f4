"""Figures of committed results and runs: transport and codec tables, RL curves per replay mode, the drift
experiment's bars, and the shift of the expert load over RL steps."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from r3lab import labels, metrics
from r3lab.errors import FigureError
from r3lab.runs import Run, mode_order
from r3lab.viz.style import MODE_COLORS, ONE_COLUMN, TWO_COLUMN, finish, mode_color, plural, translucent
from r3lab.viz.ticks import axis_ticks
from r3lab.vocabulary import DriftMetric, RLMetric, RunKind

__all__ = ["transport_figure", "codec_figure", "rl_curves_figure", "drift_figure", "load_shift_figure"]


def _band(fig: go.Figure, x: np.ndarray, lo: np.ndarray, hi: np.ndarray, color: str, name: str, row: Any = None,
          col: Any = None) -> None:
    fig.add_scatter(x=np.concatenate([x, x[::-1]]), y=np.concatenate([hi, lo[::-1]]), fill="toself",
                    fillcolor=translucent(color, 0.15), line={"width": 0}, hoverinfo="skip", showlegend=False,
                    legendgroup=name, row=row, col=col)


def transport_figure(records: Iterable[Mapping[str, Any]], *, popularity: str = "uniform") -> go.Figure:
    """Bytes per routed id of every transport method, one bar group per workload (bench/results/transport.json)."""
    rows = [r for r in records if r["popularity"] == popularity]
    if not rows:
        raise FigureError(f"no transport records with popularity={popularity!r}")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig = go.Figure()
    values = []
    for m in methods:
        by_w = {r["workload"]: r["bytes_per_id"] for r in rows if r["method"] == m}
        values += [by_w.get(w) for w in workloads]
        fig.add_bar(name=m, x=workloads, y=[by_w.get(w) for w in workloads], hovertemplate="%{x}<br>%{y:.3f} bytes/id")
    fig.update_yaxes(title_text="bytes per routed id", **axis_ticks(values, include_zero=True))
    return finish(fig, {"width": 1100, "height": 520}, title="Routed-expert transport: bytes per routed id",
                  subtitle=f"{popularity} expert popularity", barmode="group", legend={"orientation": "h", "y": -0.2})


def codec_figure(records: Iterable[Mapping[str, Any]]) -> go.Figure:
    """Codec comparison (``r3lab.compaction.measure_codecs`` records): bytes per routed id and encode + decode
    throughput per codec, one bar group per set of routes."""
    rows = list(records)
    if not rows:
        raise FigureError("no codec records to plot")
    missing = {"routes", "codec", "bytes_per_id", "mids_per_s"} - set(rows[0])
    if missing:
        raise FigureError(f"codec records lack {sorted(missing)} (use r3lab.compaction.measure_codecs)")
    groups = list(dict.fromkeys(r["routes"] for r in rows))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    palette = ["#4c4c4c", "#8c564b", "#9467bd", "#17becf", "#bcbd22", "#2ca02c", "#d62728", "#ff7f0e", "#1f77b4"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("size: bytes per routed id", "speed: encode + decode, M ids/s"))
    for i, c in enumerate(codecs):
        by = {r["routes"]: r for r in rows if r["codec"] == c}
        color = palette[i % len(palette)]
        for col, key in ((1, "bytes_per_id"), (2, "mids_per_s")):
            fig.add_bar(x=groups, y=[by[g][key] if g in by else None for g in groups], name=c, marker_color=color,
                        legendgroup=c, showlegend=col == 1, row=1, col=col,
                        hovertemplate=f"{c}<br>%{{x}}<br>%{{y:.3g}}<extra></extra>")
    for col, key in ((1, "bytes_per_id"), (2, "mids_per_s")):  # linear: bar lengths compare
        fig.update_yaxes(**axis_ticks([r[key] for r in rows], include_zero=True), row=1, col=col)
    return finish(fig, TWO_COLUMN, title="Route codecs: size and speed", barmode="group")


def rl_curves_figure(runs: Sequence[Run], metric: str = RLMetric.K3_KL, *, log: bool | None = None,
                     title: str | None = None) -> go.Figure:
    """One metric over RL steps per replay mode: the median over seeds as a line, min - max as a band.

    ``runs`` are RL runs (``r3lab.runs.load``) of one model; the metric is any key of their step records.
    """
    by_mode: dict[str, list[np.ndarray]] = {}
    for r in runs:
        r.require_kind(RunKind.RL)
        vals = np.array([np.nan if s.get(metric) is None else s[metric] for s in r.step_records], dtype=np.float64)
        if np.isnan(vals).all():
            raise FigureError(f"run {r.name!r} has no values of {metric!r}")
        by_mode.setdefault(r.config["mode"], []).append(vals)
    if not by_mode:
        raise FigureError("no runs to plot")
    fig = go.Figure()
    shown = []
    for mode in mode_order(by_mode):
        n = min(len(v) for v in by_mode[mode])
        stack = np.stack([v[:n] for v in by_mode[mode]])
        x = np.arange(n)
        color = mode_color(mode)
        if stack.shape[0] > 1:
            _band(fig, x, np.nanmin(stack, 0), np.nanmax(stack, 0), color, mode)
            shown += [np.nanmin(stack, 0), np.nanmax(stack, 0)]
        median = np.nanmedian(stack, 0)
        shown.append(median)
        fig.add_scatter(x=x, y=median, mode="lines+markers" if n < 12 else "lines",
                        name=f"{mode} ({plural(stack.shape[0], 'seed')})", line={"color": color, "width": 2},
                        legendgroup=mode, hovertemplate=f"{mode}, step %{{x}}: %{{y:.4g}}<extra></extra>")
    use_log = labels.scale(metric) == "log" if log is None else log
    percent = labels.kind(metric) == "percent"
    fig.update_yaxes(title_text=labels.axis_title(metric), type="log" if use_log else "linear",
                     **axis_ticks(np.concatenate(shown), log=use_log, percent=percent))
    fig.update_xaxes(title_text="RL step", **axis_ticks(np.arange(max(len(v) for v in shown)), integer=True))
    seeds = sorted({len(v) for v in by_mode.values()})
    sub = "median over seeds, min - max band" if seeds[-1] > 1 else "one seed per mode"
    return finish(fig, ONE_COLUMN, title=title or labels.label(metric), subtitle=sub)


def _median_min_max(v: np.ndarray) -> tuple[float, float, float]:
    """Median, min and max of the finite values (NaN, quietly, when there are none: no route-flipped tokens)."""
    f = v[np.isfinite(v)]
    return (float(np.median(f)), float(f.min()), float(f.max())) if f.size else (np.nan, np.nan, np.nan)


def drift_figure(run: Run) -> go.Figure:
    """The drift experiment: k3 KL without replay and with R3, per (model, trainer), median over seeds with
    min - max error bars, overall and on route-flipped tokens."""
    run.require_kind(RunKind.DRIFT)
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in run.step_records:
        cells.setdefault((s["model"], s["trainer_dtype"]), []).append(s)
    trainer = {"bfloat16": "bf16 trainer, fp32 router", "float32": "fp32 trainer"}
    names = [f"{m}<br>{trainer.get(d, d)}" for m, d in cells]
    seeds = sorted({len(cs) for cs in cells.values()})
    fig = go.Figure()
    shown = []
    for key, name, color, symbol in (
            (DriftMetric.K3_NONE, "none", MODE_COLORS["none"], "circle"),
            (DriftMetric.K3_R3, "R3", MODE_COLORS["R3"], "circle"),
            (DriftMetric.K3_FLIPPED_NONE, "none, route-flipped tokens", MODE_COLORS["none"], "diamond-open"),
            (DriftMetric.K3_FLIPPED_R3, "R3, route-flipped tokens", MODE_COLORS["R3"], "diamond-open")):
        vals = [np.array([c.get(key, np.nan) for c in cs], dtype=np.float64) for cs in cells.values()]
        spread = np.array([_median_min_max(v) for v in vals]).reshape(-1, 3)  # NaN where no cell has the value
        med = spread[:, 0]
        n = [int(np.isfinite(v).sum()) for v in vals]
        shown += list(spread[:, 1:].ravel()) if max(n) > 1 else list(med)
        # points on the log axis (a bar's length from an arbitrary floor means nothing); min - max only where
        # a cell has two or more seeds (one seed has no spread to show)
        error = {"type": "data", "symmetric": False, "array": np.where(np.array(n) > 1, spread[:, 2] - med, 0),
                 "arrayminus": np.where(np.array(n) > 1, med - spread[:, 1], 0), "visible": max(n) > 1,
                 "thickness": 1.5, "width": 6}
        fig.add_scatter(x=names, y=med, name=name, mode="markers", offsetgroup=name, error_y=error, customdata=n,
                        marker={"color": color, "size": 11, "symbol": symbol, "line": {"width": 2, "color": color}},
                        hovertemplate=f"{name}<br>%{{x}}<br>median %{{y:.3g}} over %{{customdata}} seed(s)"
                                      "<extra></extra>")
    fig.update_yaxes(type="log", title_text="train-inference k3 KL (nats/token)", **axis_ticks(shown, log=True))
    sub = (f"median over {plural(seeds[-1], 'seed')}, min - max as error bars" if seeds[-1] > 1 else
           "one seed per cell: no spread shown")
    return finish(fig, TWO_COLUMN, title=f"What R3 changes ({plural(seeds[-1], 'seed')})", subtitle=sub,
                  scattermode="group")


def load_shift_figure(runs: Sequence[Run], *, what: str = "engine") -> go.Figure:
    """How the expert load moves over RL steps, per replay mode: the mean over layers of the total-variation
    distance between each stored step's load and the first stored step's, median over seeds (RL runs with
    routes stored at several steps, e.g. ``token_steps=1``)."""
    by_mode: dict[str, list[tuple[list[int], list[float]]]] = {}
    for r in runs:
        r.require_kind(RunKind.RL)
        steps = r.route_steps(what)
        if len(steps) < 2:
            raise FigureError(f"run {r.name!r} stores {what!r} routes at {len(steps)} step(s); the shift needs two or "
                              "more (run it with token_steps=1)")
        loads = [metrics.expert_load(rt.values, rt.num_experts) for rt in (r.routes(s, what) for s in steps)]
        by_mode.setdefault(r.config["mode"], []).append(
            (steps, [float(metrics.load_shift(ld, loads[0]).mean()) for ld in loads]))
    fig = go.Figure()
    shown = []
    for mode in mode_order(by_mode):
        series = by_mode[mode]
        n = min(len(s) for s, _ in series)
        y = np.median(np.array([v[:n] for _, v in series]), axis=0)
        shown.append(y)
        fig.add_scatter(x=series[0][0][:n], y=y, mode="lines+markers", name=f"{mode} ({plural(len(series), 'seed')})",
                        line={"color": mode_color(mode)})
    fig.update_xaxes(title_text="RL step", **axis_ticks(np.concatenate([s for v in by_mode.values() for s, _ in v]),
                                                        integer=True))
    fig.update_yaxes(title_text="total-variation distance", **axis_ticks(np.concatenate(shown)))
    return finish(fig, ONE_COLUMN, title=f"{what} expert load: shift from the first step",
                  subtitle="mean over layers, median over seeds")
