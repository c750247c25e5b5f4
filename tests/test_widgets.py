"""r3lab.widgets: the live monitor follows runs another process writes; the dashboard runs `r3lab rl` and shows it.

The writer is a real second process (RunWriter, then raw appends with a half-written line held open on a
handshake), so the monitor reads a file that grows under it exactly as with a running job.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from r3lab.config import DEFAULT_MODES, RLConfig, run_names
from r3lab.errors import ConfigError, R3LabError, RunFormatError
from r3lab.runs import FollowedRun, RunFollower, load, load_runs, reference_runs_dir
from r3lab.viz import MODE_COLORS
from r3lab.widgets import LAYER_METRIC, PLOTLY_MIME, AblationDashboard, RunMonitor, monitor, start_rl

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

WRITER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from r3lab.runs import RunWriter
    root, prefix, steps, hold = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "hold"
    for mode in ("none", "R3"):
        w = RunWriter(root, f"{prefix}-{mode}-s0", "rl", {"mode": mode, "seed": 0, "steps": steps})
        f = open(w.path / "steps.jsonl", "a")
        for step in range(steps):
            line = json.dumps({"step": step, "mismatch/k3_kl": (step + 1) * (1e-4 if mode == "none" else 1e-5),
                               "reward_mean": 0.1 * step, "routing/engine_trainer_disagreement_per_layer":
                               {"0": 0.01 * step, "1": 0.02 * step}}) + "\\n"
            if hold and mode == "none" and step == 2:  # a half-written line, held until the test says go
                f.write(line[:17]); f.flush()
                (root / "partial.flag").touch()
                while not (root / "go.flag").exists():
                    time.sleep(0.02)
                f.write(line[17:]); f.flush()
            else:
                f.write(line); f.flush()
            time.sleep(0.05)
        f.close()
        w.finish({"steps": steps})
    time.sleep(float(sys.argv[5]) if len(sys.argv) > 5 else 0)
""")


def _writer(root: Path, prefix: str, steps: int, hold: bool, linger: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), prefix, str(steps), "hold" if hold else "-",
                             str(linger)], env=ENV)


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def _expected(run_dir: Path, metric: str, layer: int | None = None) -> tuple[list[int], list[float]]:
    recs = [json.loads(ln) for ln in (run_dir / "steps.jsonl").read_text().splitlines()]
    vals = [r[metric][str(layer)] if layer is not None else r[metric] for r in recs]
    return [r["step"] for r in recs], vals


def test_monitor_follows_a_writer_in_another_process_through_a_half_written_line(tmp_path):
    w = _writer(tmp_path, "cmp", 6, hold=True)
    try:
        mon = RunMonitor(tmp_path, "cmp", metrics=["mismatch/k3_kl", "reward_mean", LAYER_METRIC], layer=1,
                         expect=2, interval=0.05)
        _wait_for(lambda: (tmp_path / "partial.flag").exists(), 60, "the writer's half-written line")
        time.sleep(0.5)  # ten polls over the partial line
        fig = mon.figures["mismatch/k3_kl"]
        assert mon.follower.error is None and mon.state == "running"
        assert [list(t.x) for t in fig.data] == [[0, 1]]  # the complete steps only, nothing from the partial line
        (tmp_path / "go.flag").touch()
        assert mon.wait(60), mon.status.value
        assert w.wait(30) == 0
    finally:
        w.kill()
    assert mon.state == "finished" and mon.follower.error is None and not mon.follower.alive
    for metric, layer in (("mismatch/k3_kl", None), ("reward_mean", None), (LAYER_METRIC, 1)):
        traces = {t.meta: t for t in mon.figures[metric].data}
        assert set(traces) == {"cmp-none-s0", "cmp-R3-s0"}
        for name, t in traces.items():
            x, y = _expected(tmp_path / name, metric, layer)
            assert list(t.x) == x == list(range(6)) and list(t.y) == pytest.approx(y)
            assert t.line.color == MODE_COLORS[name.split("-")[1]]
        assert tuple(mon.figures[metric].layout.xaxis.range) == (-0.5, 5.5)  # the run's steps, from its config
        # what the page gets: the whole figure in the Output widget's one display, every point in it
        shown = mon.views[metric].widget.outputs
        assert len(shown) == 1 and shown[0]["output_type"] == "display_data"
        spec = shown[0]["data"][PLOTLY_MIME]
        assert {t["meta"]: (t["x"], t["y"]) for t in spec["data"]} == {
            n: (list(t.x), pytest.approx(list(t.y))) for n, t in traces.items()}
        assert spec["layout"]["title"]["text"] == mon.figures[metric].layout.title.text
    assert "finished" in mon.status.value and "12 steps" in mon.status.value
    snap = {r.name: r for r in mon.follower.snapshot()}
    assert all(isinstance(r, FollowedRun) for r in snap.values())
    assert {(r.mode, r.seed, r.finished, r.total_steps, len(r.records)) for r in snap.values()} == {
        ("none", 0, True, 6, 6), ("R3", 0, True, 6, 6)}
    assert [rec["step"] for rec in snap["cmp-R3-s0"].records] == list(range(6))
    mon.close()


