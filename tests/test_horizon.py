"""The long-horizon numbers (r3lab.metrics trend / spike / seed statistics, r3lab.runs.horizon) on hand-made series
and on small runs written to a temporary folder, against hand-computed values and scipy as an independent oracle."""

import math

import numpy as np
import pytest

from r3lab.config import RLConfig
from r3lab.errors import R3LabError
from r3lab.metrics import (
    bootstrap_mean_diff,
    k3_trend,
    late_collapse,
    mann_whitney_exact,
    reward_collapse,
    spike_aftermath,
    spike_steps,
)
from r3lab.runs.horizon import HORIZON_BASE


def test_k3_trend_by_hand():
    k3 = np.concatenate([np.full(50, 1e-4), np.full(50, 1e-3)])
    t = k3_trend(k3, window=50)
    assert t.first == pytest.approx(1e-4) and t.last == pytest.approx(1e-3) and t.ratio == pytest.approx(10.0)
    # a geometric series growing 10x per 100 steps has slope exactly 1 (log10 per 100 steps)
    g = 1e-4 * 10 ** (np.arange(200) / 100)
    assert k3_trend(g, window=50).slope == pytest.approx(1.0)
    assert k3_trend(np.full(100, 2e-4)).slope == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(R3LabError, match="2 x window"):
        k3_trend(np.ones(99), window=50)


def test_spikes_and_their_aftermath_by_hand():
    k3 = np.full(30, 1e-4)
    k3[[5, 20]] = [5e-3, 2e-3]  # 50x and 20x the median
    k3[10] = 9e-4  # 9x: not a spike
    assert spike_steps(k3).tolist() == [5, 20]
    assert spike_steps(k3, factor=5).tolist() == [5, 10, 20]
    grad = np.zeros(30)
    grad[6:16] = 1.0  # the 10 steps after step 5
    after = spike_aftermath(np.array([5, 20]), {"grad": grad}, horizon=10)
    # spike 5 -> mean 1 over steps 6..15; spike 20 -> mean 0 over 21..29; minus the run mean 10/30
    assert after["grad"] == pytest.approx(0.5 - 1 / 3)
    assert math.isnan(spike_aftermath(np.array([29]), {"g": grad})["g"])  # nothing after the last step
    assert math.isnan(spike_aftermath(np.zeros(0, dtype=int), {"g": grad})["g"])
    with pytest.raises(R3LabError, match="outside"):
        spike_aftermath(np.array([40]), {"g": grad})


def test_late_collapse_waits_past_the_noisy_start():
    r = np.full(200, 0.3)
    r[12:20] = 0.1  # an early dip, 8 steps below half the peak: the short detector fires, the late one does not
    r[5] = 0.4
    assert reward_collapse(r).step == 12
    assert late_collapse(r).step is None
    r2 = r.copy()
    r2[120:] = 0.05  # the late one fires on a collapse after step 50, at its first step
    assert late_collapse(r2).step == 120


