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

from r3lab.config import MODES, RLConfig
from r3lab.errors import ConfigError, R3LabError
from r3lab.moe_layout import MoELayout
from r3lab.paths import MODELS, model_dir, runs_dir
from r3lab.runs import RunFollower
from r3lab.viz import ONE_COLUMN, export
from r3lab.widgets.jobs import RLJob, rl_config, start_rl
from r3lab.widgets.live import (
    DEFAULT_METRICS,
    LAYER_METRIC,
    LOG_METRICS,
    figure,
    set_steps,
    set_traces,
    status_html,
    value,
)

__all__ = ["AblationDashboard"]

_DTYPE_PAIRS = (("engine bf16 / trainer fp32", ("bfloat16", "float32")),
                ("engine bf16 / trainer bf16 (fp32 routers)", ("bfloat16", "bfloat16")),
                ("engine fp32 / trainer fp32", ("float32", "float32")))
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
                             style=style)


def _moe_layers(model: str) -> list[int]:
    """The MoE layer ids of a model from its config.json; empty (filled from the first step) if unreadable."""
    try:
        return list(MoELayout.from_model_dir(model_dir(model)).moe_layer_ids)
    except R3LabError:
        return []


class AblationDashboard(widgets.VBox):
    """Run none / R2 / R3 side by side from a notebook and watch the curves grow.

    Controls: model, replay modes, temperature, dtype pair, prompts per step, samples per prompt, seed,
    steps, metric and layer. **Run** starts ``r3lab rl`` as a child process (:func:`start_rl`) writing to
    ``runs_root`` and follows its runs (progress = steps landed / steps asked); a failure shows the job's
    output tail. **Stop** ends the job. **Export** writes the current figures as PNG/SVG/PDF into ``export_dir``.
    """

    def __init__(self, runs_root: str | os.PathLike | None = None, export_dir: str | os.PathLike | None = None, *,
                 modes: Sequence[str] = MODES, config: RLConfig | None = None, metric: str = "mismatch/k3_kl",
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
        style = {"description_width": "120px"}
        self.model = widgets.Dropdown(options=list(dict.fromkeys([cfg.model, *MODELS])), value=cfg.model,
                                      description="model", style=style)
        self.modes = widgets.SelectMultiple(options=MODES, value=tuple(modes), description="replay modes", rows=3,
                                            style=style)
        self.temperature = widgets.FloatSlider(value=cfg.temperature, min=0.1, max=max(2.0, cfg.temperature), step=0.1,
                                               description="temperature", style=style)
        pairs = dict(_DTYPE_PAIRS)
        pair = (cfg.engine_dtype, cfg.trainer_dtype)
        if pair not in pairs.values():
            pairs[f"engine {pair[0]} / trainer {pair[1]}"] = pair
        self.dtypes = widgets.Dropdown(options=list(pairs.items()), value=pair, description="dtypes", style=style)
        self.prompts = _slider(cfg, "prompts_per_step", "prompts / step", style)
        self.samples = _slider(cfg, "samples_per_prompt", "samples / prompt", style)
        self.steps = _slider(cfg, "steps", "steps", style)
        self.seed = widgets.IntText(value=cfg.seed, description="seed", style=style)
        self.metric = widgets.Dropdown(options=list(dict.fromkeys([metric, *DEFAULT_METRICS])), value=metric,
                                       description="metric", style=style)
        self.layer = widgets.Dropdown(options=_moe_layers(cfg.model), description="layer", style=style)
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.export_button = widgets.Button(description="Export", icon="download")
        self.stop_button = widgets.Button(description="Stop", icon="stop")
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="steps")
        self.status = widgets.HTML("<div class='r3lab-status'>ready</div>")
        self.messages = widgets.HTML("")
        self.curve_fig = figure(metric, metric)
        self.layer_fig = figure("engine-trainer routing disagreement, layer -", LAYER_METRIC)
        self.figures = {"curves": self.curve_fig, "layer": self.layer_fig}
        self.run_button.on_click(lambda _: self._guarded(self.run))
        self.export_button.on_click(lambda _: self._export_in_background())
        self.stop_button.on_click(lambda _: self.stop())
        self.model.observe(lambda _: self._set_layers(_moe_layers(self.model.value)), names="value")
        self.metric.observe(lambda _: self._redraw(), names="value")
        self.layer.observe(lambda _: self._redraw(), names="value")
        controls = widgets.HBox([
            widgets.VBox([self.model, self.modes, self.dtypes, self.temperature]),
            widgets.VBox([self.prompts, self.samples, self.steps, self.seed]),
            widgets.VBox([self.metric, self.layer, self.progress,
                          widgets.HBox([self.run_button, self.stop_button, self.export_button])]),
        ])
        super().__init__([controls, self.status, self.messages,
                          widgets.GridBox([self.curve_fig, self.layer_fig],
                                          layout=widgets.Layout(grid_template_columns="repeat(2, minmax(0, 1fr))"))])
        self.add_class("r3lab-dashboard")

    # -- actions
    def _guarded(self, action: Callable[[], Any]) -> None:
        try:
            action()
        except R3LabError as e:
            self.status.value = f"<div class='r3lab-status'><b style='color:#d62728'>{html.escape(str(e))}</b></div>"

    def run(self) -> RLJob:
        """Start the experiment the controls describe and follow it (what the Run button does)."""
        if self.follower is not None and self.follower.alive:
            raise R3LabError("a run is still in progress: wait for it or call close()")
        if not self.modes.value:
            raise ConfigError("pick at least one replay mode")
        engine_dtype, trainer_dtype = self.dtypes.value
        config = dataclasses.replace(self.config, model=self.model.value, temperature=float(self.temperature.value),
                                     engine_dtype=engine_dtype, trainer_dtype=trainer_dtype,
                                     prompts_per_step=int(self.prompts.value),
                                     samples_per_prompt=int(self.samples.value), steps=int(self.steps.value),
                                     seed=int(self.seed.value))
        config = dataclasses.replace(config, mini_batches=self._mini_batches(config))
        self._runs += 1
        prefix = f"dash-{Path(config.model).name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._runs}"
        job = start_rl(self.runs_root, prefix=prefix, config=config, modes=list(self.modes.value), seeds=[config.seed])
        self.job = job
        for fig in self.figures.values():
            fig.data = ()
            set_steps(fig, job.steps)
        self.progress.value, self.progress.max = 0, len(job.run_names) * job.steps
        self.messages.value = ""
        self.follower = RunFollower(job.runs_root, job.prefix, job=job, interval=self.interval,
                                    on_update=self._refresh).start()
        self.status.value = f"<div class='r3lab-status'>started {html.escape(prefix)}</div>"
        return job

    def stop(self) -> None:
        """End the running job (its whole process group) and stop following it; the figures keep what landed."""
        if self.job is not None:
            self.job.close()
        if self.follower is not None:
            self.follower.stop()

    def _mini_batches(self, config: RLConfig) -> int:
        """The config's mini-batches if the batch the controls ask for splits into them, else one."""
        batch = config.prompts_per_step * config.samples_per_prompt
        return self.config.mini_batches if batch % self.config.mini_batches == 0 else 1

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the current run is done (True) or ``timeout`` passes (False); for scripts and tests."""
        if self.follower is None:
            raise R3LabError("nothing is running: call run() first")
        return self.follower.wait(timeout)

    def export(self, folder: str | os.PathLike | None = None) -> list[Path]:
        """Write every figure as PNG, SVG and PDF (``r3lab.viz.export``) into ``folder``; returns the files."""
        out = Path(folder) if folder is not None else self.export_dir
        tag = self.job.prefix if self.job is not None else "dashboard"
        files: list[Path] = []
        for name, fig in self.figures.items():
            if not fig.data:
                raise R3LabError(f"the {name} figure is empty: run an experiment first")
            files += export(go.Figure(fig).update_layout(**ONE_COLUMN), out / f"{tag}-{name}")  # the paper's size
        return files

    def _export_in_background(self) -> None:
        def work() -> None:
            try:
                files = self.export()
                self.messages.value = "wrote " + ", ".join(html.escape(str(f)) for f in files)
            except Exception as e:  # noqa: BLE001 - shown in the widget
                self.messages.value = f"<b style='color:#d62728'>export failed: {html.escape(str(e))}</b>"

        threading.Thread(target=work, name="r3lab-export", daemon=True).start()

    # -- drawing (from the follower's thread)
    def _refresh(self, follower: RunFollower) -> None:
        self.progress.value = min(follower.steps_landed(), self.progress.max)
        layers = sorted({int(k) for run in follower.snapshot() for r in run.records[:1]
                         for k in (r.get(LAYER_METRIC) or {})})
        if layers and list(self.layer.options) != layers:
            self._set_layers(layers)  # the runs' own layers win over the config's
        self._redraw()
        extra = ""
        if follower.state in ("failed", "error") and self.job is not None:
            extra = f"<pre class='r3lab-log'>{html.escape(self.job.tail())}</pre>"
        self.status.value = status_html(follower, extra)

    def _set_layers(self, layers: list[int]) -> None:
        keep = self.layer.value
        self.layer.options = layers
        self.layer.value = keep if keep in layers else (layers[0] if layers else None)  # observe() redraws

    def _redraw(self) -> None:
        if self.follower is None:
            return
        with self._draw_lock:
            self._draw()

    def _draw(self) -> None:
        snap = self.follower.snapshot() if self.follower is not None else []
        metric, layer = self.metric.value, self.layer.value
        self.curve_fig.update_layout(title=metric, yaxis_title=metric,
                                     yaxis_type="log" if metric.startswith(LOG_METRICS) else "linear")
        self.layer_fig.update_layout(title=f"engine-trainer routing disagreement, layer {layer}")
        for fig, key, lay in ((self.curve_fig, metric, None), (self.layer_fig, LAYER_METRIC, layer)):
            set_traces(fig, [(r.name, r.mode, r.mode, "solid", [s["step"] for s in r.records],
                              [value(s, key, lay) for s in r.records]) for r in snap])

    def close(self) -> None:
        """Stop following and end a job that still runs."""
        if getattr(self, "follower", None) is not None or getattr(self, "job", None) is not None:
            self.stop()
        super().close()
