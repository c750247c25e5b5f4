"""Figures of log-prob drift per sampled token: trainer vs engine density, extreme tokens F(tau), the delta
histogram, and drift split by routing (route-flipped vs agreeing tokens, per layer).

Each takes the engine's log-probs and ``{mode: trainer log-probs}`` (or ``{mode: (trainer, engine)}`` pairs
when the modes scored different samples, as RL runs do: :func:`r3lab.runs.rl_token_logprobs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from r3lab import metrics
from r3lab.errors import FigureError
from r3lab.viz.style import NOT_DRAWN, ONE_COLUMN, TWO_COLUMN, finish, mode_color
from r3lab.viz.ticks import axis_ticks, tick_labels, tick_values

__all__ = ["prob_density_figure", "extreme_fraction_figure", "delta_histogram_figure", "flip_split_figure",
           "layer_drift_figure"]


def _modes(logp_train: Mapping[str, Any], logp_infer: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{mode: (trainer, engine)}`` log-probs: each value is the trainer's array (against the shared
    ``logp_infer``) or its own ``(logp_train, logp_infer)`` pair (modes scored on different samples, e.g. RL runs)."""
    if not logp_train:
        raise FigureError("no trainer log-probs to plot (pass {mode: logp_train})")
    out = {}
    for mode, v in logp_train.items():
        if isinstance(v, tuple):
            if len(v) != 2:
                raise FigureError(f"{mode!r}: pass (logp_train, logp_infer), got a tuple of {len(v)}")
            v, inf = v
        elif logp_infer is None:
            raise FigureError(f"{mode!r} has no engine log-probs: pass logp_infer or a (logp_train, logp_infer) pair")
        else:
            inf = logp_infer
        a, b = np.asarray(v, dtype=np.float64), np.asarray(inf, dtype=np.float64)
        if a.shape != b.shape or a.ndim != 1 or a.size == 0:
            raise FigureError(f"trainer log-probs of {mode!r} have shape {a.shape}; the engine's have {b.shape}")
        out[mode] = (a, b)
    return out


def prob_density_figure(logp_infer: Any, logp_train: Mapping[str, Any], *, bins: int = 60) -> go.Figure:
    """Trainer vs engine probability of every sampled token as a density (2-D histogram, log counts) per mode,
    against the diagonal."""
    modes = _modes(logp_train, logp_infer)
    fig = make_subplots(rows=1, cols=len(modes), shared_yaxes=True, subplot_titles=list(modes))
    edges = np.linspace(0.0, 1.0, bins + 1)
    hists = {m: np.histogram2d(np.exp(inf), np.exp(lt), bins=[edges, edges])[0] for m, (lt, inf) in modes.items()}
    top = max(float(h.max()) for h in hists.values())
    cb = tick_values(1.0, max(top, 2.0), log=True, integer=True)  # colour bar ticks in tokens, drawn on log10
    colorbar = {"title": {"text": "tokens", "side": "right"}, "tickmode": "array", "tickvals": np.log10(cb).tolist(),
                "ticktext": tick_labels(cb, log=True), "thickness": 14, "len": 0.9}
    for i, (mode, h) in enumerate(hists.items(), 1):
        mids = (edges[:-1] + edges[1:]) / 2
        fig.add_heatmap(x=mids, y=mids, z=np.where(h.T > 0, np.log10(np.maximum(h.T, 1)), np.nan),
                        customdata=h.T, colorscale="Viridis", showscale=i == len(modes), row=1, col=i,
                        zmin=0, zmax=float(np.log10(max(top, 2.0))), colorbar=colorbar, name=mode,
                        hovertemplate="engine %{x:.2f}, trainer %{y:.2f}: %{customdata:.0f} tokens<extra></extra>")
        fig.add_scatter(x=[0, 1], y=[0, 1], mode="lines", line={"color": mode_color(mode), "dash": "dash",
                        "width": 1}, name=f"{mode}: y = x", showlegend=False, row=1, col=i)
        fig.update_xaxes(title_text="engine probability", range=[0, 1], row=1, col=i)
    fig.update_yaxes(title_text="trainer probability", range=[0, 1], row=1, col=1)
    n = "/".join(str(k) for k in sorted({inf.size for _, inf in modes.values()}))
    return finish(fig, TWO_COLUMN, title="trainer vs engine probability of each sampled token",
                  subtitle=f"{n} sampled tokens per mode; colour: tokens per cell (log scale); dashed: y = x")