def test_a_single_run_stops_when_its_summary_lands_and_close_stops_a_running_monitor(tmp_path):
    w = _writer(tmp_path, "one", 4, hold=False, linger=30)
    try:
        _wait_for(lambda: (tmp_path / "one-none-s0" / "summary.json").exists(), 60, "the first run's summary")
        single = monitor(tmp_path / "one-none-s0", interval=0.05)
        assert single.wait(10) and single.state == "finished"
        assert list(single.figures["reward_mean"].data[0].y) == pytest.approx([0.0, 0.1, 0.2, 0.3])
        # a folder whose runs never finish (the writer lingers): closing stops the thread promptly
        (tmp_path / "late").mkdir()
        mon = RunMonitor(tmp_path / "late", interval=0.05)
        _wait_for(lambda: mon.follower.alive, 5, "the monitor thread")
        assert mon.state == "waiting"
        t0 = time.monotonic()
        mon.close()
        assert not mon.follower.alive and time.monotonic() - t0 < 2 and mon.state == "stopped"
    finally:
        w.kill()
        w.wait()


def test_bad_paths_and_corrupt_lines_are_named(tmp_path):
    with pytest.raises(R3LabError, match="does not exist"):
        RunMonitor(tmp_path / "nowhere", folder_wait_s=0)
    late = RunMonitor(tmp_path / "nowhere", interval=0.05, folder_wait_s=0.3)  # never appears: named
    assert late.wait(10) and late.state == "error" and "did not appear within 0.3 s" in str(late.follower.error)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(R3LabError, match="is a file"):
        RunMonitor(tmp_path / "file.txt")
    with pytest.raises(ConfigError, match="metric"):
        RunMonitor(tmp_path, metrics=[])
    with pytest.raises(R3LabError, match="no runs named"):
        load_runs(tmp_path, "rl-")
    w = _writer(tmp_path, "bad", 2, hold=False)
    assert w.wait(60) == 0
    run = tmp_path / "bad-none-s0"
    with open(run / "steps.jsonl", "a") as f:
        f.write("not json\n")
    follower = RunFollower(run, interval=0.05).start()
    assert follower.wait(10)
    assert follower.state == "error" and isinstance(follower.error, RunFormatError)
    assert "line 3 is not JSON" in str(follower.error)


def test_a_monitor_started_before_the_job_creates_its_folder_waits_for_it(tmp_path):
    root = tmp_path / "not-yet"  # `widgets.monitor(DIR, PREFIX)` right after `r3lab rl --runs DIR` starts
    mon = monitor(root, "cmp", interval=0.05, expect=2, folder_wait_s=60)
    try:
        time.sleep(0.3)
        assert mon.state == "waiting" and mon.follower.alive
        w = _writer(root, "cmp", 3, hold=False)
        assert w.wait(60) == 0 and mon.wait(30) and mon.state == "finished"
        assert [list(t.x) for t in mon.figures["reward_mean"].data] == [[0, 1, 2], [0, 1, 2]]
    finally:
        mon.close()


