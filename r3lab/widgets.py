"""Notebook widgets that read runs on disk: a live monitor and the RL ablation dashboard.

Both follow run folders (``r3lab.runs``) that another process writes, never an engine: the dashboard's Run
button starts ``python -m r3lab rl ...`` as a child process (:func:`start_rl`, a :class:`RLJob` handle) and
both widgets read its ``steps.jsonl`` files from a background thread (:class:`RunFollower`), reading only the
bytes appended since the last poll. The kernel stays free while a job runs; figures are plotly
``FigureWidget`` objects extended in place, one colour per replay mode (``r3lab.viz.MODE_COLORS``).

A half-written last line is what a running writer leaves between two flushes: it waits for its newline and
is never an error. A complete line that is not a step record is (``RunFormatError`` naming file and line).
"""

from __future__ import annotations

import collections
import html
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from r3lab._process import Closing
from r3lab.errors import ConfigError, R3LabError
from r3lab.moe_layout import MoELayout
from r3lab.paths import MODELS, model_dir, results_dir, runs_dir
from r3lab.runs import Run, RunFormatError, list_runs, load, parse_step_line
from r3lab.viz import ONE_COLUMN, TEMPLATE, export, mode_color

__all__ = ["DEFAULT_METRICS", "LAYER_METRIC", "RLJob", "start_rl", "RunFollower", "RunMonitor", "monitor",
           "AblationDashboard", "load_runs", "reference_runs_dir"]

DEFAULT_METRICS = ("mismatch/k3_kl", "mismatch/extreme_frac_tau2", "reward_mean", "routing/route_change_last_mb",
                   "train/clip_frac")
LAYER_METRIC = "routing/engine_trainer_disagreement_per_layer"  # {layer id: share of (token) rows that differ}
MODES = ("none", "R2", "R3")
_DASHES = ("solid", "dash", "dot", "dashdot", "longdash")
_LOG_METRICS = ("mismatch/k3",)


def reference_runs_dir() -> Path:
    """The committed reference RL runs of a source checkout (``bench/results/rl``)."""
    p = results_dir() / "rl"
    if not p.is_dir():
        raise R3LabError(f"no reference runs at {p}: they ship in a source checkout's bench/results/rl "
                         "(or pass a folder of your own runs)")
    return p


def load_runs(folder: str | os.PathLike, prefix: str = "") -> list[Run]:
    """Every run in ``folder`` whose name starts with ``prefix``, by name; raises if there is none or one is bad."""
    root = Path(folder)
    if not root.is_dir():
        raise R3LabError(f"runs folder {str(root)!r} does not exist")
    found = [run for path, run in list_runs(root) if path.name.startswith(prefix)]
    for run in found:
        if isinstance(run, RunFormatError):
            raise run
    if not found:
        raise R3LabError(f"no runs named {prefix!r}* in {str(root)!r}")
    return found


# ----------------------------------------------------------------------------------------------- child jobs