def test_mann_whitney_exact_by_hand_and_the_three_seed_floor():
    a, b = np.array([0.9, 0.8, 0.7]), np.array([0.1, 0.2, 0.3])
    u, p = mann_whitney_exact(a, b)
    assert u == 9 and p == pytest.approx(0.1)  # complete separation of 3 vs 3: 2 of 20 splits, the floor
    # 2 vs 2 by hand: the 6 splits of ranks {1,2,3,4} have U = 0, 1, 2, 2, 3, 4 (centre 2)
    assert mann_whitney_exact(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == (4.0, pytest.approx(2 / 6))
    assert mann_whitney_exact(np.array([1.0, 3.0]), np.array([2.0, 4.0])) == (1.0, pytest.approx(4 / 6))
    assert mann_whitney_exact(np.array([1.0, 4.0]), np.array([2.0, 3.0])) == (2.0, pytest.approx(1.0))
    assert mann_whitney_exact(np.array([1.0, 1.0]), np.array([1.0, 1.0]))[1] == pytest.approx(1.0)


def test_bootstrap_mean_diff_brackets_the_difference():
    d, lo, hi = bootstrap_mean_diff(np.array([1.0, 2.0, 3.0]), np.array([0.0, 0.0, 0.0]))
    assert d == pytest.approx(2.0) and 1.0 <= lo <= d <= hi <= 3.0
    d, lo, hi = bootstrap_mean_diff(np.array([5.0]), np.array([2.0]))
    assert (d, lo, hi) == (3.0, 3.0, 3.0)  # nothing to resample
    with pytest.raises(R3LabError, match="finite"):
        bootstrap_mean_diff(np.array([np.nan]), np.array([1.0]))


def _write_run(root, name, cfg, rewards, k3):
    from r3lab.runs import RunWriter

    w = RunWriter(root, name, "rl", cfg.to_dict())
    for i, (r, k) in enumerate(zip(rewards, k3, strict=True)):
        w.log_step({"step": i, "reward_mean": float(r), "mismatch/k3_kl": float(k), "train/grad_norm": 1.0,
                      "mismatch/is_eff_sample_size": 0.99, "train/clip_frac": 0.1, "time_step_s": 0.5})
    w.finish({"steps": len(rewards)})
    w.close()


def test_horizon_table_from_runs_on_disk(tmp_path):
    from r3lab.runs import list_runs
    from r3lab.runs.horizon import horizon_bands, horizon_record, horizon_setting, horizon_table

    base = RLConfig.quick(**HORIZON_BASE, steps=120, engine_quant="int4", noise_every=0)
    k3 = np.full(120, 1e-4)
    k3[60:] = 4e-4
    k3[30] = 5e-3
    for seed in (0, 1, 2):
        for mode in ("none", "R3"):
            cfg = RLConfig.from_dict({**base.to_dict(), "mode": mode, "seed": seed})
            rw = np.linspace(0.1, 0.5, 120) + (0.1 if mode == "R3" else 0.0) + 0.01 * seed
            _write_run(tmp_path, f"int4-{mode}-s{seed}", cfg, rw, k3)
    search = RLConfig.from_dict({**base.to_dict(), "mode": "none", "lr": 1e-2})
    _write_run(tmp_path, "search-lr", search, np.r_[np.full(60, 0.5), np.full(60, 0.01)], k3)
    runs = [r for _, r in list_runs(tmp_path)]
    rec = horizon_record(next(r for r in runs if r.name == "int4-none-s0"))
    assert rec["k3_first"] == pytest.approx(1e-4) and rec["k3_last"] == pytest.approx(4e-4)
    assert rec["k3_ratio"] == pytest.approx(4.0) and rec["spikes"] == 1 and rec["spike_steps"] == [30]
    assert rec["curve"][0] == pytest.approx(np.linspace(0.1, 0.5, 120)[:10].mean())
    assert rec["collapse_step"] is None and rec["late_collapse_step"] is None
    assert horizon_setting(search.to_dict()) == "lr=0.01"
    ladder = {**search.to_dict(), "task": "ladder", "lr": 3e-3, "max_tokens": 16}  # the earlier sweep's runs
    assert horizon_setting(ladder) == "task=ladder, lr=0.003, max_tokens=16"
    lr = horizon_record(next(r for r in runs if r.name == "search-lr"))
    assert lr["collapse_step"] == 60 and lr["late_collapse_step"] == 60
    bands = horizon_bands(runs, "reward_mean")
    assert bands["int4 R3"]["seeds"] == 3
    assert bands["int4 R3"]["median"][0] == pytest.approx(0.21) and bands["int4 R3"]["hi"][0] == pytest.approx(0.22)
    table = horizon_table(runs, header="h")
    assert "| int4 | base | R3 | 3 |" in table and "| int4 | lr=0.01 | none | 1 |" in table
    assert "| int4 | R3 - none | reward_last50 | 3 vs 3 | +0.1 |" in table and "| 0.10 |" in table


def test_horizon_figure_gives_each_aftermath_series_its_own_axis(tmp_path):
    """A grad norm of 1e5 after a spike must not flatten the ESS / clip / reward changes: each series of the
    aftermath is drawn in its own panel (its own y axis), and the shared step axis is titled once."""
    from r3lab.runs import list_runs
    from r3lab.runs.horizon import AFTERMATH_SERIES
    from r3lab.viz.horizon import horizon_figure

    base = RLConfig.quick(**HORIZON_BASE, steps=60, engine_quant="int4", noise_every=0)
    k3 = np.full(60, 1e-4)
    k3[20] = 5e-2
    for mode in ("none", "R3"):
        _write_run(tmp_path, f"int4-{mode}-s0", RLConfig.from_dict({**base.to_dict(), "mode": mode}),
                   np.linspace(0.1, 0.5, 60), k3)
    fig = horizon_figure([r for _, r in list_runs(tmp_path)])
    points = [t for t in fig.data if t.mode == "markers"]
    assert len(points) == 2 * len(AFTERMATH_SERIES)  # one point per run per series
    axes = {}
    for t in points:
        axes.setdefault(t.yaxis, set()).add(t.hovertemplate.split(": ", 1)[1].split(" ")[0])
    assert sorted(len(v) for v in axes.values()) == [1] * len(AFTERMATH_SERIES)  # one series per y axis
    assert {next(iter(v)) for v in axes.values()} == set(AFTERMATH_SERIES)
    titles = [fig.layout[k].title.text for k in fig.layout if k.startswith("xaxis") and fig.layout[k].title.text]
    assert titles.count("step") == 1
    assert fig.layout.legend.y > -0.1  # the legend sits right below the panels, no empty band above it


def test_the_sweeps_base_config_is_the_tables_base():
    """bench_horizon's runs and the table's ``base`` row are one setting: a run of the plan's base sweep must read
    as ``base``, and every search run as exactly the fields its setting changes."""
    import sys
    from pathlib import Path

    from r3lab.runs.horizon import horizon_setting

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    try:
        import bench_horizon
    finally:
        sys.path.pop(0)
    plan = bench_horizon.plan()
    for name, cfg in plan.items():
        setting = horizon_setting(cfg.to_dict())
        if name.startswith("search-"):
            key = name.removeprefix("search-").rsplit("-", 2)[0]
            want = ", ".join(f"{k}={v}" for k, v in bench_horizon.SEARCH[key].items() if k in HORIZON_BASE)
            assert setting == want, name
        else:
            assert setting == "base", name


def test_the_sweep_figure_draws_the_base_setting_and_the_search_figure_every_other(tmp_path):
    """The sweep's figure draws only the base setting's runs (a search run's curve among the seed bands would
    read as a seed); the search figure draws one row per setting tried, none of the base's, and a request for a
    setting no run has is an error naming the settings there are."""
    from r3lab.runs import list_runs
    from r3lab.viz.horizon import horizon_figure, horizon_search_figure

    base = RLConfig.quick(**HORIZON_BASE, steps=40, engine_quant="int4", noise_every=0)
    k3 = np.full(40, 1e-4)
    for mode in ("none", "R3"):
        _write_run(tmp_path, f"int4-{mode}-s0", RLConfig.from_dict({**base.to_dict(), "mode": mode}),
                   np.linspace(0.1, 0.5, 40), k3)
        for name, change in (("lr", {"lr": 1e-2}), ("long", {"max_tokens": 64})):
            _write_run(tmp_path, f"search-{name}-{mode}-s0",
                       RLConfig.from_dict({**base.to_dict(), "mode": mode, **change}), np.full(40, 0.3), k3 * 10)
    runs = [r for _, r in list_runs(tmp_path)]
    sweep = horizon_figure(runs)
    lines = {t.name for t in sweep.data if t.mode == "lines" and t.name}
    assert lines == {"int4 none (1 seed)", "int4 R3 (1 seed)"}
    assert {t.name for t in sweep.data if t.mode == "markers"} == {"int4-none-s0", "int4-R3-s0"}
    assert len([t for t in horizon_figure(runs, setting=None).data if t.mode == "lines"]) == 2 * 2 * 3
    search = horizon_search_figure(runs)
    titles = [a.text for a in search.layout.annotations]
    assert {"lr=0.01: k3", "lr=0.01: reward", "max_tokens=64: k3", "max_tokens=64: reward"} <= set(titles)
    assert not any(t.startswith("base") for t in titles)
    k3_lines = [t for t in search.data if t.mode == "lines" and t.yaxis in ("y", "y3")]
    assert len(k3_lines) == 4 and all(np.allclose(t.y, 1e-3) for t in k3_lines)  # the search runs' k3, not the base's
    with pytest.raises(R3LabError, match=r"no runs of the setting 'lr=1' among 6 runs .*'base'"):
        horizon_figure(runs, setting="lr=1")
    base_only = [r for r in runs if r.name.startswith("int4")]
    with pytest.raises(R3LabError, match="no collapse-search runs among 2 runs"):
        horizon_search_figure(base_only)
