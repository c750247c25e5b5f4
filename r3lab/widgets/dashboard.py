"""The RL ablation dashboard: run none / R2 / R3 side by side from a notebook and watch the curves grow."""

from __future__ import annotations

import dataclasses
import html
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from r3lab.config import DEFAULT_MODES, MODES, RL_TRAINERS, RLConfig
from r3lab.errors import ConfigError, FigureError, R3LabError
from r3lab.labels import axis_title, label
from r3lab.moe_layout import MoELayout
from r3lab.paths import MODELS, model_dir, runs_dir
from r3lab.runs import RunFollower
from r3lab.trainer_registry import TRAINER_REGISTRY
from r3lab.viz import ONE_COLUMN, export
from r3lab.viz.style import wrap
from r3lab.vocabulary import RLMetric
from r3lab.widgets.controls import CONTROL, LABEL_WIDTH, field_help, show_errors
from r3lab.widgets.jobs import RLJob, rl_config, start_rl, stop_job
from r3lab.widgets.live import (
    DEFAULT_METRICS,
    LAYER_METRIC,
    LOG_METRICS,
    LiveFigure,
    fit_y,
    set_steps,
    set_traces,
    status_html,
    value,
)

_SHORT = {"bfloat16": "bf16", "float32": "fp32"}
_DTYPE_PAIRS = (("bf16 / fp32", ("bfloat16", "float32")),  # engine / trainer
                ("bf16 / bf16, fp32 router", ("bfloat16", "bfloat16")),
                ("fp32 / fp32", ("float32", "float32")))
_SLIDER_TOP = {"prompts_per_step": 32, "samples_per_prompt": 16, "steps": 200}  # the sliders' upper ends


def _lowest_accepted(name: str, limit: int = 64) -> int:
    """The smallest value of an integer RLConfig field that RLConfig accepts (one mini-batch, other fields quick)."""
    for v in range(limit):
        try:
            RLConfig.quick(mini_batches=1, **{name: v})
        except ConfigError:
            continue
        return v
    raise ConfigError(f"RLConfig accepts no {name} below {limit}")


def _slider(config: RLConfig, name: str, label: str, style: dict[str, str]) -> widgets.IntSlider:
    """A slider over an RLConfig field: its value from ``config``, its lower end RLConfig's own minimum."""
    v = int(getattr(config, name))
    return widgets.IntSlider(value=v, min=_lowest_accepted(name), max=max(_SLIDER_TOP[name], v), description=label,
                             tooltip=field_help(name), style=style, layout=widgets.Layout(**CONTROL))


def _moe_layers(model: str) -> list[int]:
    """The MoE layer ids of a model from its config.json; empty (filled from the first step) if unreadable."""
    try:
        return list(MoELayout.from_model_dir(model_dir(model)).moe_layer_ids)
    except R3LabError:
        return []