def test_start_rl_refuses_bad_arguments_before_starting_anything(tmp_path):
    for kwargs, match in ((dict(modes=["R4"]), "^mode must be one of"), (dict(modes=[]), "replay mode"),
                          (dict(samples_per_prompt=1), "^samples_per_prompt must be >= 2"),
                          (dict(stpes=3), r"no knob\(s\) \['stpes'\]; the knobs are model, mode, weight_replay, "),
                          (dict(prompts_per_step=3, samples_per_prompt=3, mini_batches=2), r"\(mini_batches\)"),
                          (dict(seeds=[]), "seed"), (dict(lr=0), "^lr, clip_eps"), (dict(mode="R3"), "modes=\\[...\\]"),
                          (dict(no_such_knob=1), "no knob.*no_such_knob")):
        with pytest.raises(ConfigError, match=match):
            start_rl(tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())
    (tmp_path / "x-R3-s0").mkdir()
    with pytest.raises(ConfigError, match="never overwritten"):
        start_rl(tmp_path, prefix="x", modes=["R3"])


def test_a_failing_job_is_shown_not_swallowed(tmp_path):
    job = start_rl(tmp_path, prefix="fail", model="no-such-model", modes=["R3"], steps=1)
    # every knob from RLConfig.quick() (the one source of the widgets' defaults) spelled out for `r3lab rl`
    want = RLConfig.quick(model="no-such-model", steps=1).to_cli_args(modes=["R3"], seeds=[0])
    assert job.command == [sys.executable, "-m", "r3lab", "rl", *want, "--runs", str(tmp_path), "--name", "fail",
                           "--no-progress"]
    assert job.run_names == run_names("fail", ["R3"], [0]) and job.steps == 1
    with job:
        mon = monitor(job, interval=0.1)
        assert mon.wait(120), mon.status.value
        assert mon.state == "failed" and job.returncode not in (0, None)
        assert "no model 'no-such-model'" in html.unescape(mon.status.value)  # the child's own error, in the widget


def test_the_dashboards_controls_start_from_rl_config(tmp_path):
    quick = RLConfig.quick()
    dash = AblationDashboard(tmp_path)
    try:
        assert dash.config == quick and dash.modes.value == DEFAULT_MODES  # R3W is asked for by name
        assert (dash.model.value, dash.temperature.value, dash.dtypes.value) == (
            quick.model, quick.temperature, (quick.engine_dtype, quick.trainer_dtype))
        shown = {"prompts_per_step": dash.prompts, "samples_per_prompt": dash.samples, "steps": dash.steps}
        for name, slider in shown.items():
            assert slider.value == getattr(quick, name)
            RLConfig.quick(mini_batches=1, **{name: slider.min})  # the lower end is a value RLConfig accepts ...
            with pytest.raises(ConfigError):
                RLConfig.quick(mini_batches=1, **{name: slider.min - 1})  # ... and the one below it is not
        assert (dash.prompts.min, dash.samples.min, dash.steps.min) == (1, 2, 1)
    finally:
        dash.close()
    mine = AblationDashboard(tmp_path, config=RLConfig(model="tiny-glm4-moe", trainer_dtype="bfloat16"), steps=250)
    try:
        assert mine.config == RLConfig(model="tiny-glm4-moe", trainer_dtype="bfloat16", steps=250)
        assert (mine.model.value, mine.dtypes.value, mine.steps.value) == ("tiny-glm4-moe", ("bfloat16", "bfloat16"),
                                                                          250)
        assert mine.steps.max >= 250 and mine.samples.value == 8 and mine.config.lr == 1e-3
    finally:
        mine.close()
    with pytest.raises(ConfigError, match="^samples_per_prompt must be >= 2"):  # the keyword the user typed
        AblationDashboard(tmp_path, samples_per_prompt=1)


