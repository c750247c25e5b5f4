"""Every figure a run's fields allow (own or imported), through the ``r3lab.viz`` builders; in place of each figure a
run lacks a field for, a :class:`NotAvailable` that says which field and what needs it (notebooks 02-04 and 06).

The notebooks' cells stay logic-free on imported runs: :func:`in_place` passes a :class:`NotAvailable` on instead of
drawing, and :func:`routes_or_note`, :func:`of_kind`, :func:`column_or_note` and :func:`rl_logprobs_or_note` hand one
out where an imported run lacks a field. Runs made by r3lab go to the builders as they are, which raise on a
missing field."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from r3lab.doctor import HEALTH_NAMES, LOGP_TRAIN_COLUMNS, LayerLoad, facts, health_series, trace_load
from r3lab.errors import FigureError, R3LabError
from r3lab.runs import IMPORT_KIND, Run, load, rl_token_logprobs
from r3lab.runs.format import CAPTURE_KIND
from r3lab.vocabulary import RunKind

__all__: list[str] = []  # NotAvailable, health_figure, run_figures, drawn, in_place, routes_or_note, of_kind,
# expert_load, mismatch_logprobs, noise_floors, column_or_note, rl_logprobs_or_note: exported by the facade, r3lab.viz


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

    from r3lab.viz.style import finish
    from r3lab.viz.ticks import axis_ticks

    r = run if isinstance(run, Run) else load(run)
    steps, ser, n = health_series(r)
    if not steps:
        raise FigureError(f"run {r.name!r} has no engine and trainer log-probs per step")
    keys = ["k3_kl", "extreme_frac_tau2", "is_eff_sample_size", "tis_clipfrac"]
    fig = make_subplots(rows=1, cols=4, subplot_titles=[HEALTH_NAMES[k] for k in keys])
    for i, k in enumerate(keys, 1):
        fig.add_scatter(x=steps, y=ser[k], mode="lines+markers", name=HEALTH_NAMES[k], row=1, col=i, showlegend=False)
    # r3lab's log ticks: plotly's own label the minor ticks with their digit only, the same digit in every decade
    fig.update_yaxes(type="log", **axis_ticks(ser["k3_kl"], log=True, target=4), row=1, col=1)
    # in the paper template at a paper size; a notebook shows it at the output's width (viz.LabFigure)
    return finish(fig, {"width": 1100, "height": 380}, title=f"{r.name}: mismatch health per step ({n} tokens)")


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
    trace = trace_load(r) if r.kind == IMPORT_KIND and nz is None else None
    if trace is not None and trace.per_layer().num_layers:  # a routing trace: the trainer's counts, every step
        ll = trace.per_layer()
        out["expert_load"] = viz.expert_load_figure(ll, title="trainer expert load (routing trace, all steps; padding "
                                                    "rows included)")
        out["load_imbalance"] = viz.load_imbalance_figure({"trainer": ll})
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



def drawn(figures: Mapping[str, Any]) -> dict[str, Any]:
    """The entries that are not :class:`NotAvailable`: the figures of :func:`run_figures` that were drawn (for
    ``viz.export_figures``), or the routes a run has of ``{"engine": ..., "trainer": ...}``."""
    return {k: v for k, v in figures.items() if not isinstance(v, NotAvailable)}


def _first_missing(values: Any) -> NotAvailable | None:
    for v in values:
        if isinstance(v, NotAvailable):
            return v
        if isinstance(v, Mapping):
            inner = _first_missing(v.values())
            if inner is not None:
                return inner
    return None


def in_place(build: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``build(*args, **kwargs)``, or the first :class:`NotAvailable` among the arguments (also as a mapping's
    value): the note of the field the run lacks, shown where the figure would be."""
    missing = _first_missing([*args, *kwargs.values()])
    return missing if missing is not None else build(*args, **kwargs)


_PARTIAL = {IMPORT_KIND: "imported run", CAPTURE_KIND: "engine-only capture run"}  # runs that may lack a field


def routes_or_note(run: Run, step: int, what: str) -> Any:
    """The run's ``what`` routes (``"engine"``, ``"trainer"``) at ``step``; for an imported or capture run without
    them, a :class:`NotAvailable` naming them (a drift or RL run that lacks them raises, as :meth:`Run.routes`)."""
    trace = trace_load(run) if run.kind == IMPORT_KIND else None
    if trace is not None:  # a routing trace: the trainer's expert counts per layer, no routes
        if what != "trainer":
            return NotAvailable(f"imported routing trace {run.name!r} has no {what} routes (only the trainer's "
                                "expert counts per layer): the figures comparing routes need them")
        if step not in trace.steps:
            return NotAvailable(f"imported routing trace {run.name!r} has no step {step} (traced: {trace.steps})")
        return trace.per_layer([step])
    if run.kind in _PARTIAL and step not in run.route_steps(what):
        return NotAvailable(f"{_PARTIAL[run.kind]} {run.name!r} has no {what} routes at step {step} (stored: "
                            f"{run.route_steps(what)}): the figures comparing {what} routes need them")
    return run.routes(step, what)