def extreme_fraction_figure(logp_infer: Any, logp_train: Mapping[str, Any], *,
                            floors: Mapping[str, tuple[Any, Any]] | None = None,
                            taus: Any = None) -> go.Figure:
    """F(tau) over tau (share of tokens whose trainer/engine probability ratio is beyond tau either way) per mode,
    and the noise floors (``floors``: name -> (scores, reference scores) of a scorer against itself) dashed.

    The x axis is ``tau - 1`` on a log scale, so small drifts (tau near 1) and the field's tau = 1.5 and 2 both
    show; ``taus`` default: from 1 + 1e-4 to just past the largest ratio seen.
    """
    modes = _modes(logp_train, logp_infer)
    if taus is None:
        top = max(float(np.abs(lt - inf).max()) for lt, inf in modes.values())
        t = 1.0 + np.geomspace(1e-4, max(np.expm1(top) * 1.2, 2e-3), 160)
    else:
        t = np.asarray(taus, dtype=np.float64)
    fig = go.Figure()
    shown = []
    for mode, (lt, inf) in modes.items():
        y = metrics.extreme_fraction_curve(lt, inf, t)
        shown.append(y)
        fig.add_scatter(x=t - 1, y=y, mode="lines", name=mode,
                        customdata=t, hovertemplate=f"{mode}<br>τ = %{{customdata:.4f}}: %{{y:.3g}}<extra></extra>",
                        line={"color": mode_color(mode), "width": 2})
    for i, (name, (a, b)) in enumerate((floors or {}).items()):
        y = metrics.extreme_fraction_curve(a, b, t)
        shown.append(y)
        label = f"floor: {name}"
        if not (np.asarray(y) > 0).any():  # the floor is exactly zero: nothing to draw on the log axis, say so
            label = f"floor: {name} (0 at every τ: {NOT_DRAWN} on the log axis)"
        fig.add_scatter(x=t - 1, y=y, mode="lines", name=label,
                        customdata=t, hovertemplate=f"floor: {name}<br>τ = %{{customdata:.4f}}: %{{y:.3g}}"
                        "<extra></extra>",
                        line={"color": ["#2ca02c", "#9467bd", "#8c564b"][i % 3], "dash": "dash", "width": 1.5})
    fig.update_xaxes(title_text="τ - 1 (τ: probability ratio)", type="log", **axis_ticks(t - 1, log=True))
    fig.update_yaxes(title_text="tokens with max(ρ, 1/ρ) > τ (%)", type="log",
                     **axis_ticks(np.concatenate(shown), log=True, percent=True))
    return finish(fig, ONE_COLUMN, title="extreme tokens F(τ)", subtitle="dashed: noise floors" if floors else None)


def delta_histogram_figure(logp_infer: Any, logp_train: Mapping[str, Any], *, bins: int = 80) -> go.Figure:
    """Histogram of Δ log p = trainer - engine per mode, on shared bins, log counts."""
    deltas = {m: lt - inf for m, (lt, inf) in _modes(logp_train, logp_infer).items()}
    lim = max(float(np.abs(d).max()) for d in deltas.values()) or 1e-6
    edges = np.linspace(-lim, lim, bins + 1)
    fig = go.Figure()
    counts_all = []
    for mode, d in deltas.items():
        counts, _ = np.histogram(d, bins=edges)
        counts_all.append(counts)
        # a step outline, not bars: counts are on a log axis, where a bar's length would mean nothing
        fig.add_scatter(x=np.repeat(edges, 2)[1:-1], y=np.repeat(np.where(counts > 0, counts, np.nan), 2),
                        mode="lines", name=mode, line={"color": mode_color(mode), "width": 1.5}, connectgaps=False,
                        customdata=np.repeat(counts, 2),
                        hovertemplate=f"{mode}<br>Δ %{{x:.4f}}: %{{y}} tokens<extra></extra>")
    fig.update_yaxes(title_text="tokens per bin", type="log", **axis_ticks(np.concatenate(counts_all), log=True))
    fig.update_xaxes(title_text="Δ log p (nats)", **axis_ticks(edges))
    n = "/".join(str(d.size) for d in deltas.values())
    return finish(fig, ONE_COLUMN, title="Δ log p (trainer - engine)", subtitle=f"{n} sampled tokens, {bins} bins")