class AblationDashboard(widgets.VBox):
    """Run none / R2 / R3 side by side from a notebook and watch the curves grow.

    Controls: model, replay modes, temperature, engine / trainer dtypes, prompts per step, samples per prompt,
    seed, RL steps, the trainer (transformers or Megatron-core, with its tp / pp / ep shown for Megatron), metric
    and layer (tooltips: the RLConfig field's help). **Run** starts ``r3lab rl`` as a
    child process (:func:`start_rl`) writing to ``runs_root`` and follows its runs (progress = steps landed /
    steps asked); a failure shows the job's output tail. **Stop** ends the job and marks its unfinished runs
    stopped on disk (:func:`r3lab.runs.mark_stopped`). **Export** writes the current figures as PNG/SVG/PDF
    into ``export_dir`` (the button says so while it works).

    The figures (:attr:`figures`: ``go.Figure`` objects) are shown by :class:`~r3lab.widgets.live.LiveFigure`
    (a whole figure per update, so a cold page or a lost message never leaves them blank).
    """

    def __init__(self, runs_root: str | os.PathLike | None = None, export_dir: str | os.PathLike | None = None, *,
                 modes: Sequence[str] = DEFAULT_MODES, config: RLConfig | None = None, metric: str = RLMetric.K3_KL,
                 interval: float = 0.5, **knobs: Any):
        self.config = rl_config(config, **knobs)  # what the controls start from, and every knob they do not show
        cfg = self.config
        self.runs_root = runs_dir(runs_root)
        self.export_dir = Path(export_dir) if export_dir is not None else self.runs_root / "figures"
        self.interval = interval
        self.job: RLJob | None = None
        self.follower: RunFollower | None = None
        self._runs = 0
        self._draw_lock = threading.RLock()  # the follower's thread and the controls both redraw
        style = {"description_width": LABEL_WIDTH}
        box = widgets.Layout(**CONTROL)
        self.model = widgets.Dropdown(options=list(dict.fromkeys([cfg.model, *MODELS])), value=cfg.model,
                                      description="model", tooltip=field_help("model"), style=style, layout=box)
        self.modes = widgets.SelectMultiple(options=MODES, value=tuple(modes), description="replay modes",
                                            rows=len(MODES),
                                            tooltip=field_help("mode"), style=style, layout=widgets.Layout(**CONTROL))
        self.temperature = widgets.FloatSlider(value=cfg.temperature, min=0.1, max=max(2.0, cfg.temperature), step=0.1,
                                               readout_format=".1f", description="temperature",
                                               tooltip=field_help("temperature"), style=style,
                                               layout=widgets.Layout(**CONTROL))
        pairs = dict(_DTYPE_PAIRS)
        pair = (cfg.engine_dtype, cfg.trainer_dtype)
        if pair not in pairs.values():
            pairs[f"{_SHORT.get(pair[0], pair[0])} / {_SHORT.get(pair[1], pair[1])}"] = pair
        self.dtypes = widgets.Dropdown(options=list(pairs.items()), value=pair, description="engine / trainer",
                                       tooltip=f"engine: {field_help('engine_dtype')}; "
                                               f"trainer: {field_help('trainer_dtype')}",
                                       style=style, layout=widgets.Layout(**CONTROL))
        self.trainer = widgets.Dropdown(options=[(TRAINER_REGISTRY[t].label, t) for t in RL_TRAINERS],
                                        value=cfg.trainer, description="trainer", tooltip=field_help("trainer"),
                                        style=style, layout=widgets.Layout(**CONTROL))
        small = {"description_width": "22px"}  # the Megatron layout: three fields on one 310 px row
        self.tp, self.pp, self.ep = (
            widgets.BoundedIntText(value=int(getattr(cfg, k)), min=1, max=16, description=k, tooltip=field_help(k),
                                   style=small, layout=widgets.Layout(width="100px")) for k in ("tp", "pp", "ep"))
        self.parallel = widgets.HBox([self.tp, self.pp, self.ep], layout=widgets.Layout(**CONTROL))
        self.trainer.observe(lambda _: self._show_parallel(), names="value")
        self._show_parallel()
        self.prompts = _slider(cfg, "prompts_per_step", "prompts / step", style)
        self.samples = _slider(cfg, "samples_per_prompt", "samples / prompt", style)
        self.steps = _slider(cfg, "steps", "RL steps", style)
        self.seed = widgets.IntText(value=cfg.seed, description="seed", tooltip=field_help("seed"), style=style,
                                    layout=widgets.Layout(**CONTROL))
        self.metric = widgets.Dropdown(options=list(dict.fromkeys([metric, *DEFAULT_METRICS])), value=metric,
                                       description="metric", style=style, layout=widgets.Layout(**CONTROL))
        self.layer = widgets.Dropdown(options=_moe_layers(cfg.model), description="layer",
                                      tooltip="the MoE layer of the routing-disagreement figure", style=style,
                                      layout=widgets.Layout(**CONTROL))
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play",
                                         layout=widgets.Layout(width="96px"))
        self.export_button = widgets.Button(description="Export", icon="download", layout=widgets.Layout(width="110px"),
                                            tooltip="write both figures as PNG, SVG and PDF (about half a minute)")
        self.stop_button = widgets.Button(description="Stop", icon="stop", layout=widgets.Layout(width="96px"))
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="progress",
                                            tooltip="steps landed / steps asked, over every run", style=style,
                                            layout=widgets.Layout(**CONTROL))
        self.status = widgets.HTML("<div class='r3lab-status'>ready</div>")
        self.messages = widgets.HTML("")
        self.curve_view = LiveFigure(label(metric), metric)
        self.layer_view = LiveFigure("engine-trainer routing disagreement, layer -", LAYER_METRIC)
        self.layer_view.figure.update_layout(yaxis_title="share of token rows that differ")
        self.curve_fig, self.layer_fig = self.curve_view.figure, self.layer_view.figure
        self.figures = {"curves": self.curve_fig, "layer": self.layer_fig}  # go.Figure objects
        self.views = {"curves": self.curve_view, "layer": self.layer_view}
        self.run_button.on_click(lambda _: self._guarded(self.run))
        self.export_button.on_click(lambda _: self._export_in_background())
        self.stop_button.on_click(lambda _: self.stop())
        self.model.observe(lambda _: self._set_layers(_moe_layers(self.model.value)), names="value")
        self.metric.observe(lambda _: self._redraw(), names="value")
        self.layer.observe(lambda _: self._redraw(), names="value")
        controls = widgets.HBox([
            widgets.VBox([self.model, self.modes, self.dtypes, self.temperature]),
            widgets.VBox([self.prompts, self.samples, self.steps, self.seed, self.trainer, self.parallel]),
            widgets.VBox([self.metric, self.layer, self.progress,
                          widgets.HBox([self.run_button, self.stop_button, self.export_button])]),
        ], layout=widgets.Layout(flex_flow="row wrap", grid_gap="4px 12px"))
        super().__init__([controls, self.status, self.messages,
                          widgets.GridBox([self.curve_view.widget, self.layer_view.widget],
                                          layout=widgets.Layout(grid_template_columns="repeat(2, minmax(0, 1fr))"))])
        self.add_class("r3lab-dashboard")

    # -- actions
    def _guarded(self, action: Callable[[], Any]) -> None:
        show_errors(self.status, action, self.labels)

    @property
    def labels(self) -> dict[str, str]:
        """RLConfig field -> the label of the control that sets it (how the status line names a field)."""
        controls = {"model": self.model, "mode": self.modes, "temperature": self.temperature,
                    "engine_dtype": self.dtypes, "trainer_dtype": self.dtypes, "prompts_per_step": self.prompts,
                    "samples_per_prompt": self.samples, "steps": self.steps, "seed": self.seed,
                    "trainer": self.trainer, "tp": self.tp, "pp": self.pp, "ep": self.ep}
        return {name: str(w.description) for name, w in controls.items()}

    def run(self) -> RLJob:
        """Start the experiment the controls describe and follow it (what the Run button does)."""
        if self.follower is not None and self.follower.alive:
            raise FigureError("a run is still in progress: wait for it or call close()")
        if not self.modes.value:
            raise ConfigError("pick at least one replay mode")
        config = self.controls_config()
        self._runs += 1
        prefix = f"dash-{Path(config.model).name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._runs}"
        job = start_rl(self.runs_root, prefix=prefix, config=config, modes=list(self.modes.value), seeds=[config.seed])
        self.job = job
        with self._draw_lock:
            for name, fig in self.figures.items():
                fig.data = ()
                set_steps(fig, job.steps)
                fit_y(fig)
                self.views[name].draw()
        self.progress.value, self.progress.max = 0, len(job.run_names) * job.steps
        self.messages.value = ""
        self.follower = RunFollower(job.runs_root, job.prefix, job=job, interval=self.interval,
                                    on_update=self._refresh).start()
        self.status.value = f"<div class='r3lab-status'>started {html.escape(prefix)}</div>"
        return job

    def controls_config(self) -> RLConfig:
        """The RLConfig the controls describe (validated by RLConfig; what **Run** starts): the dashboard's config
        with the shown knobs replaced. tp / pp / ep count only for the Megatron trainer (1 for transformers)."""
        engine_dtype, trainer_dtype = self.dtypes.value
        megatron = TRAINER_REGISTRY[self.trainer.value].parallel_layout  # a trainer with a layout (tp / pp / ep)
        config = dataclasses.replace(self.config, model=self.model.value, temperature=float(self.temperature.value),
                                     engine_dtype=engine_dtype, trainer_dtype=trainer_dtype,
                                     prompts_per_step=int(self.prompts.value),
                                     samples_per_prompt=int(self.samples.value), steps=int(self.steps.value),
                                     seed=int(self.seed.value), trainer=self.trainer.value,
                                     tp=int(self.tp.value) if megatron else 1, pp=int(self.pp.value) if megatron else 1,
                                     ep=int(self.ep.value) if megatron else 1)
        return dataclasses.replace(config, mini_batches=self._mini_batches(config))

    def _show_parallel(self) -> None:
        """The Megatron layout fields: shown and enabled for the Megatron trainer only."""
        megatron = TRAINER_REGISTRY[self.trainer.value].parallel_layout
        self.parallel.layout.display = "flex" if megatron else "none"
        for w in (self.tp, self.pp, self.ep):
            w.disabled = not megatron

    def stop(self) -> None:
        """End the running job (its whole process group), mark its unfinished runs stopped on disk (so the
        rows here and ``r3lab runs`` say stopped), and stop following it; the figures keep what landed."""
        follower = self.follower
        stop_job(self.job, follower, "stopped from the dashboard")
        if follower is not None and follower.state != "finished":
            follower.poll()  # the stop marks, read back: the rows say stopped as the header does
            self._refresh(follower)

    def _mini_batches(self, config: RLConfig) -> int:
        """The config's mini-batches if the batch the controls ask for splits into them, else one."""
        batch = config.prompts_per_step * config.samples_per_prompt
        return self.config.mini_batches if batch % self.config.mini_batches == 0 else 1

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the current run is done (True) or ``timeout`` passes (False); for scripts and tests."""
        if self.follower is None:
            raise FigureError("nothing is running: call run() first")
        return self.follower.wait(timeout)

    def export(self, folder: str | os.PathLike | None = None) -> list[Path]:
        """Write every figure as PNG, SVG and PDF (``r3lab.viz.export``) into ``folder``; returns the files."""
        out = Path(folder) if folder is not None else self.export_dir
        tag = self.job.prefix if self.job is not None else "dashboard"
        files: list[Path] = []
        for name, fig in self.figures.items():
            if not fig.data:
                raise FigureError(f"the {name} figure is empty: run an experiment first")
            paper = go.Figure(fig).update_layout(**ONE_COLUMN, autosize=False, showlegend=True)  # the paper's size
            files += export(paper, out / f"{tag}-{name}")
        return files

    def _export_in_background(self) -> None:
        button = self.export_button

        def work() -> None:
            try:
                files = self.export()
                self.messages.value = "wrote " + ", ".join(html.escape(str(f)) for f in files)
            except Exception as e:  # noqa: BLE001 - shown in the widget
                self.messages.value = f"<b style='color:#d62728'>export failed: {html.escape(str(e))}</b>"
            finally:
                button.disabled, button.description, button.icon = False, "Export", "download"

        button.disabled, button.description, button.icon = True, "Exporting…", "hourglass-half"
        self.messages.value = (f"exporting {len(self.figures)} figures as PNG, SVG and PDF to "
                               f"{html.escape(str(self.export_dir))} (about half a minute) …")
        threading.Thread(target=work, name="r3lab-export", daemon=True).start()

    # -- drawing (from the follower's thread; one snapshot feeds the figures, the progress and the status)
    def _refresh(self, follower: RunFollower) -> None:
        snap = follower.snapshot()
        layers = sorted({int(k) for run in snap for r in run.records[:1] for k in (r.get(LAYER_METRIC) or {})})
        if layers and list(self.layer.options) != layers:
            self._set_layers(layers)  # the runs' own layers win over the config's
        with self._draw_lock:
            self._draw(snap)
        self.progress.value = min(sum(len(r.records) for r in snap), self.progress.max)
        extra = ""
        if follower.state in ("failed", "error") and self.job is not None:
            extra = f"<pre class='r3lab-log'>{html.escape(self.job.tail())}</pre>"
        self.status.value = status_html(follower, extra, snap)

    def _set_layers(self, layers: list[int]) -> None:
        keep = self.layer.value
        self.layer.options = layers
        self.layer.value = keep if keep in layers else (layers[0] if layers else None)  # observe() redraws

    def _redraw(self) -> None:
        if self.follower is None:
            return
        with self._draw_lock:
            self._draw(self.follower.snapshot())

    def _draw(self, snap: Sequence[Any]) -> None:
        metric, layer = self.metric.value, self.layer.value
        self.curve_fig.update_layout(title=label(metric), yaxis_title=wrap(axis_title(metric), 28),
                                     yaxis_type="log" if metric.startswith(LOG_METRICS) else "linear")
        self.layer_fig.update_layout(title=f"engine-trainer routing disagreement, layer {layer}")
        for name, fig, key, lay in (("curves", self.curve_fig, metric, None),
                                    ("layer", self.layer_fig, LAYER_METRIC, layer)):
            set_traces(fig, [(r.name, r.mode, r.mode, "solid", [s["step"] for s in r.records],
                              [value(s, key, lay) for s in r.records]) for r in snap])
            self.views[name].draw()

    def close(self) -> None:
        """Stop following and end a job that still runs."""
        if getattr(self, "follower", None) is not None or getattr(self, "job", None) is not None:
            self.stop()
        super().close()