def test_the_dashboards_controls_have_distinct_labels_and_rl_config_help(tmp_path):
    dash = AblationDashboard(tmp_path)
    controls = [dash.model, dash.modes, dash.dtypes, dash.temperature, dash.prompts, dash.samples, dash.steps,
                dash.seed, dash.metric, dash.layer, dash.progress]
    labels = [c.description for c in controls]
    assert len(set(labels)) == len(labels), labels  # e.g. the steps slider and the progress bar differ
    assert dash.steps.description == "RL steps" and dash.progress.description == "progress"
    assert dash.steps.tooltip == RLConfig.__dataclass_fields__["steps"].metadata["help"]
    assert all(c.layout.width == "310px" for c in controls)  # three columns fit JupyterLab's 968 px output area
    assert max(len(label) for label, _ in dash.dtypes.options) <= 26  # fits its box beside the 125 px label
    dash.close()


def test_the_dashboards_megatron_choice_yields_its_layout_in_the_cli_args(tmp_path):
    def flag(args: list[str], name: str) -> str:
        return args[args.index(name) + 1]

    dash = AblationDashboard(tmp_path)
    try:
        assert [v for _, v in dash.trainer.options] == ["hf", "megatron"] and dash.trainer.value == "hf"
        assert dash.trainer.tooltip == RLConfig.__dataclass_fields__["trainer"].metadata["help"]
        assert dash.parallel.layout.display == "none" and all(w.disabled for w in (dash.tp, dash.pp, dash.ep))
        args = dash.controls_config().to_cli_args(modes=["R3"], seeds=[0])
        assert (flag(args, "--trainer"), flag(args, "--tp"), flag(args, "--pp"), flag(args, "--ep")) == (
            "hf", "1", "1", "1")
        dash.trainer.value = "megatron"  # the layout fields appear, enabled
        assert dash.parallel.layout.display == "flex" and not any(w.disabled for w in (dash.tp, dash.pp, dash.ep))
        assert [w.description for w in (dash.tp, dash.pp, dash.ep)] == ["tp", "pp", "ep"]
        dash.tp.value, dash.pp.value, dash.ep.value = 2, 2, 2
        config = dash.controls_config()
        assert (config.trainer, config.tp, config.pp, config.ep, config.dp) == ("megatron", 2, 2, 2, 2)
        args = config.to_cli_args(modes=["R3"], seeds=[0])
        assert (flag(args, "--trainer"), flag(args, "--tp"), flag(args, "--pp"), flag(args, "--ep")) == (
            "megatron", "2", "2", "2")
        dash.trainer.value = "hf"  # hidden again: the transformers trainer gets no Megatron layout
        assert dash.parallel.layout.display == "none" and dash.controls_config().tp == 1
        dash.trainer.value = "megatron"
        dash.tp.value, dash.pp.value, dash.ep.value = 4, 4, 1
        dash.ep.value = 2  # 4 x 4 x dp 2 = 32 ranks: RLConfig refuses it, Run says so and starts nothing
        with pytest.raises(ConfigError, match="at most 16"):
            dash.controls_config()
        dash._guarded(dash.run)
        assert dash.job is None and "at most 16" in html.unescape(dash.status.value)
        # the config error names its fields as data: the status line says the controls' labels, not flags
        assert "tp x pp x dp = 32 CPU ranks" in html.unescape(dash.status.value) and "--" not in dash.status.value
        dash.samples.value, dash.trainer.value = 3, "hf"
        dash._guarded(lambda: RLConfig.quick(samples_per_prompt=1))
        assert "samples / prompt must be &gt;= 2" in dash.status.value, dash.status.value
    finally:
        dash.close()
    mine = AblationDashboard(tmp_path, trainer="megatron", tp=2)  # the controls start from the config given
    try:
        assert (mine.trainer.value, mine.tp.value, mine.pp.value, mine.parallel.layout.display) == (
            "megatron", 2, 1, "flex")
    finally:
        mine.close()


def test_reference_runs_load():
    runs = load_runs(reference_runs_dir(), "tiny-qwen3-moe-default-")
    assert {r.config["mode"] for r in runs} == {"none", "R2", "R3"} and all(r.finished for r in runs)


