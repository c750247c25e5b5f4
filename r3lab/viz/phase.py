"""The phase diagram's two figures, from the records of :mod:`r3lab.runs.phase` (one dict per finished RL run).

:func:`phase_figure`: final reward and train-inference k3 against the engine's precision (the mismatch dial,
``engine_quant``, none to int4), one line per objective (none, R2, R3, none+TIS, R3+TIS, GSPO), one column per
model; the median over seeds with min - max error bars, every collapsed seed marked on its own; ``highlight``:
records of one's own runs (the dial widget's) drawn as stars beside the committed ones, never pooled into their
medians. :func:`staleness_figure`: staleness 0/1/2/4 at matched weights, per replay mode: the engine-trainer k3 at the
behaviour weights, the policy lag and the final reward.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from r3lab import labels
from r3lab.config import MODES
from r3lab.errors import FigureError
from r3lab.runs.phase import LAST_STEPS, PHASE_OBJECTIVES, PRECISION_ORDER
from r3lab.viz.style import MODE_COLORS, finish, mode_color, plural
from r3lab.viz.ticks import axis_ticks
from r3lab.vocabulary import RLMetric, collapse_prose

__all__ = ["phase_figure", "staleness_figure", "OBJECTIVE_STYLES", "PHASE_SIZE", "STALENESS_SIZE"]

Record = Mapping[str, Any]
# objective -> (colour, line dash, marker): a replay mode's colour (MODE_COLORS), TIS dashed, GSPO its own
OBJECTIVE_STYLES: dict[str, tuple[str, str, str]] = {
    "none": (MODE_COLORS["none"], "solid", "circle"),
    "R2": (MODE_COLORS["R2"], "solid", "square"),
    "R3": (MODE_COLORS["R3"], "solid", "circle"),
    "R3W": (MODE_COLORS["R3W"], "solid", "x"),
    "none+TIS": (MODE_COLORS["none"], "dash", "diamond"),
    "R3+TIS": (MODE_COLORS["R3"], "dash", "diamond"),
    "GSPO": (mode_color("GSPO"), "dot", "triangle-up"),
}
PHASE_SIZE = {"width": 1100, "height": 680}
STALENESS_SIZE = {"width": 1100, "height": 500}
COLLAPSE_COLOR = "#000000"
_REWARD_TITLE = f"final reward (mean of the last {LAST_STEPS} steps)"
_PRECISION_TITLE = "engine precision"
_LEGEND = {"orientation": "h", "yanchor": "top", "y": -0.12, "x": 0}


def _grid(records: Iterable[Record]) -> list[Record]:
    """The grid's runs: no staleness, old log-probs from the current weights (what the sweep's grid runs)."""
    return [r for r in records if int(r["staleness"]) == 0 and r.get("old_logprobs", "current") == "current"]


def _stale(records: Iterable[Record]) -> list[Record]:
    """The staleness runs: old log-probs at matched weights (``old_logprobs="behaviour"``)."""
    return [r for r in records if r.get("old_logprobs") == "behaviour"]


def _spread(vals: Sequence[float | None], log: bool = False) -> tuple[float, float, float, int]:
    """Median, min, max and count of the values that draw (not None, finite; > 0 on a log axis); NaNs if none."""
    v = np.array([x for x in vals if x is not None], dtype=np.float64)
    v = v[np.isfinite(v) & ((v > 0) if log else True)]
    if not v.size:
        return np.nan, np.nan, np.nan, 0
    return float(np.median(v)), float(v.min()), float(v.max()), int(v.size)


def _errors(spread: np.ndarray, n: np.ndarray) -> dict[str, Any]:
    """Asymmetric min - max error bars, drawn only where two or more seeds give a spread."""
    many = n > 1
    return {"type": "data", "symmetric": False, "visible": bool(many.any()), "thickness": 1.5, "width": 5,
            "array": np.where(many, spread[:, 2] - spread[:, 0], 0), "arrayminus": np.where(many, spread[:, 0] -
                                                                                                 spread[:, 1], 0)}


def _hover(name: str, x_label: str) -> str:
    return f"{name}<br>{x_label} %{{x}}<br>median %{{y:.4g}} of %{{customdata}} seed(s)<extra></extra>"


def _short_model(model: str) -> str:
    return str(model).rsplit("/", 1)[-1]


def phase_figure(records: Iterable[Record], *, highlight: Iterable[Record] = (), title: str | None = None
                 ) -> go.Figure:
    """Final reward (top) and train-inference k3 KL (bottom, log) against the engine's precision, one line per
    objective, one column per model: median over seeds, min - max as error bars; a black x on every collapsed
    seed (at its own values); ``highlight`` records (one's own runs) as stars.

    Reads the grid's records (``r3lab.runs.phase.phase_records``; staleness 0, current-weight old log-probs).
    """
    grid, own = _grid(records), list(highlight)
    if not grid and not own:
        raise FigureError("no phase-diagram records to plot (staleness 0, old_logprobs=current): "
                          "r3lab.runs.phase.phase_records of the runs of `python bench/bench_phase.py`")
    unknown = sorted({r["engine_quant"] for r in [*grid, *own]} - set(PRECISION_ORDER))
    if unknown:
        raise FigureError(f"engine precision(s) {unknown} are not on the dial {PRECISION_ORDER}")
    models = list(dict.fromkeys([*(r["model"] for r in grid), *(h["model"] for h in own)]))
    quants = [q for q in PRECISION_ORDER if q in {r["engine_quant"] for r in [*grid, *own]}]
    objectives = [o for o in PHASE_OBJECTIVES if o in {r["objective"] for r in [*grid, *own]}]
    fig = make_subplots(rows=2, cols=len(models), shared_xaxes=True, vertical_spacing=0.07,
                        horizontal_spacing=0.05 if len(models) > 1 else 0.0,
                        subplot_titles=[_short_model(m) for m in models])
    fig.update_annotations(font_size=14)
    panels = (("reward_final", False, 1), ("k3", True, 2))
    shown: dict[int, list[float]] = {1: [], 2: []}
    in_legend: set[str] = set()
    seeds = 0
    for col, model in enumerate(models, start=1):
        mine = [r for r in grid if r["model"] == model]
        for obj in objectives:
            cells = [[r for r in mine if r["objective"] == obj and r["engine_quant"] == q] for q in quants]
            if not any(cells):
                continue
            color, dash, symbol = OBJECTIVE_STYLES.get(obj, (mode_color(obj), "solid", "circle"))
            seeds = max(seeds, *(len(c) for c in cells))
            for key, log, row in panels:
                spread = np.array([_spread([r[key] for r in c], log)[:3] for c in cells])
                n = np.array([_spread([r[key] for r in c], log)[3] for c in cells])
                shown[row] += [v for v in spread[n > 0].ravel()]
                fig.add_scatter(x=quants, y=spread[:, 0], customdata=n, name=obj, legendgroup=obj,
                                showlegend=obj not in in_legend, offsetgroup=obj, mode="lines+markers",
                                line={"color": color, "dash": dash, "width": 2},
                                marker={"color": color, "symbol": symbol, "size": 9}, error_y=_errors(spread, n),
                                hovertemplate=_hover(f"{_short_model(model)}, {obj}", "engine"), row=row, col=col)
                in_legend.add(obj)
                collapsed = [r for c in cells for r in c if r.get("collapse_step") is not None]
                if collapsed:
                    fig.add_scatter(x=[r["engine_quant"] for r in collapsed], y=[r[key] for r in collapsed],
                                    mode="markers", offsetgroup=obj, name="collapsed seed (x)",
                                    legendgroup="collapsed", showlegend="collapsed" not in in_legend,
                                    customdata=[[r["seed"], r["collapse_step"], r["objective"]] for r in collapsed],
                                    marker={"symbol": "x-thin", "size": 13, "color": COLLAPSE_COLOR,
                                            "line": {"width": 2.5, "color": COLLAPSE_COLOR}},
                                    hovertemplate="%{customdata[2]}, seed %{customdata[0]} collapsed at step "
                                                  "%{customdata[1]}<br>%{y:.4g}<extra></extra>", row=row, col=col)
                    in_legend.add("collapsed")
    for h in own:  # one's own runs: stars in their objective's offset group, in no median
        color = OBJECTIVE_STYLES.get(h["objective"], (mode_color(h["objective"]),))[0]
        for key, _log, row in panels:
            y = h.get(key)
            fig.add_scatter(x=[h["engine_quant"]], y=[y], mode="markers", offsetgroup=h["objective"],
                            name=f"your run: {h['run']} ({h['objective']}, {plural(int(h['steps']), 'step')})",
                            legendgroup=f"run-{h['run']}", showlegend=row == 1,
                            marker={"symbol": "star", "size": 17, "color": color,
                                    "line": {"width": 1.5, "color": COLLAPSE_COLOR}},
                            hovertemplate=f"your run {h['run']}<br>%{{y:.4g}}<extra></extra>", row=row,
                            col=models.index(h["model"]) + 1)
    for key, log, row in panels:
        vals = shown[row] + [float(h[key]) for h in own if h.get(key) is not None and (h[key] > 0 or not log)]
        vals += [float(r[key]) for r in grid if r.get("collapse_step") is not None and r.get(key) is not None
                 and (r[key] > 0 or not log)]
        ticks = axis_ticks(vals, log=log)
        fig.update_yaxes(type="log" if log else "linear", row=row, **ticks)
        fig.update_yaxes(title_text="final reward" if row == 1 else f"k3 KL ({labels.unit(RLMetric.K3_KL)})",
                         row=row, col=1)
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=quants)
    fig.update_xaxes(title_text=_PRECISION_TITLE, row=2)
    n_runs, n_collapsed = len(grid), sum(r.get("collapse_step") is not None for r in grid)
    if grid:
        spread_words = (f"median over {plural(seeds, 'seed')}, min - max as error bars" if seeds > 1
                        else "one seed per point: no spread shown")
        collapse_words = (f"{n_collapsed} of {plural(n_runs, 'run')} collapsed, each marked x at its own values"
                          if n_collapsed else f"no run collapsed ({plural(n_runs, 'run')}; collapse: "
                          f"{collapse_prose(warm_up=False)})")
        sub = (f"top: {_REWARD_TITLE}; bottom: {labels.label(RLMetric.K3_KL)}; engine precision: simulated weight "
               f"quantization (--engine-quant); {spread_words}; {collapse_words}")
    else:
        sub = "your runs only (no committed records given)"
    if own:
        sub += f"; stars: {plural(len(own), 'run')} of yours"
    out = finish(fig, PHASE_SIZE, title=title or "The phase diagram: reward and train-inference k3 as the engine's "
                 "precision falls", subtitle=sub, scattermode="group", scattergap=0.45, legend=_LEGEND,
                 margin={"b": 130 if len(objectives) + bool(n_collapsed) + len(own) > 7 else 110})
    return out.update_layout(margin_t=out.layout.margin.t + 24)  # room for the model names above the columns


def staleness_figure(records: Iterable[Record], *, title: str | None = None) -> go.Figure:
    """Staleness 0/1/2/4 at matched weights, per replay mode: the engine-trainer k3 at the behaviour weights (what
    replay addresses; dotted: against the current weights, lag and mismatch together), the policy lag (current vs
    behaviour weights), both on log axes, and the final reward; median over seeds, min - max as error bars.

    Reads the staleness records (``old_logprobs="behaviour"``) of one model and engine precision. The policy lag
    is 0 at staleness 0 (the same weights), which a log axis cannot draw: the subtitle says so.
    """
    stale = _stale(records)
    if not stale:
        raise FigureError("no staleness records to plot (old_logprobs=behaviour): the staleness runs of "
                          "`python bench/bench_phase.py`")
    settings = sorted({(r["model"], r["engine_quant"]) for r in stale})
    if len(settings) > 1:
        raise FigureError(f"the staleness records span {settings}: give the records of one model and engine "
                          "precision")
    ((model, quant),) = settings
    levels = sorted({int(r["staleness"]) for r in stale})
    modes = [m for m in MODES if m in {r["mode"] for r in stale}]
    panels = (("k3", True, 1, "mismatch: engine vs trainer"),  # RLMetric.K3_ENGINE_TRAINER_MATCHED
              ("k3_policy_lag", True, 2, "policy lag: current vs behaviour"),  # RLMetric.K3_POLICY_LAG
              ("reward_final", False, 3, f"final reward (last {LAST_STEPS} steps)"))
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08, subplot_titles=[p[3] for p in panels])
    fig.update_annotations(font_size=13)
    shown: dict[int, list[float]] = {1: [], 2: [], 3: []}
    undrawn: list[tuple[str, int]] = []  # (mode, staleness) without a policy lag to draw
    seeds = 0
    for mode in modes:
        color = mode_color(mode)
        cells = [[r for r in stale if r["mode"] == mode and int(r["staleness"]) == s] for s in levels]
        seeds = max(seeds, *(len(c) for c in cells))
        lines = [(key, log, col, mode, True) for key, log, col, _ in panels]
        lines.insert(1, ("k3_engine_vs_current", True, 1, f"{mode}, engine vs current weights", False))
        for key, log, col, name, main in lines:
            spread = np.array([_spread([r.get(key) for r in c], log)[:3] for c in cells])
            n = np.array([_spread([r.get(key) for r in c], log)[3] for c in cells])
            if key == "k3_policy_lag":
                undrawn += [(mode, s) for s, c, k in zip(levels, cells, n, strict=True) if c and not k]
            shown[col] += [v for v in spread[n > 0].ravel()]
            fig.add_scatter(x=levels, y=spread[:, 0], customdata=n, name=name, legendgroup=name,
                            showlegend=col == 1, offsetgroup=mode, mode="lines+markers",
                            line={"color": color, "dash": "solid" if main else "dot", "width": 2 if main else 1.5},
                            marker={"color": color, "size": 9 if main else 7,
                                    "symbol": "circle" if main else "circle-open"},
                            error_y=_errors(spread, n), hovertemplate=_hover(name, "staleness"), row=1, col=col)
    for _key, log, col, _ in panels:
        fig.update_yaxes(type="log" if log else "linear", row=1, col=col, **axis_ticks(shown[col], log=log))
        fig.update_xaxes(title_text="staleness (updates behind)", row=1, col=col,
                         range=[min(levels) - 0.5, max(levels) + 0.5], tickmode="array", tickvals=levels,
                         ticktext=[str(s) for s in levels])
    fig.update_yaxes(title_text=f"k3 KL ({labels.unit(RLMetric.K3_KL)})", row=1, col=1)
    notes = []
    if any(s == 0 for _, s in undrawn):
        notes.append("policy lag 0 at staleness 0 (the same weights): not drawn on the log axis")
    late = sorted({f"{m} at staleness {s}" for m, s in undrawn if s != 0})
    if late:
        notes.append("no policy lag measured for " + ", ".join(late))
    spread_words = (f"median over {plural(seeds, 'seed')}, min - max as error bars" if seeds > 1
                    else "one seed per point: no spread shown")
    sub = "; ".join([f"{_short_model(model)}, engine {quant}; k3 at the behaviour weights the engine sampled with "
                     "(dotted: against the current weights), policy lag: current vs behaviour weights", spread_words,
                     *notes])
    out = finish(fig, STALENESS_SIZE, title=title or "Staleness at matched weights: engine-trainer mismatch, "
                 "policy lag and reward", subtitle=sub, scattermode="group", scattergap=0.5,
                 legend={**_LEGEND, "y": -0.2}, margin={"b": 120})
    return out.update_layout(margin_t=out.layout.margin.t + 24)  # room for the panel titles
