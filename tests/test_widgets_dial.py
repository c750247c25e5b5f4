"""The dial widget (r3lab.widgets.DialWidget): the controls' choice is the config `r3lab rl` gets, and a finished
run lands on the diagram. No engine starts: the child process the Start button launches is swapped for a writer
that records the command line and writes the run that command would write (a real second process)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from r3lab.config import ENGINE_QUANTS, RLConfig, config_overrides
from r3lab.errors import ConfigError, R3LabError
from r3lab.runs.phase import PHASE_OBJECTIVES, phase_objective
from r3lab.widgets import DialWidget, objective_config

ROOT = Path(__file__).resolve().parent.parent

# what the fake `r3lab rl` does: write one finished run named <prefix>-<mode>-s<seed> with the config given
WRITER = textwrap.dedent("""
    import json, sys
    from r3lab.runs import RunWriter
    root, name, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with RunWriter(root, name, "rl", cfg) as w:
        for step in range(cfg["steps"]):
            w.log_step({"step": step, "reward_mean": 0.25, "mismatch/k3_kl": 3e-4})
        w.finish({"steps": cfg["steps"]})
""")


def _parse(command: list[str]) -> tuple[RLConfig, argparse.Namespace]:
    """The RLConfig `r3lab rl` builds from the command line (the CLI's own parser and overrides)."""
    from r3lab.cli import _parser

    assert command[:4] == [sys.executable, "-m", "r3lab", "rl"], command
    args = _parser().parse_args(command[3:])
    base = RLConfig(**config_overrides(args, RLConfig))
    (mode,), (seed,) = args.modes, args.seeds
    return dataclasses.replace(base, mode=mode, seed=seed), args


def test_every_choice_of_the_dial_is_the_config_the_child_gets(tmp_path):
    dial = DialWidget([], tmp_path, steps=3, prompts_per_step=2, samples_per_prompt=2, max_tokens=8)
    try:
        for objective, fields in PHASE_OBJECTIVES.items():
            for quant in ENGINE_QUANTS:
                dial.objective.value, dial.engine_quant.value = objective, quant
                dial.model.value, dial.seed.value, dial.steps.value = "tiny-glm4-moe", 4, 7
                cfg = dial.chosen_config()
                want = RLConfig.quick(model="tiny-glm4-moe", engine_quant=quant, seed=4, steps=7, prompts_per_step=2,
                                      samples_per_prompt=2, max_tokens=8, **fields)
                assert cfg == want, (objective, quant)
                assert phase_objective(cfg.to_dict()) == objective
                args = cfg.to_cli_args(modes=[cfg.mode], seeds=[cfg.seed])
                assert args[args.index("--engine-quant") + 1] == quant
                if "tis_cap" in fields:
                    assert args[args.index("--tis-cap") + 1] == "2.0"
                else:
                    assert "--tis-cap" not in args  # off: RLConfig's default
                assert args[args.index("--loss") + 1] == fields["loss"]
    finally:
        dial.close()
    tis = RLConfig.quick(tis_cap=3.0)
    assert objective_config(tis, "R3").tis_cap is None  # an objective without TIS turns a base config's cap off
    with pytest.raises(ConfigError, match="no objective 'R4'"):
        objective_config(tis, "R4")
    with pytest.raises(ConfigError, match="no objective"):
        DialWidget([], tmp_path, objective="GRPO")


def _shown(view):
    return view.widget.outputs[0]["data"]["application/vnd.plotly.v1+json"]


def test_before_start_the_live_figures_say_what_will_appear_and_how_to_start_it(tmp_path):
    from r3lab.labels import label
    from r3lab.widgets.live import set_traces

    dial = DialWidget([], tmp_path / "runs", steps=4)
    try:
        for metric, view in dial.views.items():
            page = _shown(view)
            assert page["layout"]["title"]["text"] == f"your run: {label(metric)}"  # the label table's, no raw key
            assert metric not in page["layout"]["title"]["text"]
            (note,) = page["layout"]["annotations"]
            assert label(metric) in note["text"] and "Start" in note["text"]
            assert page["layout"]["xaxis"]["visible"] is False and page["layout"]["yaxis"]["visible"] is False
            assert not view.figure.layout.annotations  # the note is drawn in place, not put into the figure
            set_traces(view.figure, [("R3", "R3", "R3", "solid", [0, 1], [0.2, 0.3])])
            assert view.draw()
            page = _shown(view)
            assert not page["layout"].get("annotations") and page["layout"]["xaxis"].get("visible", True)
    finally:
        dial.close()


def test_start_runs_r3lab_rl_with_the_choice_and_places_the_finished_run_on_the_diagram(tmp_path, monkeypatch):
    import r3lab.widgets.jobs as jobs

    launched: list[list[str]] = []
    real_popen = subprocess.Popen

    def fake_popen(command, **kwargs):  # the writer in place of `r3lab rl` (same pipes, same session handling)
        launched.append(list(command))
        cfg, args = _parse(list(command))
        name = f"{args.name}-{cfg.mode}-s{cfg.seed}"  # what run_comparison names it, with the config it writes
        return real_popen([sys.executable, "-c", WRITER, args.runs, name, json.dumps(cfg.to_dict())], **kwargs)

    monkeypatch.setattr(jobs.subprocess, "Popen", fake_popen)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    committed = [{"run": "c", "model": "tiny-qwen3-moe", "engine_quant": "none", "objective": "R3", "mode": "R3",
                  "seed": 0, "staleness": 0, "old_logprobs": "current", "steps": 16, "reward_final": 0.4, "k3": 1e-4,
                  "collapse_step": None}]
    dial = DialWidget(committed, tmp_path / "runs", steps=16, interval=0.05)
    try:
        dial.engine_quant.value, dial.objective.value, dial.seed.value, dial.steps.value = "int4", "GSPO", 2, 3
        job = dial.start()
        assert dial.wait(60), "the follower did not end"
        (command,) = launched
        assert job.command == command
        cfg, args = _parse(command)
        assert cfg == RLConfig.quick(engine_quant="int4", seed=2, steps=3, mode="none", loss="gspo")
        assert args.no_progress and Path(args.runs) == tmp_path / "runs"
        assert dial.follower.state == "finished", dial.status.value
        (own,) = dial.own
        assert (own["objective"], own["engine_quant"], own["seed"], own["steps"]) == ("GSPO", "int4", 2, 3)
        assert own["reward_final"] == pytest.approx(0.25) and own["k3"] == pytest.approx(3e-4)
        stars = [t for t in dial.diagram.data if t.marker.symbol == "star"]
        assert [list(t.x) for t in stars] == [["int4"], ["int4"]]
        assert [t.y[0] for t in stars] == pytest.approx([0.25, 3e-4])
        shown = dial.diagram_view.widget.outputs[0]["data"]["application/vnd.plotly.v1+json"]
        assert any(t.get("marker", {}).get("symbol") == "star" for t in shown["data"])  # the page has it too
        assert "width" not in shown["layout"]  # it fills the output area
        assert "placed on the diagram" in dial.status.value
    finally:
        dial.close()


def test_a_failed_run_is_an_error_with_the_jobs_output(tmp_path, monkeypatch):
    import r3lab.widgets.jobs as jobs

    real_popen = subprocess.Popen

    def failing(command, **kwargs):  # `r3lab rl` dying before its first step, saying why
        return real_popen([sys.executable, "-c", "import sys; print('no engine today'); sys.exit(3)"], **kwargs)

    monkeypatch.setattr(jobs.subprocess, "Popen", failing)
    dial = DialWidget([], tmp_path / "runs", steps=2, interval=0.05)
    try:
        dial.start()
        with pytest.raises(R3LabError, match=r"(?s)the dial's run failed.*no engine today"):
            dial.wait(60)
        assert dial.own == [] and "no engine today" in dial.status.value
    finally:
        dial.close()