@pytest.mark.engine  # its Run starts an RL job: a vLLM engine and a trainer in a child process
def test_dashboard_runs_the_experiment_and_shows_exactly_what_the_runs_hold(tmp_path):
    dash = AblationDashboard(tmp_path / "runs", tmp_path / "figures", steps=2, prompts_per_step=2,
                             samples_per_prompt=2, max_tokens=8, interval=0.2)
    dash.modes.value = ("none", "R3")
    dash.steps.value = 3
    dash.seed.value = 1
    dash.temperature.value = 0.8
    dash.run_button.click()  # what the browser's click does: the on_click handler
    try:
        assert dash.job is not None, dash.status.value
        assert dash.wait(420), dash.status.value + dash.job.tail()
        assert dash.follower.state == "finished", dash.status.value + dash.job.tail()
        assert dash.progress.value == dash.progress.max == 6
        runs = {r.name: r for r in load_runs(tmp_path / "runs", dash.job.prefix)}
        assert sorted(runs) == sorted(dash.job.run_names) and all(r.finished for r in runs.values())
        assert {r.config["seed"] for r in runs.values()} == {1}
        assert {r.config["temperature"] for r in runs.values()} == {0.8}
        # the knobs the controls do not show come from the dashboard's config (RLConfig.quick() with overrides)
        assert {(r.config["max_tokens"], r.config["lr"], r.config["mini_batches"]) for r in runs.values()} == {
            (8, RLConfig.quick().lr, 2)}
        layers = sorted(int(k) for k in runs[dash.job.run_names[0]].step_records[0][LAYER_METRIC])
        assert list(dash.layer.options) == layers and dash.layer.value == layers[0]  # from the model's config
        dash.layer.value = layers[-1]
        shown = ((dash.curve_fig, "mismatch/k3_kl", None), (dash.layer_fig, LAYER_METRIC, layers[-1]))
        for fig, metric, layer in shown:
            traces = {t.meta: t for t in fig.data}
            assert set(traces) == set(runs)
            for name, t in traces.items():
                x, y = _expected(runs[name].path, metric, layer)
                assert list(t.x) == x == [0, 1, 2] and list(t.y) == pytest.approx(y)
                assert t.line.color == MODE_COLORS[runs[name].config["mode"]]
        dash.metric.value = "reward_mean"  # the figure follows the control, from the runs already read
        for t in dash.curve_fig.data:
            assert list(t.y) == pytest.approx(_expected(runs[t.meta].path, "reward_mean")[1])
        files = dash.export()
        assert len(files) == 6
        magic = {".png": b"\x89PNG", ".pdf": b"%PDF", ".svg": b"<svg"}
        for f in files:
            head = f.read_bytes()[:200]
            assert f.stat().st_size > 2000 and magic[f.suffix] in head, f
    finally:
        dash.close()
    assert not dash.follower.alive and not dash.job.running
    assert load(runs[dash.job.run_names[0]].path).finished


def test_a_failing_callback_puts_the_follower_in_error_instead_of_dying_silently(tmp_path):
    w = _writer(tmp_path, "cb", 2, hold=False)
    assert w.wait(60) == 0
    seen = []

    def boom(f):
        seen.append(f.state)
        if len(seen) == 1:
            raise ValueError("a broken figure")

    follower = RunFollower(tmp_path / "cb-R3-s0", interval=0.05, on_update=boom).start()
    assert follower.wait(10)
    assert follower.state == "error" and "a broken figure" in str(follower.error) and seen[-1] == "error"


