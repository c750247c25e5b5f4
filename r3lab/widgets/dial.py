"""The mismatch dial: pick a point of the phase diagram, run it, and see it land beside the committed runs.

Controls: model, engine precision (the dial, ``engine_quant``: none down to int4, a simulation of weight
quantization), objective (a key of :data:`r3lab.runs.phase.PHASE_OBJECTIVES`: none, R2, R3, R3W, none+TIS, R3+TIS,
GSPO), seed and RL steps. **Start** runs ``r3lab rl`` in a child process with exactly that config
(:func:`start_rl`, every field spelled out by :meth:`RLConfig.to_cli_args`), follows it live (the live figures of
:mod:`.live`), and when it finishes puts its :func:`~r3lab.runs.phase.phase_record` on the phase diagram as a star
beside the committed records.
"""

from __future__ import annotations

import dataclasses
import html
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from r3lab.config import ENGINE_QUANTS, RLConfig
from r3lab.errors import ConfigError, FigureError
from r3lab.labels import label
from r3lab.paths import MODELS, runs_dir
from r3lab.runs import RunFollower, load
from r3lab.runs.phase import PHASE_OBJECTIVES, phase_objective, phase_record
from r3lab.viz import phase_figure
from r3lab.vocabulary import RLMetric
from r3lab.widgets.controls import CONTROL, LABEL_WIDTH, field_help, show_errors
from r3lab.widgets.jobs import RLJob, rl_config, start_rl, stop_job
from r3lab.widgets.live import LiveFigure, set_steps, set_traces, status_html, value

_STEPS_TOP = 200  # the steps slider's upper end
_LIVE_METRICS = (RLMetric.REWARD, RLMetric.K3_KL)
_EMPTY_NOTE = ("your run's {} per RL step appears here<br>"
               "choose a model, precision, objective and seed above and press <b>Start</b>")


def objective_config(config: RLConfig, objective: str) -> RLConfig:
    """``config`` with the fields the phase diagram's ``objective`` sets (mode, loss, TIS cap; the TIS cap off
    for an objective without TIS), so that the run sits where :func:`~r3lab.runs.phase.phase_objective` says."""
    if objective not in PHASE_OBJECTIVES:
        raise ConfigError(f"no objective {objective!r}; the phase diagram's are {list(PHASE_OBJECTIVES)}")
    fields = {"tis_cap": None, **PHASE_OBJECTIVES[objective]}
    return dataclasses.replace(config, **fields)


def _notebook(fig: go.Figure) -> go.Figure:
    """The figure as a notebook's output shows it: the paper width dropped, autosized (it fills the output)."""
    return go.Figure(fig).update_layout(width=None, autosize=True)