def _flip_split_k3(logp_train: np.ndarray, logp_infer: np.ndarray,
                   flipped: np.ndarray) -> dict[str, tuple[int, float | None]]:
    """``{group: (tokens, k3 KL)}`` of the route-flipped, the agreeing and all tokens (k3 None where none are).

    viz's only flipped/agreeing split; r3lab.metrics is to have one function for it, to be used here instead.
    """
    groups = {"route-flipped": flipped, "agreeing": ~flipped, "all": np.ones_like(flipped)}
    return {g: (int(m.sum()), metrics.k3_kl(logp_train[m], logp_infer[m]) if m.any() else None)
            for g, m in groups.items()}


def flip_split_figure(logp_infer: Any, logp_train: Mapping[str, Any], flipped: Any) -> go.Figure:
    """k3 KL per mode on route-flipped and on agreeing tokens (a token is route-flipped when engine and trainer
    chose a different expert set in some layer at its input position). ``flipped``: one array for all modes, or
    ``{mode: array}`` when the modes scored different samples."""
    modes = _modes(logp_train, logp_infer)
    fig = go.Figure()
    shown: list[float | None] = []
    splits = {}
    for mode, (lt, inf) in modes.items():
        f = np.asarray(flipped[mode] if isinstance(flipped, Mapping) else flipped, dtype=bool)
        if f.shape != inf.shape:
            raise FigureError(f"flipped has shape {f.shape}; the log-probs of {mode!r} have {inf.shape}")
        split = splits[mode] = _flip_split_k3(lt, inf, f)
        y = [k3 for _, k3 in split.values()]
        shown += y
        fig.add_scatter(x=list(split), y=y,
                        name=mode, mode="markers", offsetgroup=mode, marker={"color": mode_color(mode), "size": 11},
                        customdata=[n for n, _ in split.values()],
                        hovertemplate="%{x}: %{y:.3g} (%{customdata} tokens)<extra></extra>")
    fig.update_yaxes(title_text="k3 KL (nats/token)", type="log", **axis_ticks(shown, log=True))
    counts = "; ".join(f"{m}: " + ", ".join(f"{n} {g}" for g, (n, _) in split.items()) for m, split in splits.items())
    return finish(fig, ONE_COLUMN, title="drift on route-flipped vs agreeing tokens",
                  subtitle=f"sampled tokens {counts}", scattermode="group")


def layer_drift_figure(differs: Any, logp_infer: Any, logp_train: Mapping[str, Any], *,
                       layer_ids: Sequence[int] | None = None) -> go.Figure:
    """Per-layer disagreement against drift: for each layer, the share of sampled tokens routed differently there
    (bars) and the k3 KL of those tokens per mode (markers), beside the k3 of the tokens that agreed there."""
    modes = _modes(logp_train, logp_infer)
    f = np.asarray(differs, dtype=bool)
    lids = list(range(f.shape[1])) if layer_ids is None else [int(g) for g in layer_ids]
    if f.ndim != 2 or len(lids) != f.shape[1]:
        raise FigureError(f"differs must be [tokens, layers] with {len(lids)} layers, got shape {f.shape}")
    names = [f"layer {g}" for g in lids]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    share = f.mean(axis=0)
    fig.add_bar(x=names, y=share, name="tokens flipped here (left axis)", marker_color="#dddddd",
                secondary_y=False)
    k3s = []
    for mode, (lt, inf) in modes.items():
        d = metrics.per_layer_flip_drift(f, lt, inf)
        c = mode_color(mode)
        k3s += [*d["k3_flipped"], *d["k3_agreeing"]]
        fig.add_scatter(x=names, y=d["k3_flipped"], mode="markers+lines", name=f"{mode}: k3 of flipped",
                        marker={"color": c, "size": 9}, line={"color": c}, secondary_y=True)
        fig.add_scatter(x=names, y=d["k3_agreeing"], mode="markers+lines", name=f"{mode}: k3 of agreeing",
                        marker={"color": c, "symbol": "circle-open"}, line={"color": c, "dash": "dot"},
                        secondary_y=True)
    fig.update_yaxes(title_text="tokens flipped in the layer (%)", secondary_y=False,
                     **axis_ticks(share, percent=True, include_zero=True))
    fig.update_yaxes(title_text="k3 KL (nats/token)", type="log", secondary_y=True, showgrid=False,
                     **axis_ticks(k3s, log=True))
    return finish(fig, TWO_COLUMN, title="per-layer routing disagreement against drift",
                  subtitle=f"{f.shape[0]} sampled tokens; bars: share routed differently in the layer (left axis); "
                           "markers: k3 KL of those tokens and of the agreeing ones (right axis)")