def expert_load(engine: Any, trainer: Any, *, title: str = "expert load") -> Any:
    """Engine vs trainer expert load per layer (``viz.expert_load_comparison_figure``); with no trainer routes (a
    :class:`NotAvailable`: an imported or capture run), the engine's load alone (``viz.expert_load_figure``)."""
    from r3lab import viz

    if isinstance(engine, NotAvailable) and isinstance(trainer, LayerLoad):  # a routing trace: the trainer only
        return viz.expert_load_figure(trainer, title=f"{title} (trainer routing trace: expert counts, padding rows "
                                      "included; no engine routes or samples)")
    if isinstance(engine, NotAvailable):
        return engine
    if isinstance(trainer, NotAvailable):
        return viz.expert_load_figure(engine, title=f"{title} (engine only: the run has no trainer routes)")
    return viz.expert_load_comparison_figure(engine, trainer, title=title)


_KIND_NEEDS = {RunKind.DRIFT: "the drift experiment's per-cell k3 of none and R3 (r3lab drift)",
               RunKind.RL: "a replay mode per run (r3lab RL runs); the imported run's mismatch per step is in "
                           "notebook 06"}


def of_kind(runs: Run | Sequence[Run], kind: str) -> Any:
    """``runs`` (one run or several) when none is imported; else a :class:`NotAvailable` saying what the
    ``kind`` figure needs that an imported run lacks. A run of another kind made by r3lab passes through, so the
    figure itself raises on it."""
    some = [runs] if isinstance(runs, Run) else list(runs)
    imported = [r.name for r in some if r.kind in _PARTIAL]
    if imported:
        return NotAvailable(f"imported or capture run(s) {imported} are not {kind} runs: this figure needs "
                            f"{_KIND_NEEDS[kind]}")
    return runs


_TRAIN_LABELS = {"logp_none": "none", "logp_r3": "R3"}


def mismatch_logprobs(tokens: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(logp_infer, {label: trainer log-probs})`` of a token table: a drift run's ``none`` and ``R3`` scores,
    else an imported run's trainer scores (``logp_train``, label ``trainer``)."""
    if "logp_infer" not in tokens:
        raise FigureError(f"the token table has no engine log-probs (logp_infer); columns: {list(tokens.columns)}")
    if all(c in tokens for c in _TRAIN_LABELS):
        return tokens["logp_infer"].to_numpy(), {lab: tokens[c].to_numpy() for c, lab in _TRAIN_LABELS.items()}
    col = next((c for c in LOGP_TRAIN_COLUMNS if c in tokens), None)
    if col is None:
        raise FigureError(f"the token table has no trainer log-probs {LOGP_TRAIN_COLUMNS}; columns: "
                          f"{list(tokens.columns)}")
    return tokens["logp_infer"].to_numpy(), {"trainer": tokens[col].to_numpy()}


_FLOORS = {"engine vs engine": ("logp_engine_again", "logp_infer"),
           "trainer vs trainer": ("logp_none_batched", "logp_none")}


def noise_floors(tokens: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The noise floors a token table holds (a drift run's: the engine and the trainer each against itself); none
    for an imported run, whose F(τ) is then drawn without them."""
    return {name: (tokens[a].to_numpy(), tokens[b].to_numpy()) for name, (a, b) in _FLOORS.items()
            if a in tokens and b in tokens}


def column_or_note(tokens: Any, name: str, needs: str) -> Any:
    """The token table's column ``name``, or a :class:`NotAvailable` saying that the run lacks it and ``needs``
    it (e.g. ``flipped``: an imported run without trainer routes marks no route-flipped tokens)."""
    if name in tokens:
        return tokens[name].to_numpy()
    return NotAvailable(f"this run's tokens have no {name!r} column: {needs}")


def rl_logprobs_or_note(runs: Sequence[Run], step: int | None = None) -> Any:
    """:func:`r3lab.runs.rl_token_logprobs` of r3lab RL runs, ``(logps, flipped)``; for imported runs a pair of
    :class:`NotAvailable` (they carry no replay mode to pool by)."""
    checked = of_kind(runs, RunKind.RL)
    if isinstance(checked, NotAvailable):
        return checked, checked
    return rl_token_logprobs(checked, step)
