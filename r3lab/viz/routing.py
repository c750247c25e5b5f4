"""Figures of routes: one sample's experts per token and layer, expert load, engine-trainer disagreement per layer.

``most_flipped_sample`` and ``response_differs`` take :class:`~r3lab.routes.Routes` for the notebooks; the
computation is :mod:`r3lab.metrics`' (on arrays).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from r3lab import metrics
from r3lab.doctor import LayerLoad
from r3lab.errors import FigureError
from r3lab.routes import Routes
from r3lab.viz.style import FLIP_COLOR, MODE_COLORS, ONE_COLUMN, SOURCE_COLORS, TWO_COLUMN, finish, plural
from r3lab.viz.ticks import axis_ticks

__all__ = ["route_view_figure", "most_flipped_sample", "response_differs", "expert_load_figure",
           "expert_load_comparison_figure", "layer_disagreement_figure", "load_imbalance_figure"]


def _same_layers(a: Routes, b: Routes) -> None:
    if a.num_experts != b.num_experts or not np.array_equal(a.layer_ids, b.layer_ids):
        raise FigureError(f"cannot compare {a!r} with {b!r}: experts or layers differ")


def _same_shape(a: Routes, b: Routes) -> None:
    if (a.num_experts != b.num_experts or not np.array_equal(a.layer_ids, b.layer_ids)
            or not np.array_equal(a.cu_seqlens, b.cu_seqlens) or a.top_k != b.top_k):
        raise FigureError(f"cannot compare {a!r} with {b!r}: sequences, experts or layers differ (pass routes of the "
                          "same tokens, e.g. a run's 'engine' and 'trainer' routes of one step)")


def route_view_figure(engine: Routes, trainer: Routes | None = None, *, sample: int = 0,
                      tokens: Sequence[str] | None = None, start: int = 0, stop: int | None = None,
                      prompt_len: int | None = None) -> go.Figure:
    """One sample's routes, token by layer: each cell lists the engine's experts; cells where the trainer chose a
    different expert set are highlighted (and show both); hover shows the token text.

    Row t of a sample routes its token t (the router input at position t). ``tokens`` are the sample's token
    strings (at least one per route row; the last sampled token has no row and is ignored); ``start``/``stop``
    pick a window of rows; ``prompt_len`` draws a line where the sampled tokens begin.
    """
    eng = engine.sequence(sample)
    if trainer is not None:
        _same_shape(engine, trainer)
        own = trainer.sequence(sample)
        differs = metrics.set_differs(eng, own)
    else:
        own, differs = None, np.zeros(eng.shape[:2], dtype=bool)
    T = eng.shape[0]
    if tokens is not None and len(tokens) < T:
        raise FigureError(f"{len(tokens)} token strings for {T} route rows of sample {sample}: pass the sample's "
                          "tokens")
    stop = T if stop is None else min(int(stop), T)
    if not 0 <= start < stop:
        raise FigureError(f"rows [{start}, {stop}) are empty or outside the sample's {T} rows")
    rows = range(start, stop)
    words = [str(tokens[t]) if tokens is not None else "" for t in rows]

    def ids(a: np.ndarray) -> str:
        return " ".join(str(int(e)) for e in np.sort(a))

    text = [[ids(eng[t, j]) for t in rows] for j in range(eng.shape[1])]
    hover = [[f"token {t} {words[i]!r}<br>layer {int(g)}<br>engine: {ids(eng[t, j])}"
              + (f"<br>trainer: {ids(own[t, j])}" if own is not None else "")
              + ("<br><b>expert set differs</b>" if differs[t, j] else "")
              for i, t in enumerate(rows)] for j, g in enumerate(engine.layer_ids)]
    fig = go.Figure(go.Heatmap(
        z=differs[start:stop].T.astype(np.int8), x=[f"{t}:{w}" if w else str(t) for t, w in zip(rows, words,
                                                                                              strict=True)],
        y=[f"layer {int(g)}" for g in engine.layer_ids], text=text, texttemplate="%{text}", hovertext=hover,
        hovertemplate="%{hovertext}<extra></extra>", colorscale=[[0, "#f4f4f4"], [1, FLIP_COLOR]], zmin=0, zmax=1,
        showscale=False, xgap=1, ygap=1, textfont={"size": 9}))
    if prompt_len is not None and start < prompt_len < stop:
        # the line through the heatmap, its label above the plot area (never over a cell)
        fig.add_vline(x=prompt_len - start - 0.5, line={"color": "#333333", "dash": "dash", "width": 2})
        fig.add_annotation(x=prompt_len - start - 0.5, y=1, yref="paper", yanchor="bottom", xanchor="left",
                           text="sampled →", showarrow=False, font={"size": 12})
    n = int(differs[start:stop].sum())
    what = (f"{n} of {differs[start:stop].size} (token, layer) cells differ from the trainer "
            f"({len(rows)} tokens x {eng.shape[1]} layers)" if own is not None else "engine only")
    return finish(fig, TWO_COLUMN, title=f"sample {sample}: experts per token and layer", subtitle=what,
                  xaxis={"title": "token (position: text)", "tickangle": -60}, margin_t=90)


def most_flipped_sample(engine: Routes, trainer: Routes) -> int:
    """The sample with the most (token, layer) cells where engine and trainer chose different expert sets."""
    _same_shape(engine, trainer)
    return metrics.most_flipped_sample(engine.values, trainer.values, engine.cu_seqlens)


def response_differs(engine: Routes, trainer: Routes, response_lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """``[sampled tokens, layers]``: whether engine and trainer chose different sets at each sampled token's input
    position (routes in the engine's row convention, ``response_lengths`` sampled tokens per sample)."""
    _same_shape(engine, trainer)
    return metrics.response_differs(engine.values, trainer.values, engine.cu_seqlens, np.asarray(response_lengths))


def _load(r: Routes | LayerLoad) -> np.ndarray:
    """``[L, E]`` expert load of routes, or of a routing trace's counts (:class:`r3lab.doctor.LayerLoad`)."""
    return r.load() if isinstance(r, LayerLoad) else metrics.expert_load(r.values, r.num_experts)


def expert_load_figure(routes: Routes | LayerLoad, *, title: str = "expert load",
                       reference: Routes | None = None) -> go.Figure:
    """Heatmap of each layer's expert load (share of routed slots); with ``reference``, the difference to it.
    ``routes`` may be a routing trace's counts per layer (:class:`r3lab.doctor.LayerLoad`)."""
    load = _load(routes)
    z, scale, mid = load, "Viridis", None
    if reference is not None:
        if isinstance(routes, LayerLoad):
            raise FigureError("a reference load compares routes with routes, not a routing trace's counts")
        _same_layers(routes, reference)
        z, scale, mid = load - metrics.expert_load(reference.values, reference.num_experts), "RdBu", 0.0
    fig = go.Figure(go.Heatmap(z=z, x=list(range(routes.num_experts)), y=[f"layer {g}" for g in routes.layer_ids],
                               colorscale=scale, zmid=mid, hovertemplate="%{y}, expert %{x}: %{z:.3f}<extra></extra>"))
    vio = metrics.max_violation(load)
    fig.data[0].colorbar = {"title": {"text": "share of slots" if reference is None else "difference", "side": "right"},
                            **axis_ticks(np.ravel(z), percent=True, set_range=False)}
    return finish(fig, ONE_COLUMN, title=title, subtitle=f"max_vio per layer {vio.min():.2f} - {vio.max():.2f}",
                  xaxis_title="expert")


def expert_load_comparison_figure(engine: Routes, trainer: Routes, *, names: tuple[str, str] = ("engine", "trainer"),
                                  title: str = "expert load per layer") -> go.Figure:
    """Three heatmaps (layer x expert): the engine's load, the trainer's load, and trainer minus engine."""
    _same_layers(engine, trainer)
    a = metrics.expert_load(engine.values, engine.num_experts)
    b = metrics.expert_load(trainer.values, trainer.num_experts)
    y = [f"layer {int(g)}" for g in engine.layer_ids]
    x = list(range(engine.num_experts))
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, horizontal_spacing=0.11,
                        subplot_titles=(names[0], names[1], f"{names[1]} - {names[0]}"))
    top = float(max(a.max(), b.max()))
    for col, z in ((1, a), (2, b)):
        fig.add_heatmap(z=z, x=x, y=y, colorscale="Viridis", zmin=0, zmax=top, row=1, col=col, showscale=col == 2,
                        colorbar={"x": 0.64, "xanchor": "left", "len": 0.8, "thickness": 12,
                                  **axis_ticks([0.0, top], percent=True, set_range=False)},
                        hovertemplate="%{y}, expert %{x}: %{z:.2%}<extra></extra>")
    d = b - a
    lim = float(np.abs(d).max()) or 1e-9
    fig.add_heatmap(z=d, x=x, y=y, colorscale="RdBu", zmid=0, zmin=-lim, zmax=lim, row=1, col=3,
                    colorbar={"x": 1.0, "xanchor": "left", "len": 0.8, "thickness": 12,
                              **axis_ticks([-lim, lim], percent=True, set_range=False)},
                    hovertemplate="%{y}, expert %{x}: %{z:+.2%}<extra></extra>")
    fig.update_xaxes(title_text="expert")
    return finish(fig, TWO_COLUMN, title=title, subtitle="share of routed slots per layer and expert; colour bars in %",
                  margin_r=70)


