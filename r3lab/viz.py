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

from r3lab import metrics
from r3lab.errors import R3LabError
from r3lab.routes import Routes
from r3lab.runs import Run

__all__ = ["MODE_COLORS", "ONE_COLUMN", "TWO_COLUMN", "EXPORT_FORMATS", "find_chromium", "export", "transport_figure",
           "rl_curves_figure", "expert_load_figure", "drift_figure"]

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
        if r.kind != "rl":
            raise R3LabError(f"run {r.name!r} is a {r.kind!r} run, not an RL run")
        vals = np.array([np.nan if s.get(metric) is None else s[metric] for s in r.step_records], dtype=np.float64)
        if np.isnan(vals).all():
            raise R3LabError(f"run {r.name!r} has no values of {metric!r}")
        by_mode.setdefault(r.config["mode"], []).append(vals)
    if not by_mode:
        raise R3LabError("no runs to plot")
    fig = go.Figure()
    for mode in sorted(by_mode, key=lambda m: list(MODE_COLORS).index(m) if m in MODE_COLORS else 99):
        n = min(len(v) for v in by_mode[mode])
        stack = np.stack([v[:n] for v in by_mode[mode]])
        x = np.arange(n)
        color = MODE_COLORS.get(mode, "#2ca02c")
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
        if reference.num_experts != routes.num_experts or not np.array_equal(reference.layer_ids, routes.layer_ids):
            raise R3LabError(f"cannot compare {routes!r} with {reference!r}: experts or layers differ")
        z, scale, mid = load - metrics.expert_load(reference.values, reference.num_experts), "RdBu", 0.0
    fig = go.Figure(go.Heatmap(z=z, x=list(range(routes.num_experts)), y=[f"layer {g}" for g in routes.layer_ids],
                               colorscale=scale, zmid=mid, hovertemplate="%{y}, expert %{x}: %{z:.3f}<extra></extra>"))
    vio = metrics.max_violation(load)
    fig.update_layout(template=TEMPLATE, title=f"{title} (max_vio per layer {vio.min():.2f} - {vio.max():.2f})",
                      xaxis_title="expert", **ONE_COLUMN)
    return fig


def drift_figure(run: Run) -> go.Figure:
    """The drift experiment: k3 KL without replay and with R3, per (model, trainer), median over seeds with
    min - max error bars, overall and on route-flipped tokens."""
    if run.kind != "drift":
        raise R3LabError(f"run {run.name!r} is a {run.kind!r} run, not a drift run")
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in run.step_records:
        cells.setdefault((s["model"], s["trainer_dtype"]), []).append(s)
    labels = [f"{m}<br>{d}" for m, d in cells]
    fig = go.Figure()
    for key, name, color in (("k3_none", "none", MODE_COLORS["none"]), ("k3_r3", "R3", MODE_COLORS["R3"]),
                             ("k3_flipped_none", "none, route-flipped tokens", "#bcbcbc"),
                             ("k3_flipped_r3", "R3, route-flipped tokens", "#f4a3a3")):
        vals = [np.array([c.get(key, np.nan) for c in cs], dtype=np.float64) for cs in cells.values()]
        med = np.array([np.nanmedian(v) for v in vals])
        fig.add_bar(x=labels, y=med, name=name, marker_color=color,
                    error_y={"type": "data", "symmetric": False,
                             "array": [np.nanmax(v) - m for v, m in zip(vals, med, strict=True)],
                             "arrayminus": [m - np.nanmin(v) for v, m in zip(vals, med, strict=True)]})
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
    cell = next((i for i, s in enumerate(drift.step_records)
                 if s["model"] == "tiny-glm4-moe" and s["trainer_dtype"] == "bfloat16"), None)
    if cell is None:
        raise R3LabError(f"{drift.path} has no tiny-glm4-moe bf16 cell for the expert-load figure")
    step = drift.step_records[cell]["step"]
    figures["expert_load_glm4"] = expert_load_figure(
        drift.routes(step, "engine"), title=f"tiny-glm4-moe, engine routes (seed {drift.step_records[cell]['seed']})")
    for model in ("tiny-qwen3-moe", "tiny-glm4-moe"):
        runs = [r for _, r in rl_found if r.name.startswith(f"{model}-default-")]
        if not runs:
            raise R3LabError(f"no reference RL runs of {model} in {results / 'rl'}: `python bench/bench_rl.py`")
        figures[f"rl_k3_{model.split('-')[1]}"] = rl_curves_figure(
            runs, title=f"{model}: train-inference k3 KL per RL step")
    written: list[Path] = []
    for name, fig in figures.items():
        written += export(fig, out / name, formats=formats)
    return written
