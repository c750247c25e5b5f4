"""The collapse experiment's figures (r3lab.viz.collapse) on RL runs written here with RunWriter, whose reward series
collapse at known steps: the survival curves against a Kaplan-Meier computed by hand (censoring included), the k3
traces aligned at each drop against the numbers written, the no-collapse case said in the figure; then on the
committed runs of bench/results/collapse/, and wired into the paper figures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from r3lab.config import RLConfig, RLMetric
from r3lab.errors import R3LabError
from r3lab.runs import RunWriter, load_runs
from r3lab.viz import MODE_COLORS, collapse_k3_figure, collapse_survival_figure

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
HIGH, LOW = 0.6, 0.1  # a reward plateau, and a fall below half of it


def k3_at(step: int) -> float:
    """The k3 every synthetic run logs at ``step``: distinct per step, so a trace's values name the steps drawn."""
    return 1e-4 * (1 + step)


def write_run(root: Path, name: str, *, mode: str, engine_quant: str, steps: int, drop: int | None,
              seed: int = 0) -> None:
    """One finished RL run: reward HIGH until ``drop`` and LOW from it on (None: HIGH throughout), k3 ``k3_at``. Its
    summary claims no collapse, so a figure that read the summary instead of the rewards would be caught."""
    cfg = RLConfig.quick(mode=mode, engine_quant=engine_quant, seed=seed, steps=steps)
    with RunWriter(root, name, "rl", cfg.to_dict()) as w:
        for step in range(steps):
            w.log_step({"step": step, RLMetric.REWARD: LOW if drop is not None and step >= drop else HIGH,
                        RLMetric.K3_KL: k3_at(step)})
        w.finish({"steps": steps, RLMetric.COLLAPSE_STEP: None})


