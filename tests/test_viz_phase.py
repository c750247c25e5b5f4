"""The phase diagram's figures (r3lab.viz.phase) and key numbers (r3lab.runs.phase.phase_summary), from tiny RL
runs written here with RunWriter: medians and min - max spreads against numpy on the numbers written, collapsed
seeds and one's own runs marked apart, the staleness figure's matched-weights panels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from r3lab.config import RLConfig, RLMetric
from r3lab.errors import R3LabError
from r3lab.runs import RunWriter, load_runs
from r3lab.runs.phase import LAST_STEPS, PHASE_OBJECTIVES, phase_records, phase_summary
from r3lab.viz import OBJECTIVE_STYLES, phase_figure, staleness_figure

STEPS = 5


def write_phase_run(root: Path, name: str, *, model: str = "tiny-qwen3-moe", engine_quant: str = "none",
                    objective: str = "none", seed: int = 0, staleness: int = 0, reward: float = 0.3,
                    k3: float = 1e-4, matched: bool = False, lag: float = 0.0,
                    collapse_step: int | None = None) -> None:
    """One finished RL run as the loop writes it: the config of an objective, steps with constant metrics
    (reward ``reward`` on the last steps, k3 ``k3``; at ``matched`` weights also the policy lag ``lag``)."""
    cfg = RLConfig.quick(model=model, engine_quant=engine_quant, seed=seed, steps=STEPS, staleness=staleness,
                         old_logprobs="behaviour" if matched else "current", **PHASE_OBJECTIVES[objective])
    with RunWriter(root, name, "rl", cfg.to_dict()) as w:
        for step in range(STEPS):
            rec = {"step": step, RLMetric.REWARD: 0.0 if step < STEPS - LAST_STEPS else reward, RLMetric.K3_KL: k3,
                   RLMetric.F_2: 0.01, RLMetric.ABS_DIFF_MAX: 0.5, RLMetric.ENGINE_TRAINER_DISAGREEMENT: 0.02,
                   RLMetric.CLIP_FRAC_MAX: 0.1, RLMetric.IS_ESS: 0.99}
            if cfg.old_logprobs == "behaviour":
                rec |= {RLMetric.K3_POLICY_LAG: lag, RLMetric.K3_ENGINE_CURRENT: k3 + lag}
            w.log_step(rec)
        w.finish({"steps": STEPS, RLMetric.COLLAPSE_STEP: collapse_step})


# the grid written by grid_runs: (engine_quant, objective) -> rewards and k3 of seeds 0, 1, 2
REWARDS = {("none", "none"): [0.30, 0.50, 0.40], ("int4", "none"): [0.10, 0.35, 0.20],
           ("none", "R3"): [0.45, 0.42, 0.48], ("int4", "R3"): [0.41, 0.44, 0.40]}
K3 = {("none", "none"): [2e-4, 1e-4, 3e-4], ("int4", "none"): [4e-3, 2e-3, 1e-3],
      ("none", "R3"): [5e-5, 6e-5, 4e-5], ("int4", "R3"): [3e-4, 2e-4, 4e-4]}


def grid_runs(root: Path) -> Path:
    """Two precisions x two objectives x three seeds of one model (int4 written first: the figure orders them),
    seed 1 of none at int4 collapsed at step 3, plus staleness 0 / 2 at matched weights for none and R3."""
    for (quant, obj), rewards in sorted(REWARDS.items(), reverse=True):
        for seed, (r, k) in enumerate(zip(rewards, K3[quant, obj], strict=True)):
            write_phase_run(root, f"q-{quant}-{obj}-s{seed}", engine_quant=quant, objective=obj, seed=seed, reward=r,
                            k3=k, collapse_step=3 if (quant, obj, seed) == ("int4", "none", 1) else None)
    for st in (0, 2):
        for mode in ("none", "R3"):
            for seed in (0, 1):
                write_phase_run(root, f"q-stale{st}-{mode}-s{seed}", engine_quant="fp8", objective=mode, seed=seed,
                                staleness=st, reward=0.2 + 0.1 * seed, matched=True,
                                k3=(2e-4 if mode == "none" else 5e-5) * (1 + seed), lag=0.1 * (1 + seed) * (st > 0))
    return root


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return phase_records(load_runs(grid_runs(tmp_path_factory.mktemp("phase"))))


def _sub(fig) -> str:
    """The subtitle as one line (finish wraps it to the figure's width)."""
    return fig.layout.title.subtitle.text.replace("<br>", " ")


def _trace(fig, name: str, row: int):
    axis = "y" if row == 1 else f"y{row}"
    (t,) = [t for t in fig.data if t.name == name and (t.yaxis or "y") == axis]
    return t


def test_phase_figure_draws_medians_and_min_max_over_seeds_in_precision_order(records):
    fig = phase_figure(records)
    assert [t.name for t in fig.data if t.showlegend is not False] == ["none", "collapsed seed (x)", "R3"]
    for obj in ("none", "R3"):
        for row, table in ((1, REWARDS), (2, K3)):
            t = _trace(fig, obj, row)
            assert list(t.x) == ["none", "int4"]  # the dial's order, whatever order the runs came in
            vals = np.array([table["none", obj], table["int4", obj]])
            med = np.median(vals, axis=1)
            np.testing.assert_allclose(t.y, med, rtol=1e-12)
            np.testing.assert_allclose(t.error_y.array, vals.max(1) - med, rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(t.error_y.arrayminus, med - vals.min(1), rtol=1e-12, atol=1e-15)
            assert list(t.customdata) == [3, 3]
            assert t.line.color == OBJECTIVE_STYLES[obj][0]
    assert fig.layout.yaxis2.type == "log" and fig.layout.yaxis.type == "linear"
    assert list(fig.layout.xaxis.categoryarray) == ["none", "int4"]
    assert "median over 3 seeds" in _sub(fig)


def test_phase_figure_marks_each_collapsed_seed_at_its_own_values(records):
    fig = phase_figure(records)
    marks = [t for t in fig.data if t.name == "collapsed seed (x)"]
    assert len(marks) == 2  # the reward row and the k3 row of the one collapsed seed
    assert [len(t.y) for t in marks] == [1, 1]  # the mean of the last steps' constant reward: to rounding
    np.testing.assert_allclose([t.y[0] for t in marks], [REWARDS["int4", "none"][1], K3["int4", "none"][1]], rtol=1e-12)
    assert list(marks[0].x) == ["int4"] and marks[0].offsetgroup == "none"
    assert list(marks[0].customdata[0]) == [1, 3, "none"]  # seed, collapse step, objective
    assert "1 of 12 runs collapsed" in _sub(fig)
    quiet = phase_figure([r for r in records if r["collapse_step"] is None])
    assert not [t for t in quiet.data if "collapsed" in (t.name or "")]
    assert "no run collapsed (11 runs" in _sub(quiet)


def test_own_runs_are_stars_beside_the_medians_never_in_them(records):
    own = dict(records[0], run="mine", engine_quant="int8", reward_final=0.9, k3=7e-3, steps=2)
    fig = phase_figure(records, highlight=[own])
    stars = [t for t in fig.data if t.marker.symbol == "star"]
    assert [list(t.y) for t in stars] == [[0.9], [7e-3]] and list(stars[0].x) == ["int8"]  # the record's own
    assert stars[0].name.startswith("your run: mine")
    assert list(fig.layout.xaxis.categoryarray) == ["none", "int8", "int4"]
    t = _trace(fig, own["objective"], 1)
    assert list(t.x) == ["none", "int8", "int4"] and np.isnan(t.y[1])  # no committed run at int8: a gap
    np.testing.assert_allclose(np.delete(np.asarray(t.y, float), 1), _trace(phase_figure(records), own["objective"],
                                                                            1).y)
    alone = phase_figure([], highlight=[own])  # no committed records: the user's run still draws
    assert [t.marker.symbol for t in alone.data] == ["star", "star"]


def test_phase_figure_refuses_what_it_cannot_draw(records):
    with pytest.raises(R3LabError, match="no phase-diagram records"):
        phase_figure([r for r in records if r["staleness"]])
    with pytest.raises(R3LabError, match=r"\['fp4'\] are not on the dial"):
        phase_figure([dict(records[0], engine_quant="fp4")])


def test_staleness_figure_separates_the_matched_mismatch_from_the_policy_lag(records):
    fig = staleness_figure(records)
    for mode, k3 in (("none", 2e-4), ("R3", 5e-5)):
        (mismatch, lag, reward) = [t for t in fig.data if t.name == mode]
        assert list(mismatch.x) == [0, 2]
        np.testing.assert_allclose(mismatch.y, [np.median([k3, 2 * k3])] * 2)  # seeds 0, 1: k3 and 2 k3
        assert np.isnan(lag.y[0]) and lag.y[1] == pytest.approx(0.15)  # 0 at staleness 0: not drawn on a log axis
        np.testing.assert_allclose(reward.y, [0.25, 0.25])
        (current,) = [t for t in fig.data if t.name == f"{mode}, engine vs current weights"]
        np.testing.assert_allclose(current.y, [1.5 * k3, 1.5 * k3 + 0.15])
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log" and fig.layout.yaxis3.type == "linear"
    assert "policy lag 0 at staleness 0" in _sub(fig)
    with pytest.raises(R3LabError, match="span"):
        staleness_figure([*records, *(dict(r, engine_quant="int4") for r in records if r["staleness"])])
    with pytest.raises(R3LabError, match="no staleness records"):
        staleness_figure([r for r in records if not r["staleness"] and r["old_logprobs"] == "current"])


def test_phase_summary_holds_the_medians_and_the_collapsed_seeds(records):
    table = phase_summary(records)
    assert list(table.index) == [("qwen3", "none"), ("qwen3", "R3")]
    assert table.loc[("qwen3", "none"), ("reward final", "int4")] == pytest.approx(0.20)
    assert table.loc[("qwen3", "R3"), ("k3", "none")] == pytest.approx(5e-5)
    assert table.loc[("qwen3", "none"), ("collapsed", "int4")] == "1/3"
    assert table.loc[("qwen3", "R3"), ("collapsed", "none")] == "0/3"
    assert [c[1] for c in table.columns[:2]] == ["none", "int4"]
    with pytest.raises(R3LabError, match="no summary number"):
        phase_summary(records, ["k3_typo"])


def test_r3w_phase_runs_take_only_the_r3w_runs(tmp_path):
    """The R3W sweep's folder also holds none and R3 runs of the diagram's own cells: only the R3W runs join the
    diagram (pooling the others would count those cells twice), and a folder without one is refused by name."""
    from r3lab.runs.phase import r3w_phase_runs

    for obj in ("none", "R3", "R3W"):
        write_phase_run(tmp_path, f"q-fp8-{obj}-s0", engine_quant="fp8", objective=obj, reward=0.3, k3=2e-4)
    runs = r3w_phase_runs(tmp_path)
    assert [r.name for r in runs] == ["q-fp8-R3W-s0"]
    (rec,) = phase_records(runs)
    assert rec["objective"] == "R3W" and rec["engine_quant"] == "fp8"
    committed = r3w_phase_runs()  # bench/results/r3w_rl: 3 seeds at fp8 and int4
    assert sorted((r.config["engine_quant"], r.config["seed"]) for r in committed) == [
        (q, s) for q in ("fp8", "int4") for s in (0, 1, 2)]
    empty = tmp_path / "empty"
    write_phase_run(empty, "q-none-s0", objective="none")
    with pytest.raises(R3LabError, match="holds no finished R3W run"):
        r3w_phase_runs(empty)
    with pytest.raises(R3LabError, match="no R3W runs at"):
        r3w_phase_runs(tmp_path / "missing")