class RLJob(Closing):
    """``python -m r3lab rl ...`` in a child process (its own process group) writing runs to ``runs_root``.

    Its output is read by a thread into a bounded tail (:meth:`tail`), so a failure's message is shown, never
    swallowed. ``close()`` (or ``with``) ends the process group if it still runs; idempotent.
    """

    def __init__(self, args: Sequence[str], *, runs_root: Path, prefix: str, modes: Sequence[str],
                 seeds: Sequence[int], steps: int):
        self.runs_root, self.prefix, self.steps = Path(runs_root), prefix, int(steps)
        self.run_names = [f"{prefix}-{m}-s{s}" for s in seeds for m in modes]  # run_comparison's order
        self.command = [sys.executable, "-m", "r3lab", "rl", *args]
        self._tail: collections.deque[str] = collections.deque(maxlen=400)
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"r3lab-job-{prefix}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._tail.append(line.rstrip("\n"))
        self.process.stdout.close()

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the job's stdout and stderr (vLLM's warnings included)."""
        return "\n".join(list(self._tail)[-lines:])

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None if the job still runs after ``timeout`` seconds."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self, grace_s: float = 10.0) -> None:
        """End the job's whole process group (vLLM's workers too): SIGTERM, then SIGKILL after ``grace_s``."""
        if self.process.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                if self.wait(wait_s) is not None:
                    break
        self._reader.join(timeout=5)


def start_rl(runs_root: str | os.PathLike | None = None, *, prefix: str | None = None, model: str = "tiny-qwen3-moe",
             modes: Sequence[str] = MODES, seeds: Sequence[int] = (0,), steps: int = 10, prompts_per_step: int = 4,
             samples_per_prompt: int = 4, max_tokens: int = 16, mini_batches: int = 2,
             temperature: float = 1.0, engine_dtype: str = "bfloat16", trainer_dtype: str = "float32",
             extra_args: Sequence[str] = ()) -> RLJob:
    """Start an RL comparison (one run per mode and seed, named ``<prefix>-<mode>-s<seed>``) in a child process.

    The arguments are checked here so a typo fails at once; the rest of ``RLConfig``'s checks run in the child
    and show in :meth:`RLJob.tail`. ``extra_args`` go to ``r3lab rl`` as they are (e.g. ``["--lr", "3e-3"]``).
    """
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"modes must be among {MODES}, got {list(modes)}")
    if not seeds:
        raise ConfigError("give at least one seed")
    for name, v, lo in (("steps", steps, 1), ("prompts_per_step", prompts_per_step, 1),
                        ("samples_per_prompt", samples_per_prompt, 2), ("max_tokens", max_tokens, 1),
                        ("mini_batches", mini_batches, 1)):
        if int(v) < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {v!r}")
    if (prompts_per_step * samples_per_prompt) % mini_batches:
        raise ConfigError(f"the batch of {prompts_per_step * samples_per_prompt} samples does not split into "
                          f"{mini_batches} mini-batches")
    root = runs_dir(runs_root)
    prefix = prefix or f"rl-{Path(model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    clash = [n for n in (f"{prefix}-{m}-s{s}" for s in seeds for m in modes) if (root / n).exists()]
    if clash:
        raise ConfigError(f"runs {clash} exist in {root}; runs are never overwritten (pick another prefix)")
    args = ["--model", str(model), "--modes", *modes, "--seeds", *map(str, seeds), "--steps", str(steps),
            "--prompts-per-step", str(prompts_per_step), "--samples-per-prompt", str(samples_per_prompt),
            "--max-tokens", str(max_tokens), "--mini-batches", str(mini_batches), "--temperature", str(temperature),
            "--engine-dtype", engine_dtype, "--trainer-dtype", trainer_dtype, "--runs", str(root), "--name", prefix,
            "--no-progress", *extra_args]
    return RLJob(args, runs_root=root, prefix=prefix, modes=modes, seeds=seeds, steps=steps)


# ----------------------------------------------------------------------------------------------- following runs


class _Tail:
    """One run folder followed: its config, and its step records read incrementally from steps.jsonl."""

    def __init__(self, path: Path):
        run = load(path)  # validates format and version; steps are read again below, incrementally
        self.path, self.meta = path, run.meta
        self.records: list[dict[str, Any]] = []
        self.finished = False
        self._offset, self._pending, self._lines = 0, b"", 0
        self.last_change = time.monotonic()

    @property
    def mode(self) -> str:
        return str(self.meta["config"].get("mode", "?"))

    @property
    def seed(self) -> int:
        return int(self.meta["config"].get("seed", 0))

    @property
    def total_steps(self) -> int | None:
        s = self.meta["config"].get("steps")
        return int(s) if s is not None else None

    def poll(self) -> bool:
        """Read what was appended since the last poll; True if a step landed or the run finished."""

        finished = (self.path / "summary.json").is_file()  # checked first: every step is on disk before it lands
        with open(self.path / "steps.jsonl", "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *lines, self._pending = (self._pending + data).split(b"\n")
        new = 0
        for ln in lines:
            self._lines += 1
            if ln.strip():
                self.records.append(parse_step_line(ln, self.path / "steps.jsonl", self._lines))
                new += 1
        changed = bool(new) or finished != self.finished
        self.finished = finished
        if changed:
            self.last_change = time.monotonic()
        return changed


class RunFollower:
    """Follows one run folder, or the runs named ``prefix*`` in a folder of runs, from a background thread.

    It polls every ``interval`` seconds, reads only new bytes, and calls ``on_update(self)`` from its thread
    after each change. It ends by itself when the runs are done: a single run when its ``summary.json`` lands;
    a folder when ``expect`` runs have finished, or when ``job`` has exited (then ``failed`` if it exited
    non-zero), or, given neither, when every run seen has finished and no new one appeared for ``settle_s``.
    ``stop()`` ends it at once and joins the thread. ``state``: waiting, running, stalled (no new step for
    ``stall_s``), finished, failed, stopped, or error (an unreadable run; ``error`` holds it).
    """

    def __init__(self, source: str | os.PathLike, prefix: str = "", *, expect: int | None = None,
                 job: RLJob | None = None, interval: float = 0.5, stall_s: float = 300.0, settle_s: float = 60.0,
                 on_update: Callable[[RunFollower], None] | None = None):
        src = Path(source)
        if src.exists() and not src.is_dir():
            raise R3LabError(f"{str(src)!r} is a file, not a run folder or a folder of runs")
        if not src.exists() and job is None:
            raise R3LabError(f"{str(src)!r} does not exist (give a run folder, a folder of runs, or the job that "
                             "will write it)")
        if expect is not None and expect < 1:
            raise ConfigError(f"expect must be >= 1, got {expect}")
        if interval <= 0:
            raise ConfigError(f"interval must be > 0, got {interval}")
        self.single = (src / "config.json").is_file()
        self.root, self.prefix, self.job = src, prefix, job
        self.expect = expect if expect is not None else (len(job.run_names) if job is not None else None)
        self.interval, self.stall_s, self.settle_s = interval, stall_s, settle_s
        self.on_update = on_update
        self.runs: dict[str, _Tail] = {}
        self.state = "waiting"
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_new_run = time.monotonic()

    # -- the loop
    def start(self) -> RunFollower:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"r3lab-follow-{self.root.name}", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while True:
                if self.poll():
                    self._notify()
                if self.state in ("finished", "failed") or self._stop.wait(self.interval):
                    break
            if self.state not in ("finished", "failed"):
                self.state = "stopped"
                self._notify()
        except Exception as e:  # noqa: BLE001 - an unreadable run or a failing callback: shown, never swallowed
            self.error, self.state = e, "error"
            try:
                self._notify()
            except Exception:  # noqa: BLE001 - the widget itself fails: at least the kernel's log has it
                traceback.print_exc()

    def _notify(self) -> None:
        if self.on_update is not None:
            self.on_update(self)

    def poll(self) -> bool:
        """One look at the disk (the thread calls this; tests may call it directly). True if anything changed."""
        job_exited = self.job is not None and not self.job.running  # before reading: a last step is not missed
        changed = False
        with self._lock:
            for path in self._candidates():
                if path.name not in self.runs and (path / "steps.jsonl").is_file():
                    self.runs[path.name] = _Tail(path)
                    self._last_new_run = time.monotonic()
                    changed = True
            for tail in self.runs.values():
                changed |= tail.poll()
            state = self._state(job_exited)
        changed |= state != self.state
        self.state = state
        return changed

    def _candidates(self) -> list[Path]:
        if self.single or (self.root / "config.json").is_file():
            self.single = True
            return [self.root]
        if not self.root.is_dir():
            return []
        names = self.job.run_names if self.job is not None else None
        return [p for p in sorted(self.root.iterdir())
                if p.is_dir() and p.name.startswith(self.prefix) and (names is None or p.name in names)
                and (p / "config.json").is_file()]

    def _state(self, job_exited: bool) -> str:
        runs = list(self.runs.values())
        done = sum(t.finished for t in runs)
        if self.single and runs and runs[0].finished:
            return "finished"
        if self.expect is not None and done >= self.expect:
            return "finished"
        if job_exited:
            return "failed" if self.job.returncode != 0 or done < (self.expect or 0) else "finished"  # type: ignore[union-attr]
        if (self.expect is None and not self.single and runs and done == len(runs)
                and time.monotonic() - self._last_new_run > self.settle_s):
            return "finished"
        if not runs:
            return "waiting"
        latest = max(t.last_change for t in runs)
        return "stalled" if time.monotonic() - latest > self.stall_s else "running"

    # -- control
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the follower ends by itself (True) or ``timeout`` passes (False)."""
        if self._thread is None:
            raise R3LabError("the follower was never started")
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread and join it (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def snapshot(self) -> list[tuple[str, str, int, list[dict[str, Any]], bool, int | None]]:
        """(name, mode, seed, step records, finished, total steps) of every run, a consistent copy."""
        with self._lock:
            return [(n, t.mode, t.seed, list(t.records), t.finished, t.total_steps) for n, t in self.runs.items()]

    def steps_landed(self) -> int:
        with self._lock:
            return sum(len(t.records) for t in self.runs.values())


def _value(rec: dict[str, Any], metric: str, layer: int | None = None) -> float | None:
    v = rec.get(metric)
    if isinstance(v, dict):
        v = v.get(str(layer)) if layer is not None else None
    return None if v is None else float(v)


def _figure(title: str, metric: str, width: int = 470, height: int = 340) -> go.FigureWidget:
    fig = go.FigureWidget()
    fig.update_layout(template=TEMPLATE, title=title, xaxis_title="RL step", yaxis_title=metric, width=width,
                      height=height,
                      yaxis_type="log" if metric.startswith(_LOG_METRICS) else "linear",
                      margin={"l": 60, "r": 10, "t": 40, "b": 40}, legend={"orientation": "h", "y": -0.3})
    return fig


_Series = tuple[str, str, str, str, list[int], list[float | None]]  # key, label, mode, dash, x, y


def _set_traces(fig: go.FigureWidget, series: Sequence[_Series]) -> None:
    """Make ``fig`` hold ``series``, extending traces in place; a trace is keyed by ``meta`` (FigureWidget sets uid)."""
    with fig.batch_update():
        have = {t.meta: t for t in fig.data}
        for key, label, mode, dash, x, y in series:
            t = have.get(key)
            if t is None:
                fig.add_scatter(x=x, y=y, name=label, meta=key, mode="lines+markers", legendgroup=mode,
                                line={"color": mode_color(mode), "dash": dash}, marker={"size": 4})
            elif list(t.x or ()) != x or list(t.y or ()) != y:
                t.x, t.y = x, y


def _set_steps(fig: go.FigureWidget, total: int | None) -> None:
    """Fix the x axis to the run's steps once (plotly.js autoranges y as data lands).

    Checked in a browser: layout edits sent from the follower's thread after the first one can be lost on
    the way to the page, while data edits arrive; so the x range is set once, before or with the first data.
    """
    if total and tuple(fig.layout.xaxis.range or ()) != (-0.5, total - 0.5):
        fig.update_layout(xaxis_range=[-0.5, total - 0.5], yaxis_autorange=True)


def _status_html(follower: RunFollower, extra: str = "") -> str:
    rows = "".join(
        f"<tr><td>{html.escape(n)}</td><td>{len(recs)}{'' if total is None else f' / {total}'}</td>"
        f"<td>{'finished' if fin else 'running'}</td></tr>"
        for n, _, _, recs, fin, total in follower.snapshot())
    err = f"<br><b style='color:#d62728'>{html.escape(repr(follower.error))}</b>" if follower.error else ""
    return (f"<div class='r3lab-status'><b>{html.escape(follower.state)}</b> &middot; "
            f"{follower.steps_landed()} steps from {len(follower.runs)} run(s) in {html.escape(str(follower.root))}"
            f"{err}{extra}<table>{rows}</table></div>")


# ----------------------------------------------------------------------------------------------- the live monitor


class RunMonitor(widgets.VBox):
    """Live curves of runs written by another process; see :class:`RunFollower` for ``source``/``prefix``/ends.

    One ``FigureWidget`` per metric (:attr:`figures`), one trace per run coloured by its replay mode, extended
    as steps land. ``close()`` (or :meth:`stop`) ends the follower thread.
    """

    def __init__(self, source: str | os.PathLike, prefix: str = "", *, metrics: Sequence[str] = DEFAULT_METRICS,
                 layer: int | None = None, expect: int | None = None, job: RLJob | None = None,
                 interval: float = 0.5, stall_s: float = 300.0, settle_s: float = 60.0, start: bool = True):
        if not metrics:
            raise ConfigError("give at least one metric to monitor")
        self.follower = RunFollower(source, prefix, expect=expect, job=job, interval=interval, stall_s=stall_s,
                                    settle_s=settle_s, on_update=self._refresh)
        self.metrics, self.layer, self.job = list(metrics), layer, job
        self.figures = {m: _figure(m if layer is None or m != LAYER_METRIC else f"{m} (layer {layer})", m)
                        for m in self.metrics}
        self.status = widgets.HTML(_status_html(self.follower))
        grid = widgets.GridBox(list(self.figures.values()),
                               layout=widgets.Layout(grid_template_columns="repeat(2, minmax(0, 1fr))"))
        super().__init__([self.status, grid])
        if start:
            self.follower.start()

    def _refresh(self, follower: RunFollower) -> None:
        snap = follower.snapshot()
        total = max((t for *_, t in snap if t is not None), default=None)
        for m, fig in self.figures.items():
            _set_steps(fig, total)
            _set_traces(fig, [(name, f"{mode} s{seed}", mode, _DASHES[seed % len(_DASHES)], [r["step"] for r in recs],
                               [_value(r, m, self.layer) for r in recs]) for name, mode, seed, recs, _, _ in snap])
        extra = ""
        if follower.state == "failed" and self.job is not None:
            extra = f"<pre class='r3lab-log'>{html.escape(self.job.tail())}</pre>"
        self.status.value = _status_html(follower, extra)

    @property
    def state(self) -> str:
        return self.follower.state

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the runs are done (True) or ``timeout`` passes (False); for scripts and CI."""
        return self.follower.wait(timeout)

    def stop(self) -> None:
        self.follower.stop()

    def close(self) -> None:
        follower = getattr(self, "follower", None)
        if follower is not None:
            follower.stop()
        super().close()


def monitor(source: str | os.PathLike | RLJob, prefix: str = "", **kwargs: Any) -> RunMonitor:
    """A :class:`RunMonitor` on a run folder, a folder of runs (with a name ``prefix``), or an :class:`RLJob`."""
    if isinstance(source, RLJob):
        return RunMonitor(source.runs_root, source.prefix, job=source, **kwargs)
    return RunMonitor(source, prefix, **kwargs)


# ----------------------------------------------------------------------------------------------- the dashboard


def _moe_layers(model: str) -> list[int]:
    """The MoE layer ids of a model from its config.json; empty (filled from the first step) if unreadable."""
    try:
        return list(MoELayout.from_model_dir(model_dir(model)).moe_layer_ids)
    except R3LabError:
        return []

_DTYPE_PAIRS = (("engine bf16 / trainer fp32", ("bfloat16", "float32")),
                ("engine bf16 / trainer bf16 (fp32 routers)", ("bfloat16", "bfloat16")),
                ("engine fp32 / trainer fp32", ("float32", "float32")))


class AblationDashboard(widgets.VBox):
    """Run none / R2 / R3 side by side from a notebook and watch the curves grow.

    Controls: model, replay modes, temperature, dtype pair, prompts per step, samples per prompt, seed,
    steps, metric and layer. **Run** starts ``r3lab rl`` as a child process (:func:`start_rl`) writing to
    ``runs_root`` and follows its runs (progress = steps landed / steps asked); a failure shows the job's
    output tail. **Stop** ends the job. **Export** writes the current figures as PNG/SVG/PDF into ``export_dir``.
    """

    def __init__(self, runs_root: str | os.PathLike | None = None, export_dir: str | os.PathLike | None = None, *,
                 model: str = MODELS[0], modes: Sequence[str] = MODES, steps: int = 10, prompts_per_step: int = 4,
                 samples_per_prompt: int = 4, max_tokens: int = 16, mini_batches: int = 2, seed: int = 0,
                 temperature: float = 1.0, metric: str = "mismatch/k3_kl", interval: float = 0.5):
        self.runs_root = runs_dir(runs_root)
        self.export_dir = Path(export_dir) if export_dir is not None else self.runs_root / "figures"
        self.max_tokens, self.mini_batches, self.interval = max_tokens, mini_batches, interval
        self.job: RLJob | None = None
        self.follower: RunFollower | None = None
        self._runs = 0
        self._draw_lock = threading.RLock()  # the follower's thread and the controls both redraw
        style = {"description_width": "120px"}
        self.model = widgets.Dropdown(options=list(dict.fromkeys([model, *MODELS])), value=model,
                                      description="model", style=style)
        self.modes = widgets.SelectMultiple(options=MODES, value=tuple(modes), description="replay modes", rows=3,
                                            style=style)
        self.temperature = widgets.FloatSlider(value=temperature, min=0.1, max=2.0, step=0.1,
                                               description="temperature", style=style)
        self.dtypes = widgets.Dropdown(options=_DTYPE_PAIRS, value=_DTYPE_PAIRS[0][1], description="dtypes",
                                       style=style)
        self.prompts = widgets.IntSlider(value=prompts_per_step, min=1, max=32, description="prompts / step",
                                         style=style)
        self.samples = widgets.IntSlider(value=samples_per_prompt, min=2, max=16, description="samples / prompt",
                                         style=style)
        self.seed = widgets.IntText(value=seed, description="seed", style=style)
        self.steps = widgets.IntSlider(value=steps, min=1, max=200, description="steps", style=style)
        self.metric = widgets.Dropdown(options=list(dict.fromkeys([metric, *DEFAULT_METRICS])), value=metric,
                                       description="metric", style=style)
        self.layer = widgets.Dropdown(options=_moe_layers(model), description="layer", style=style)
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.export_button = widgets.Button(description="Export", icon="download")
        self.stop_button = widgets.Button(description="Stop", icon="stop")
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="steps")
        self.status = widgets.HTML("<div class='r3lab-status'>ready</div>")
        self.messages = widgets.HTML("")
        self.curve_fig = _figure(metric, metric)
        self.layer_fig = _figure("engine-trainer routing disagreement, layer -", LAYER_METRIC)
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
        self._runs += 1
        prefix = f"dash-{Path(self.model.value).name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._runs}"
        job = start_rl(self.runs_root, prefix=prefix, model=self.model.value, modes=list(self.modes.value),
                       seeds=[int(self.seed.value)], steps=int(self.steps.value), prompts_per_step=self.prompts.value,
                       samples_per_prompt=self.samples.value, max_tokens=self.max_tokens,
                       mini_batches=self._mini_batches(), temperature=float(self.temperature.value),
                       engine_dtype=engine_dtype, trainer_dtype=trainer_dtype)
        self.job = job
        for fig in self.figures.values():
            fig.data = ()
            _set_steps(fig, job.steps)
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

    def _mini_batches(self) -> int:
        batch = int(self.prompts.value) * int(self.samples.value)
        return self.mini_batches if batch % self.mini_batches == 0 else 1

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
        layers = sorted({int(k) for _, _, _, recs, _, _ in follower.snapshot() for r in recs[:1]
                         for k in (r.get(LAYER_METRIC) or {})})
        if layers and list(self.layer.options) != layers:
            self._set_layers(layers)  # the runs' own layers win over the config's
        self._redraw()
        extra = ""
        if follower.state in ("failed", "error") and self.job is not None:
            extra = f"<pre class='r3lab-log'>{html.escape(self.job.tail())}</pre>"
        self.status.value = _status_html(follower, extra)

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
                                     yaxis_type="log" if metric.startswith(_LOG_METRICS) else "linear")
        self.layer_fig.update_layout(title=f"engine-trainer routing disagreement, layer {layer}")
        for fig, key, lay in ((self.curve_fig, metric, None), (self.layer_fig, LAYER_METRIC, layer)):
            _set_traces(fig, [(name, mode, mode, "solid", [r["step"] for r in recs],
                               [_value(r, key, lay) for r in recs]) for name, mode, _, recs, _, _ in snap])

    def close(self) -> None:
        """Stop following and end a job that still runs."""
        if getattr(self, "follower", None) is not None or getattr(self, "job", None) is not None:
            self.stop()
        super().close()