# name -> (mode, engine_quant, steps, drop): names that do not say the arm, written in mixed order
RUNS = {
    "r0": ("R3", "int4", 120, None),
    "r1": ("none", "int4", 120, 60),
    "r2": ("none", "none", 120, None),
    "r3": ("none", "int4", 71, None),  # censored at step 70, between the arm's two collapses
    "r4": ("R3", "int4", 120, 80),
    "r5": ("none", "int4", 95, 80),  # ends 14 steps after its drop
    "r6": ("none", "none", 120, None),
    "r7": ("R3", "int4", 120, None),
    "r8": ("none", "int4", 120, None),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("collapse")
    for seed, (name, (mode, quant, steps, drop)) in enumerate(RUNS.items()):
        write_run(root, name, mode=mode, engine_quant=quant, steps=steps, drop=drop, seed=seed)
    return load_runs(root)


def _curves(fig):
    return {t.name: t for t in fig.data if t.showlegend is not False}


def test_the_survival_curves_are_the_kaplan_meier_worked_by_hand(runs):
    fig = collapse_survival_figure(runs)
    curves = _curves(fig)
    # none, int4: collapses at 60 and 80; censored at 70 and 119. At 60, 4 at risk: 3/4; at 80, 2 at risk (the run
    # censored at 70 has left): 3/4 * 1/2 = 3/8 (the naive share without a collapse would say 2/4)
    a = curves["none, int4 engine (4 runs, 2 collapsed)"]
    assert list(a.x) == [0, 60, 80, 119] and list(a.y) == pytest.approx([1.0, 0.75, 0.375, 0.375])
    # R3, int4: a collapse at 80 of 3 at risk; two censored at 119
    b = curves["R3, int4 engine (3 runs, 1 collapsed)"]
    assert list(b.x) == [0, 80, 119] and list(b.y) == pytest.approx([1.0, 2 / 3, 2 / 3])
    # none with the unquantised (bf16) engine: no collapse, flat at 1 to the last step
    c = curves["none, bf16 engine (2 runs, 0 collapsed)"]
    assert list(c.x) == [0, 119] and list(c.y) == [1.0, 1.0]
    assert len(curves) == 3
    for t in curves.values():
        assert t.line.shape == "hv"  # a step function: the survival holds until the next collapse
    assert (a.line.color, b.line.color, c.line.color) == (MODE_COLORS["none"], MODE_COLORS["R3"], MODE_COLORS["none"])
    assert a.line.dash != c.line.dash  # the two arms of one mode told apart by their engine


def test_censored_runs_are_ticks_at_their_last_step_on_the_curve(runs):
    fig = collapse_survival_figure(runs)
    ticks = {t.legendgroup: t for t in fig.data if t.showlegend is False}
    a = ticks["none, int4 engine"]
    assert sorted(zip(a.x, a.y, a.customdata, strict=True)) == [(70, 0.75, "r3"), (119, 0.375, "r8")]
    assert a.marker.symbol == "line-ns-open"
    b = ticks["R3, int4 engine"]
    assert sorted(b.customdata) == ["r0", "r7"] and list(b.x) == [119, 119] and b.y == pytest.approx((2 / 3, 2 / 3))
    assert sorted(ticks["none, bf16 engine"].customdata) == ["r2", "r6"]
    assert "censored" in fig.layout.title.subtitle.text


def test_the_k3_traces_are_aligned_at_each_drop(runs):
    fig = collapse_k3_figure(runs, before=30, after=10)
    assert len(fig.data) == 3  # the three runs that collapsed; the six others are not drawn
    by_run = {t.hovertemplate.split(" ", 1)[0]: t for t in fig.data}
    assert sorted(by_run) == ["r1", "r4", "r5"]
    for name, drop in (("r1", 60), ("r4", 80), ("r5", 80)):
        t = by_run[name]
        assert list(t.x) == list(range(-30, 11))
        assert list(t.y) == pytest.approx([k3_at(drop + o) for o in range(-30, 11)])
    assert {t.line.color for n, t in by_run.items() if n != "r4"} == {MODE_COLORS["none"]}
    assert by_run["r4"].line.color == MODE_COLORS["R3"]
    assert fig.layout.yaxis.type == "log"
    assert [(s.x0, s.x1) for s in fig.layout.shapes] == [(0, 0)]  # the drop marked at x = 0
    assert "3 of 9 runs collapsed" in fig.layout.title.text
    assert sum(t.showlegend is not False for t in fig.data) == 2  # one legend entry per arm


def test_the_k3_traces_stop_where_the_run_starts_or_ends(runs):
    fig = collapse_k3_figure(runs, before=70, after=20)
    by_run = {t.hovertemplate.split(" ", 1)[0]: t for t in fig.data}
    assert list(by_run["r1"].x) == list(range(-60, 21))  # drop 60: step 0 is 60 before it
    assert list(by_run["r5"].x) == list(range(-70, 15))  # 95 steps: the last, 94, is 14 after its drop at 80
    assert by_run["r5"].y[-1] == pytest.approx(k3_at(94)) and by_run["r1"].y[0] == pytest.approx(k3_at(0))


def test_a_set_without_a_collapse_says_so(runs):
    calm = [r for r in runs if r.name in ("r2", "r6", "r0")]
    fig = collapse_k3_figure(calm)
    assert len(fig.data) == 0
    assert "none of the 3 runs collapsed" in fig.layout.title.text
    assert any("no late collapse" in a.text for a in fig.layout.annotations)
    survival = collapse_survival_figure(calm)
    assert all(list(t.y) == [1.0] * len(t.y) for t in survival.data)


def test_bad_input_is_refused_with_a_reason(runs, tmp_path):
    with pytest.raises(R3LabError, match="no runs to draw"):
        collapse_survival_figure([])
    with pytest.raises(R3LabError, match="whole numbers of steps >= 0"):
        collapse_k3_figure(runs, before=-1)
    with RunWriter(tmp_path, "d", "drift", {"models": ["tiny-qwen3-moe"]}) as w:
        w.log_step({"step": 0})
        w.finish({})
    with pytest.raises(R3LabError, match="not an RL run"):
        collapse_survival_figure(load_runs(tmp_path))


def test_the_committed_runs_draw_one_curve_per_arm():
    folder = RESULTS / "collapse"
    arms = set()
    drops = 0
    for cfg_file in folder.glob("*/config.json"):  # read apart from r3lab's reader: the arms the configs hold
        cfg = json.loads(cfg_file.read_text())["config"]
        arms.add((cfg["mode"], cfg["engine_quant"]))
    runs = load_runs(folder)
    fig = collapse_survival_figure(runs)
    curves = _curves(fig)
    assert len(curves) == len(arms) >= 2
    for mode, quant in arms:
        engine = quant if quant != "none" else "bf16"
        assert sum(n.startswith(f"{mode}, {engine} engine (") for n in curves) == 1, (mode, quant, list(curves))
    assert sum(int(n.split(" runs, ")[0].rsplit("(", 1)[1]) for n in curves) == len(runs)
    for n, t in curves.items():
        drops += int(n.split(" runs, ")[1].split(" ")[0])
        assert t.y[0] == 1.0 and all(np.diff(t.y) <= 0) and t.x[-1] == 399  # 400-step runs, censored at the last
    k3 = collapse_k3_figure(runs)
    assert len(k3.data) == drops


def test_the_paper_figures_hold_the_collapse_figures_and_a_missing_folder_is_named(tmp_path):
    from r3lab.viz import paper_figure_set

    results = tmp_path / "results"
    results.mkdir()
    for entry in RESULTS.iterdir():  # the committed results, linked, less the collapse runs
        if entry.name != "collapse":
            (results / entry.name).symlink_to(entry)
    with pytest.raises(R3LabError, match=r"collapse is missing: `python bench/bench_collapse.py --work DIR`"):
        paper_figure_set(results)
    (results / "collapse" / "broken").mkdir(parents=True)
    (results / "collapse" / "broken" / "config.json").write_text("{")
    with pytest.raises(R3LabError, match=r"unreadable collapse-experiment runs \(`python bench/bench_collapse.py"):
        paper_figure_set(results)
    (results / "collapse" / "broken" / "config.json").unlink()
    (results / "collapse" / "broken").rmdir()
    for run in (RESULTS / "collapse").iterdir():
        if run.is_dir():
            (results / "collapse" / run.name).symlink_to(run)
    figures = paper_figure_set(results)
    assert list(figures)[-2:] == ["collapse_survival", "collapse_k3"]
    want = collapse_survival_figure(load_runs(RESULTS / "collapse"))
    assert [(t.name, list(t.x), list(t.y)) for t in figures["collapse_survival"].data] == [
        (t.name, list(t.x), list(t.y)) for t in want.data]