class DialWidget(widgets.VBox):
    """Run one point of the phase diagram from a notebook and put it on the diagram.

    ``records``: the committed phase records (:func:`r3lab.runs.phase.phase_records`), drawn as the diagram the
    finished run joins; the run's knobs are ``config`` (default :meth:`RLConfig.quick`) with ``knobs`` replacing
    fields, the controls choosing model, engine precision, objective, seed and steps. Runs go to ``runs_root``.
    :attr:`own` holds the records of the runs started here; :attr:`diagram` the diagram with them.
    """

    def __init__(self, records: Iterable[Mapping[str, Any]] = (), runs_root: str | os.PathLike | None = None, *,
                 objective: str = "R3", config: RLConfig | None = None, interval: float = 0.5, **knobs: Any):
        self.config = rl_config(config, **knobs)
        cfg = self.config
        if objective not in PHASE_OBJECTIVES:
            raise ConfigError(f"no objective {objective!r}; the phase diagram's are {list(PHASE_OBJECTIVES)}")
        self.records = [dict(r) for r in records]
        self.own: list[dict[str, Any]] = []
        self.runs_root = runs_dir(runs_root)
        self.interval = interval
        self.job: RLJob | None = None
        self.follower: RunFollower | None = None
        self._placed: set[str] = set()
        self._runs = 0
        self._lock = threading.RLock()  # the follower's thread and the controls both redraw
        style = {"description_width": LABEL_WIDTH}
        models = list(dict.fromkeys([cfg.model, *(r["model"] for r in self.records), *MODELS]))
        self.model = widgets.Dropdown(options=models, value=cfg.model, description="model", tooltip=field_help("model"),
                                      style=style, layout=widgets.Layout(**CONTROL))
        self.engine_quant = widgets.SelectionSlider(options=ENGINE_QUANTS, value=cfg.engine_quant,
                                                    description="engine precision", tooltip=field_help("engine_quant"),
                                                    style=style, layout=widgets.Layout(**CONTROL))
        self.objective = widgets.Dropdown(
            options=list(PHASE_OBJECTIVES), value=objective, description="objective", style=style,
            tooltip="; ".join(f"{k}: " + ", ".join(f"{f}={v}" for f, v in fs.items())
                              for k, fs in PHASE_OBJECTIVES.items()), layout=widgets.Layout(**CONTROL))
        self.seed = widgets.IntText(value=cfg.seed, description="seed", tooltip=field_help("seed"), style=style,
                                    layout=widgets.Layout(**CONTROL))
        self.steps = widgets.IntSlider(value=cfg.steps, min=1, max=max(_STEPS_TOP, cfg.steps), description="RL steps",
                                       tooltip=field_help("steps"), style=style, layout=widgets.Layout(**CONTROL))
        self.start_button = widgets.Button(description="Start", button_style="primary", icon="play",
                                           layout=widgets.Layout(width="96px"))
        self.stop_button = widgets.Button(description="Stop", icon="stop", layout=widgets.Layout(width="96px"))
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="steps", style=style,
                                            layout=widgets.Layout(**CONTROL))
        self.status = widgets.HTML("<div class='r3lab-status'>pick a point of the diagram and press Start</div>")
        self.views = {m: LiveFigure(f"your run: {label(m)}", m, empty_note=_EMPTY_NOTE.format(label(m)))
                      for m in _LIVE_METRICS}
        self.figures = {m: v.figure for m, v in self.views.items()}
        self.diagram_view = LiveFigure("the phase diagram", RLMetric.REWARD, height=680)
        self.diagram_note = widgets.HTML()
        self.start_button.on_click(lambda _: self._guarded(self.start))
        self.stop_button.on_click(lambda _: self.stop())
        controls = widgets.HBox([
            widgets.VBox([self.model, self.engine_quant, self.objective]),
            widgets.VBox([self.seed, self.steps, self.progress, widgets.HBox([self.start_button, self.stop_button])]),
        ], layout=widgets.Layout(flex_flow="row wrap", grid_gap="4px 12px"))
        live = widgets.GridBox([v.widget for v in self.views.values()],
                               layout=widgets.Layout(grid_template_columns="repeat(2, minmax(0, 1fr))"))
        super().__init__([controls, self.status, live, self.diagram_note, self.diagram_view.widget])
        self.add_class("r3lab-dial")
        self._draw_diagram()

    # -- what the controls choose
    def chosen_config(self) -> RLConfig:
        """The RLConfig the controls describe (every other knob from :attr:`config`), checked by RLConfig."""
        cfg = dataclasses.replace(self.config, model=self.model.value, engine_quant=self.engine_quant.value,
                                  seed=int(self.seed.value), steps=int(self.steps.value))
        cfg = objective_config(cfg, self.objective.value)
        back = phase_objective(cfg.to_dict())  # the diagram must read the run back as the objective chosen
        if back != self.objective.value:
            raise FigureError(f"the config for {self.objective.value!r} reads back as {back!r}")
        return cfg

    # -- actions
    def _guarded(self, action: Any) -> None:
        show_errors(self.status, action, self.labels)

    @property
    def labels(self) -> dict[str, str]:
        """RLConfig field -> the label of the control that sets it (how the status line names a field)."""
        controls = {"model": self.model, "engine_quant": self.engine_quant, "seed": self.seed, "steps": self.steps}
        return {name: str(w.description) for name, w in controls.items()}

    def start(self) -> RLJob:
        """Start the run the controls describe and follow it (what the Start button does)."""
        if self.follower is not None and self.follower.alive:
            raise FigureError("a run is still in progress: wait for it, press Stop or call close()")
        cfg = self.chosen_config()
        self._runs += 1
        tag = self.objective.value.replace("+", "_")
        prefix = (f"dial-{Path(cfg.model).name}-{cfg.engine_quant}-{tag}-{time.strftime('%Y%m%d-%H%M%S')}-"
                  f"{os.getpid()}-{self._runs}")
        job = start_rl(self.runs_root, prefix=prefix, config=cfg, modes=[cfg.mode], seeds=[cfg.seed])
        self.job = job
        with self._lock:
            for m, fig in self.figures.items():
                fig.data = ()
                set_steps(fig, job.steps)
                self.views[m].draw()
        self.progress.value, self.progress.max = 0, len(job.run_names) * job.steps
        self.follower = RunFollower(job.runs_root, job.prefix, job=job, interval=self.interval,
                                    on_update=self._refresh).start()
        self.status.value = f"<div class='r3lab-status'>started {html.escape(prefix)}</div>"
        return job

    def stop(self) -> None:
        """End the running job, mark its unfinished run stopped on disk, and stop following it."""
        stop_job(self.job, self.follower, "stopped from the dial")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run is done and placed on the diagram (True) or ``timeout`` passes (False); a run that
        failed (or could not be read) raises, with the job's output tail."""
        if self.follower is None:
            raise FigureError("nothing is running: call start() first")
        done = self.follower.wait(timeout)
        if done and self.follower.state in ("failed", "error"):
            tail = self.job.tail() if self.job is not None else ""
            raise FigureError(f"the dial's run {self.follower.state}"
                              + (f": {self.follower.error!r}" if self.follower.error else "") + f"\n{tail}")
        return done

    @property
    def diagram(self) -> go.Figure:
        """The phase diagram of the committed records with this widget's finished runs as stars."""
        return phase_figure(self.records, highlight=self.own)

    # -- drawing (from the follower's thread)
    def _refresh(self, follower: RunFollower) -> None:
        snap = follower.snapshot()
        with self._lock:
            for m, fig in self.figures.items():
                set_traces(fig, [(r.name, f"{r.mode} s{r.seed}", r.mode, "solid", [s["step"] for s in r.records],
                                  [value(s, m) for s in r.records]) for r in snap])
                self.views[m].draw()
        self.progress.value = min(sum(len(r.records) for r in snap), self.progress.max)
        extra = ""
        if follower.state in ("failed", "error") and self.job is not None:
            extra = f"<pre class='r3lab-log'>{html.escape(self.job.tail())}</pre>"
        self._place(follower, [r.name for r in snap if r.finished])
        placed = [r.name for r in snap if r.name in self._placed]
        if placed:
            extra += f"<br>placed on the diagram (a star): {html.escape(', '.join(placed))}"
        self.status.value = status_html(follower, extra, snap)

    def _place(self, follower: RunFollower, finished: list[str]) -> list[str]:
        """Put the finished runs not placed yet on the diagram; their names."""
        new = [n for n in finished if n not in self._placed]
        for name in new:
            self.own.append(phase_record(load(follower.root / name)))
            self._placed.add(name)
        if new:
            self._draw_diagram()
        return new

    def _draw_diagram(self) -> None:
        with self._lock:
            if not self.records and not self.own:
                self.diagram_note.value = ("<div class='r3lab-status'>no committed phase records given: the diagram "
                                           "shows your runs once they finish</div>")
                return
            self.diagram_note.value = ""
            self.diagram_view.figure = _notebook(self.diagram)
            self.diagram_view.draw()

    def close(self) -> None:
        """Stop following and end a job that still runs."""
        if getattr(self, "follower", None) is not None or getattr(self, "job", None) is not None:
            self.stop()
        super().close()