def layer_disagreement_figure(engine: Routes, trainer: Routes, *, title: str | None = None) -> go.Figure:
    """Per layer: share of (token) routers where engine and trainer chose a different expert set, and the mean
    share of experts the two do not share (1 - overlap / k)."""
    _same_shape(engine, trainer)
    agree = metrics.route_agreement(engine.values, trainer.values, engine.num_experts, engine.layer_ids)
    names = [f"layer {int(g)}" for g in engine.layer_ids]
    differ = [1 - agree["per_layer_agreement"][int(g)] for g in engine.layer_ids]
    apart = [1 - agree["per_layer_overlap"][int(g)] for g in engine.layer_ids]
    fig = go.Figure()
    fig.add_bar(x=names, y=differ, name="expert set differs", marker_color="#ff7f0e")
    fig.add_bar(x=names, y=apart, name="experts not shared (of k)", marker_color="#9467bd")
    fig.update_yaxes(title_text="share of routed positions (%)", **axis_ticks(differ + apart, percent=True,
                                                                                include_zero=True))
    n = agree["tokens"]
    return finish(fig, ONE_COLUMN, barmode="group", title=title or "engine vs trainer routing per layer",
                  subtitle=f"{plural(n, 'routed position')} (prompt and sampled tokens, one router input each); "
                           f"{agree['token_disagreement']:.1%} differ in some layer")


def load_imbalance_figure(routes: Mapping[str, Routes | LayerLoad], *, title: str = "load imbalance per layer"
                          ) -> go.Figure:
    """verl's ``max_vio`` per layer (max over mean expert load, minus 1) for each named set of routes (engine and
    trainer in :data:`SOURCE_COLORS`, a replay mode in its own colour)."""
    if not routes:
        raise FigureError("no routes to plot")
    fig = go.Figure()
    vios = []
    for name, r in routes.items():
        vio = metrics.max_violation(_load(r))
        vios.append(vio)
        fig.add_scatter(x=[int(g) for g in r.layer_ids], y=vio, mode="lines+markers", name=name,
                        line={"color": SOURCE_COLORS.get(name) or MODE_COLORS.get(name, "#555555")})
    fig.update_xaxes(title_text="layer", **axis_ticks(np.concatenate([r.layer_ids for r in routes.values()]),
                                                      integer=True))
    fig.update_yaxes(title_text="max_vio (max load / mean load - 1)", **axis_ticks(np.concatenate(vios)))
    return finish(fig, ONE_COLUMN, title=title)
