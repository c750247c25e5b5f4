"""Every figure a run's fields allow (own or imported), through the public ``r3lab.viz`` builders; in place of each
figure a run lacks a field for, a :class:`NotAvailable` that says which field and what needs it (notebook 06)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from r3lab.doctor import HEALTH_NAMES, LOGP_TRAIN_COLUMNS, facts, health_series
from r3lab.errors import R3LabError
from r3lab.runs import Run, load

__all__ = ["NotAvailable", "health_figure", "run_figures", "drawn"]


class NotAvailable:
    """In place of a figure a run's fields do not allow: says which field is missing and what needs it."""

    def __init__(self, message: str):
        self.message = message

    def __repr__(self) -> str:
        return self.message

    def _repr_markdown_(self) -> str:
        return f"*{self.message}*"


def health_figure(run: Run | str | os.PathLike):
    """The doctor's mismatch health per step: k3, F(2), IS ESS and TIS clip fraction (one panel each)."""
    from plotly.subplots import make_subplots

    r = run if isinstance(run, Run) else load(run)
    steps, ser, n = health_series(r)
    if not steps:
        raise R3LabError(f"run {r.name!r} has no engine and trainer log-probs per step")
    keys = ["k3_kl", "extreme_frac_tau2", "is_eff_sample_size", "tis_clipfrac"]
    fig = make_subplots(rows=1, cols=4, subplot_titles=[HEALTH_NAMES[k] for k in keys])
    for i, k in enumerate(keys, 1):
        fig.add_scatter(x=steps, y=ser[k], mode="lines+markers", name=HEALTH_NAMES[k], row=1, col=i, showlegend=False)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_layout(template="r3lab", title=f"{r.name}: mismatch health per step ({n} tokens)", width=1100,
                      height=360)
    return fig


def run_figures(run: Run | str | os.PathLike, *, step: int | None = None) -> dict[str, Any]:
    """Every figure the run's fields allow (``r3lab.viz`` builders), keyed by name; a :class:`NotAvailable` in place
    of each one the run lacks a field for. ``step``: the step whose routes and tokens to draw (default: the last
    step with engine routes, else the last token table)."""
    from r3lab import viz

    r = run if isinstance(run, Run) else load(run)
    f = facts(r)
    out: dict[str, Any] = {}
    s_routes = step if step is not None else (f.engine_steps[-1] if f.engine_steps else None)
    eng = r.routes(s_routes, "engine") if s_routes in f.engine_steps else None
    tr = r.routes(s_routes, "trainer") if s_routes is not None and s_routes in f.trainer_steps else None
    s_tok = s_routes if s_routes in f.token_steps else (f.token_steps[-1] if f.token_steps else None)
    tok = r.tokens([s_tok]) if s_tok is not None else None
    col = next((c for c in LOGP_TRAIN_COLUMNS if tok is not None and c in tok), None)
    has_logp = tok is not None and col is not None and "logp_infer" in tok
    no_eng = NotAvailable("this run has no engine routes: the expert-load and route figures need them")
    no_tr = "this run has no trainer routes: the {} needs them"
    no_lp = NotAvailable("this run has no engine and trainer log-probs per token: the drift figures need them")
    try:
        out["health"] = health_figure(r)
    except R3LabError as e:
        out["health"] = NotAvailable(f"no mismatch health per step: {e}")
    nz = eng.take(np.flatnonzero(eng.lengths > 0)) if eng is not None else None
    out["expert_load"] = viz.expert_load_figure(nz, title=f"engine expert load, step {s_routes}") if nz else no_eng
    out["load_imbalance"] = (viz.load_imbalance_figure({"engine": nz, **({"trainer": tr} if tr is not None else {})})
                             if nz else no_eng)
    out["layer_disagreement"] = (viz.layer_disagreement_figure(eng, tr) if tr is not None
                                 else NotAvailable(no_tr.format("per-layer disagreement")))
    if has_logp:
        m = tok["loss_mask"].to_numpy() > 0 if "loss_mask" in tok else np.ones(len(tok), bool)
        li = tok["logp_infer"].to_numpy()[m]
        lt = {"R3" if c == "logp_r3" else "trainer" if c != "logp_none" else "none": tok[c].to_numpy()[m]
              for c in (col, "logp_r3") if c in tok}
        out["delta_histogram"] = viz.delta_histogram_figure(li, lt)
        out["extreme_fraction"] = viz.extreme_fraction_figure(li, lt)
        out["prob_density"] = viz.prob_density_figure(li, lt)
    else:
        out["delta_histogram"] = out["extreme_fraction"] = out["prob_density"] = no_lp
    differs = None
    if tr is not None and tok is not None and s_tok == s_routes:
        R = tok.groupby("sample").size().reindex(range(len(eng)), fill_value=0).to_numpy()
        if (R >= 1).all():
            differs = viz.response_differs(eng, tr, R)
    if differs is not None and has_logp:
        out["flip_split"] = viz.flip_split_figure(li, lt, differs.any(axis=1)[m])
        out["layer_drift"] = viz.layer_drift_figure(differs[m], li, lt, layer_ids=eng.layer_ids)
    else:
        why = "trainer routes" if tr is None else "log-probs on the routed step"
        out["flip_split"] = NotAvailable(f"this run has no {why}: the flipped-vs-agreeing split needs them")
        out["layer_drift"] = NotAvailable(f"this run has no {why}: the per-layer drift split needs them")
    if nz is not None:
        i = viz.most_flipped_sample(eng, tr) if tr is not None else int(np.argmax(eng.lengths))
        out["route_view"] = viz.route_view_figure(eng, tr, sample=i, stop=min(int(eng.lengths[i]), 48))
    else:
        out["route_view"] = no_eng
    return out




def drawn(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures of :func:`run_figures` that were drawn (for ``viz.export_figures``)."""
    return {k: v for k, v in figures.items() if not isinstance(v, NotAvailable)}
