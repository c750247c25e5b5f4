import pytest

from r3lab.viz import transport_figure

RECORDS = [
    {"workload": w, "popularity": p, "method": m, "bytes_per_id": b}
    for w in ("64e top-8", "512e top-22")
    for p in ("uniform", "skewed")
    for m, b in (("compact + base64 + orjson", 1.333), ("r3lab topk-set", 0.516))
]


def test_transport_figure_has_one_bar_trace_per_method():
    fig = transport_figure(RECORDS)
    assert [t.name for t in fig.data] == ["compact + base64 + orjson", "r3lab topk-set"]
    assert list(fig.data[1].y) == [0.516, 0.516] and list(fig.data[0].x) == ["64e top-8", "512e top-22"]
    assert "uniform" in fig.layout.title.text


def test_transport_figure_refuses_missing_popularity():
    with pytest.raises(ValueError, match="popularity='bursty'"):
        transport_figure(RECORDS, popularity="bursty")


def test_rl_curves_from_the_committed_reference_runs():
    from pathlib import Path

    import numpy as np

    from r3lab.errors import R3LabError
    from r3lab.runs import list_runs
    from r3lab.viz import MODE_COLORS, rl_curves_figure

    root = Path(__file__).resolve().parent.parent / "bench" / "results" / "rl"
    runs = [r for _, r in list_runs(root) if r.name.startswith("tiny-qwen3-moe-default-")]
    assert len(runs) == 9
    fig = rl_curves_figure(runs)
    lines = [t for t in fig.data if t.mode == "lines"]
    assert [t.name for t in lines] == ["none (3 seeds)", "R2 (3 seeds)", "R3 (3 seeds)"]
    assert [t.line.color for t in lines] == [MODE_COLORS[m] for m in ("none", "R2", "R3")]
    want = np.median([[s["mismatch/k3_kl"] for s in r.step_records] for r in runs if r.config["mode"] == "R3"], 0)
    np.testing.assert_allclose(lines[2].y, want)
    assert fig.layout.yaxis.type == "log" and fig.layout.template.layout.font.size == 13
    assert rl_curves_figure(runs, "reward_mean").layout.yaxis.type == "linear"
    with pytest.raises(R3LabError, match="no values"):
        rl_curves_figure(runs, "no/such_metric")


def test_expert_load_and_drift_figures(tmp_path):
    import numpy as np
    from conftest import random_routes

    from r3lab.errors import R3LabError
    from r3lab.runs import RunWriter, load
    from r3lab.viz import drift_figure, expert_load_figure

    rng = np.random.default_rng(0)
    a = random_routes(rng, num_experts=8, top_k=2, num_layers=3, lengths=[20, 30], layer_ids=[1, 2, 3])
    b = random_routes(rng, num_experts=8, top_k=2, num_layers=3, lengths=[20, 30], layer_ids=[1, 2, 3])
    fig = expert_load_figure(a)
    z = np.array(fig.data[0].z)
    assert z.shape == (3, 8) and np.allclose(z.sum(axis=1), 1.0) and list(fig.data[0].y) == ["layer 1", "layer 2",
                                                                                              "layer 3"]
    diff = np.array(expert_load_figure(a, reference=b).data[0].z)
    assert np.allclose(diff.sum(axis=1), 0.0) and np.abs(diff).max() > 0
    with pytest.raises(R3LabError, match="differ"):
        expert_load_figure(a, reference=a.select_layers([1, 2]))
    with RunWriter(tmp_path, "d", "drift", {}) as w:
        for i, (seed, k3n, k3r) in enumerate(((0, 2e-4, 7e-5), (1, 1e-4, 6e-5), (2, 3e-4, 5e-5))):
            w.log_step({"step": i, "model": "m", "trainer_dtype": "float32", "seed": seed, "k3_none": k3n,
                        "k3_r3": k3r, "k3_flipped_none": 10 * k3n, "k3_flipped_r3": k3r})
        w.finish({})
    fig = drift_figure(load(tmp_path / "d"))
    assert [t.name for t in fig.data][:2] == ["none", "R3"]
    assert list(fig.data[0].y) == [2e-4] and list(fig.data[0].error_y.array) == pytest.approx([1e-4])
    assert list(fig.data[1].error_y.arrayminus) == pytest.approx([1e-5])