class _WriterJob:
    """The job protocol the dashboard's Stop needs, around the test's writer process (no engine)."""

    def __init__(self, root: Path, prefix: str, steps: int):
        self.runs_root, self.prefix, self.steps = root, prefix, steps
        self.run_names = [f"{prefix}-none-s0", f"{prefix}-R3-s0"]
        self.process = _writer(root, prefix, steps, hold=True)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def test_stop_marks_the_runs_stopped_everywhere(tmp_path, capsys):
    from r3lab.cli import main

    dash = AblationDashboard(tmp_path, steps=6, interval=0.05)
    job = _WriterJob(tmp_path, "stopme", 6)
    dash.job = job
    dash.follower = RunFollower(tmp_path, "stopme", job=job, interval=0.05, on_update=dash._refresh).start()
    try:
        _wait_for(lambda: (tmp_path / "partial.flag").exists(), 60, "the writer's half-written line")
        _wait_for(lambda: dash.follower.steps_landed() == 2, 10, "two steps read")
        dash.stop_button.click()
    finally:
        job.close()
    assert not dash.follower.alive and dash.follower.state == "stopped"
    run = load(tmp_path / "stopme-none-s0")
    assert run.state == "stopped" and run.stopped["steps"] == 2 and "dashboard" in run.stopped["reason"]
    status = html.unescape(dash.status.value)
    assert "<b>stopped</b> · 2 steps from 1 run in" in status and "2 / 6 steps</td><td>stopped" in status, status
    assert "running" not in status
    main(["runs", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[2].split() == ["stopme-none-s0", "rl", "2", "stopped"]
    dash.close()


def test_a_constant_series_gets_a_range_around_its_value_not_down_to_minus_one():
    from r3lab.widgets.live import LiveFigure, set_traces

    view = LiveFigure("t", "reward_mean")
    set_traces(view.figure, [("a", "R3", "R3", "solid", [0, 1, 2], [0.1, 0.1, 0.1])])
    assert tuple(view.figure.layout.yaxis.range) == pytest.approx((0.09, 0.11))
    set_traces(view.figure, [("a", "R3", "R3", "solid", [0, 1, 2], [0.1, 0.1, 0.3])])
    lo, hi = view.figure.layout.yaxis.range
    assert lo < 0.1 and hi > 0.3 and lo > 0.0  # the data's range, padded: not down to -0.9
    log = LiveFigure("t", "mismatch/k3_kl")
    set_traces(log.figure, [("a", "R3", "R3", "solid", [0, 1], [1e-4, 1e-4])])
    assert tuple(log.figure.layout.yaxis.range) == pytest.approx((-4.5, -3.5))  # log10 units: half a decade
    # a log axis over less than a decade (the monitor's crowded "350μ ... 50μ"): few ticks, every label distinct
    set_traces(log.figure, [("a", "R3", "R3", "solid", [0, 1, 2, 3], [5e-5, 1.2e-4, 2.2e-4, 3.5e-4])])
    text = list(log.figure.layout.yaxis.ticktext)
    assert 2 <= len(text) <= 8 and len(set(text)) == len(text), text
    assert "μ" not in "".join(text), text
    assert view.draw() and not view.draw()  # sent once; the same figure again sends nothing


def test_a_quiet_run_is_stalled_and_stopping_a_job_ends_its_process_group(tmp_path):
    from r3lab.runs import RunWriter

    w = RunWriter(tmp_path, "quiet", "rl", {"mode": "R2", "seed": 0, "steps": 5})
    w.log_step({"step": 0, "reward_mean": 0.5})
    mon = RunMonitor(tmp_path / "quiet", interval=0.05, stall_s=0.3)
    _wait_for(lambda: mon.state == "stalled", 10, "the stalled state")
    assert "stalled" in mon.status.value and list(mon.figures["reward_mean"].data[0].y) == [0.5]
    mon.close()
    w.close()
    dash = AblationDashboard(tmp_path / "runs", steps=1, prompts_per_step=2, samples_per_prompt=2)
    dash.modes.value = ("R2",)
    dash.run_button.click()
    job = dash.job
    assert job is not None and job.running
    t0 = time.monotonic()
    dash.stop_button.click()
    assert not job.running and not dash.follower.alive and time.monotonic() - t0 < 15
    with pytest.raises(ProcessLookupError):
        os.killpg(job.process.pid, 0)  # nothing of the job's process group is left
    dash.close()
