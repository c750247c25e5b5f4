import pytest

from r3lab.viz import transport_figure

RECORDS = [
    {"workload": w, "popularity": p, "method": m, "bytes_per_id": b}
    for w in ("64e top-8", "512e top-22")
    for p in ("uniform", "skewed")
    for m, b in (("compact + base64 + orjson", 1.333), ("r3lab topk-set", 0.516))
]


def test_transport_figure_has_one_bar_trace_per_method_in_the_shared_template():
    import plotly.io as pio

    from r3lab.viz import TEMPLATE

    fig = transport_figure(RECORDS)
    assert [t.name for t in fig.data] == ["compact + base64 + orjson", "r3lab topk-set"]
    assert list(fig.data[1].y) == [0.516, 0.516] and list(fig.data[0].x) == ["64e top-8", "512e top-22"]
    assert "uniform" in fig.layout.title.subtitle.text
    assert fig.layout.template == pio.templates[TEMPLATE]  # the paper template, as every other figure


def test_transport_figure_refuses_missing_popularity():
    from r3lab.errors import R3LabError

    with pytest.raises(R3LabError, match="popularity='bursty'"):
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


def _pair(seed=0, lengths=(6, 9), flip_share=0.3):
    """Engine routes and trainer routes that differ from them in a known set of (token, layer) cells."""
    import numpy as np
    from conftest import random_routes

    from r3lab.routes import Routes

    rng = np.random.default_rng(seed)
    eng = random_routes(rng, num_experts=8, top_k=2, num_layers=3, lengths=list(lengths), layer_ids=[1, 2, 3])
    vals = eng.values.copy()
    flip = rng.random(vals.shape[:2]) < flip_share
    for t, j in zip(*np.nonzero(flip), strict=True):
        other = [e for e in range(8) if e not in vals[t, j]]
        vals[t, j, 0] = other[0]  # one expert replaced: a different set
    swap = ~flip
    vals[swap] = vals[swap][:, ::-1]  # same set, other order: not a flip
    return eng, Routes(vals, eng.cu_seqlens, 8, eng.layer_ids), flip


def test_route_view_highlights_exactly_the_cells_whose_expert_sets_differ():
    import numpy as np

    from r3lab.errors import R3LabError
    from r3lab.viz import FLIP_COLOR, route_view_figure

    eng, own, flip = _pair()
    words = [f"w{t}" for t in range(10)]  # sample 1 has 9 route rows: the last token has none
    fig = route_view_figure(eng, own, sample=1, tokens=words)
    hm = fig.data[0]
    np.testing.assert_array_equal(np.array(hm.z), flip[6:15].T.astype(int))
    assert hm.colorscale[1][1] == FLIP_COLOR and hm.zmin == 0 and hm.zmax == 1
    row = eng.sequence(1)
    assert hm.text[2][4] == " ".join(str(e) for e in sorted(row[4, 2]))  # layer 3, token 4: sorted engine ids
    assert "'w4'" in hm.hovertext[2][4] and list(hm.y) == ["layer 1", "layer 2", "layer 3"]
    flipped_hover = [h for line in hm.hovertext for h in line if "differs" in h]
    assert len(flipped_hover) == int(flip[6:15].sum())
    assert f"{int(flip[6:15].sum())} of 27" in fig.layout.title.subtitle.text
    window = route_view_figure(eng, own, sample=1, tokens=words, start=2, stop=5)
    np.testing.assert_array_equal(np.array(window.data[0].z), flip[8:11].T.astype(int))
    assert np.array(route_view_figure(eng, sample=0).data[0].z).sum() == 0  # engine only: nothing highlighted
    marked = route_view_figure(eng, own, sample=1, prompt_len=4, start=2)
    assert [sh.x0 for sh in marked.layout.shapes] == [1.5]  # between rows 3 and 4 of the window from row 2
    with pytest.raises(R3LabError, match="3 token strings for 9"):
        route_view_figure(eng, own, sample=1, tokens=words[:3])
    with pytest.raises(R3LabError, match="differ"):
        route_view_figure(eng, own.take([0]))
    from r3lab import metrics
    from r3lab.viz import most_flipped_sample

    assert most_flipped_sample(eng, own) == int(flip[6:].sum() > flip[:6].sum())
    assert most_flipped_sample(own.take([1, 0]), eng.take([1, 0])) == int(flip[6:].sum() < flip[:6].sum())
    assert metrics.most_flipped_sample(eng.values, own.values, eng.cu_seqlens) == most_flipped_sample(eng, own)


def test_codec_figure_from_measured_records():
    import numpy as np
    from conftest import random_routes

    from r3lab.compaction import BASELINE, measure_codecs
    from r3lab.errors import R3LabError
    from r3lab.viz import codec_figure

    r = random_routes(np.random.default_rng(1), num_experts=64, top_k=8, num_layers=4, lengths=[50, 70])
    recs = measure_codecs(r, ["raw", "topk-set+zstd"], repeats=1, label="a") + measure_codecs(
        r.take([0]), ["raw", "topk-set+zstd"], repeats=1, label="b")
    fig = codec_figure(recs)
    size = [t for t in fig.data if t.xaxis == "x"]
    speed = [t for t in fig.data if t.xaxis == "x2"]
    assert [t.name for t in size] == [BASELINE, "raw", "topk-set+zstd"] and len(speed) == 3
    assert list(size[1].x) == ["a", "b"] and list(size[1].y) == pytest.approx([recs[1]["bytes_per_id"],
                                                                                recs[4]["bytes_per_id"]])
    assert size[1].marker.color == speed[1].marker.color and fig.layout.yaxis.type != "log"  # sizes are bars: linear
    with pytest.raises(R3LabError, match="lack"):
        codec_figure([{"codec": "raw"}])


def test_expert_load_comparison_disagreement_and_imbalance_by_hand():
    import numpy as np

    from r3lab import metrics
    from r3lab.errors import R3LabError
    from r3lab.viz import MODE_COLORS, expert_load_comparison_figure, layer_disagreement_figure, load_imbalance_figure

    eng, own, flip = _pair(seed=2)
    fig = expert_load_comparison_figure(eng, own)
    a, b, d = (np.array(t.z) for t in fig.data)
    counts = np.zeros((3, 8))
    for t in range(eng.total_tokens):
        for j in range(3):
            for e in eng.values[t, j]:
                counts[j, e] += 1
    np.testing.assert_allclose(a, counts / (eng.total_tokens * 2))
    np.testing.assert_allclose(d, b - a)
    assert fig.data[2].zmid == 0 and fig.data[2].zmax == pytest.approx(np.abs(b - a).max())
    dis = layer_disagreement_figure(eng, own)
    np.testing.assert_allclose(dis.data[0].y, flip.mean(axis=0))
    np.testing.assert_allclose(dis.data[1].y, flip.mean(axis=0) / 2)  # one of two experts replaced
    imb = load_imbalance_figure({"engine": eng, "R3": own})
    np.testing.assert_allclose(imb.data[0].y, (a.max(1) - a.mean(1)) / a.mean(1))
    assert imb.data[1].line.color == MODE_COLORS["R3"] and list(imb.data[0].x) == [1, 2, 3]
    np.testing.assert_allclose(imb.data[1].y, metrics.max_violation(b))
    with pytest.raises(R3LabError, match="differ"):
        expert_load_comparison_figure(eng, own.select_layers([1, 2]))


def test_load_shift_over_rl_steps_per_mode(tmp_path):
    import numpy as np
    from conftest import random_routes

    from r3lab.errors import R3LabError
    from r3lab.runs import RunWriter, load
    from r3lab.viz import MODE_COLORS, load_shift_figure

    rng = np.random.default_rng(4)
    routes = {}
    for mode in ("R3", "none"):
        with RunWriter(tmp_path, mode, "rl", {"mode": mode}) as w:
            for step in range(3):
                routes[mode, step] = random_routes(rng, num_experts=4, top_k=1, num_layers=2, lengths=[40])
                w.write_routes(step, "engine", routes[mode, step])
                w.log_step({"step": step})
    runs = [load(tmp_path / m) for m in ("R3", "none")]
    fig = load_shift_figure(runs)
    assert [t.name for t in fig.data] == ["none (1 seed)", "R3 (1 seed)"]
    assert [t.line.color for t in fig.data] == [MODE_COLORS["none"], MODE_COLORS["R3"]]

    def share(r):  # expert load by hand: top-1, so the share of tokens per expert
        return np.stack([np.bincount(r.values[:, j, 0], minlength=4) / 40 for j in range(2)])

    want = [0.5 * np.abs(share(routes["R3", s]) - share(routes["R3", 0])).sum(1).mean() for s in range(3)]
    np.testing.assert_allclose(fig.data[1].y, want)
    assert list(fig.data[1].x) == [0, 1, 2] and fig.data[1].y[0] == 0
    with RunWriter(tmp_path, "one", "rl", {"mode": "R2"}) as w:
        w.write_routes(0, "engine", routes["R3", 0])
    with pytest.raises(R3LabError, match="token_steps=1"):
        load_shift_figure([load(tmp_path / "one")])


def test_drift_figures_show_the_hand_computed_numbers():
    import numpy as np

    from r3lab.errors import R3LabError
    from r3lab.viz import (
        MODE_COLORS,
        delta_histogram_figure,
        extreme_fraction_figure,
        flip_split_figure,
        layer_drift_figure,
        prob_density_figure,
    )

    inf = np.log(np.array([0.5, 0.25, 0.8, 0.1]))
    none = inf + np.array([0.0, np.log(3), -np.log(2.5), 0.01])
    r3 = inf + np.array([0.0, 0.01, -0.02, 0.0])
    modes = {"none": none, "R3": r3}
    dens = prob_density_figure(inf, modes, bins=4)
    heat = [t for t in dens.data if t.type == "heatmap"]
    # none: (0.5, 0.5) -> bin (2, 2); (0.25, 0.75) -> x bin 1, y bin 3; (0.8, 0.32) -> (3, 1); (0.1, 0.101) -> (0, 0)
    want = np.zeros((4, 4))
    for x, y in ((2, 2), (1, 3), (3, 1), (0, 0)):
        want[y, x] += 1
    np.testing.assert_array_equal(np.array(heat[0].customdata), want)
    diag = [t for t in dens.data if t.type == "scatter"]
    assert [t.line.color for t in diag] == [MODE_COLORS["none"], MODE_COLORS["R3"]]
    assert list(diag[0].x) == [0, 1] and list(diag[0].y) == [0, 1]

    ef = extreme_fraction_figure(inf, modes, floors={"engine": (inf + 0.001, inf)}, taus=[1.5, 2.0, 2.8])
    np.testing.assert_allclose(ef.data[0].y, [0.5, 0.5, 0.25])  # |d| = 0, log 3, log 2.5, 0.01
    np.testing.assert_allclose(ef.data[0].x, [0.5, 1.0, 1.8])  # tau - 1, on a log axis
    assert ef.layout.xaxis.type == "log"
    auto = extreme_fraction_figure(inf, modes).data[0]
    assert auto.x[0] == pytest.approx(1e-4) and auto.x[-1] == pytest.approx((3 - 1) * 1.2) and auto.y[-1] == 0
    np.testing.assert_allclose(ef.data[1].y, [0, 0, 0])
    # the floor is 0 at every tau: a log axis cannot draw it, and its legend entry says so in place
    assert ef.data[2].name == "floor: engine (0 at every τ: not drawn on the log axis)"
    assert ef.data[2].line.dash == "dash"
    assert ef.data[0].line.color == MODE_COLORS["none"]

    hist = delta_histogram_figure(inf, modes, bins=10)
    assert [int(np.sum(t.customdata)) // 2 for t in hist.data] == [4, 4]
    assert hist.data[1].line.color == MODE_COLORS["R3"]
    assert all(t.type == "scatter" for t in hist.data)  # a step outline: no bars on the log count axis

    flipped = np.array([False, True, True, False])
    split = flip_split_figure(inf, modes, flipped)
    d = none - inf
    k3 = np.expm1(d) - d
    np.testing.assert_allclose(split.data[0].y, [k3[1:3].mean(), k3[[0, 3]].mean(), k3.mean()])
    assert list(split.data[0].x) == ["route-flipped", "agreeing", "all"] and list(split.data[0].customdata) == [2, 2, 4]
    pair = flip_split_figure(None, {"none": (none[:2], inf[:2]), "R3": (r3, inf)}, {"none": flipped[:2], "R3": flipped})
    np.testing.assert_allclose(pair.data[0].y, [k3[1], k3[0], k3[:2].mean()])
    with pytest.raises(R3LabError, match="no engine log-probs"):
        flip_split_figure(None, modes, flipped)

    differs = np.array([[False, True], [True, False], [True, False], [False, False]])
    lay = layer_drift_figure(differs, inf, modes, layer_ids=[3, 5])
    np.testing.assert_allclose(lay.data[0].y, [0.5, 0.25])
    np.testing.assert_allclose(lay.data[1].y, [k3[1:3].mean(), k3[0]])
    np.testing.assert_allclose(lay.data[2].y, [k3[[0, 3]].mean(), k3[1:].mean()])
    assert list(lay.data[1].x) == ["layer 3", "layer 5"] and lay.data[3].marker.color == MODE_COLORS["R3"]

    with pytest.raises(R3LabError, match="shape"):
        prob_density_figure(inf, {"none": none[:2]})
    with pytest.raises(R3LabError, match="flipped has shape"):
        flip_split_figure(inf, modes, flipped[:3])
    with pytest.raises(R3LabError, match="no trainer"):
        delta_histogram_figure(inf, {})


def test_response_differs_maps_sampled_tokens_to_their_input_rows():
    import numpy as np

    from r3lab import metrics
    from r3lab.errors import R3LabError
    from r3lab.viz import response_differs

    eng, own, flip = _pair(lengths=(6, 9))
    # sample 0: 6 rows, 2 sampled tokens -> rows 4, 5; sample 1: 9 rows, 4 sampled -> rows 6+5 .. 6+8
    np.testing.assert_array_equal(response_differs(eng, own, [2, 4]), flip[[4, 5, 11, 12, 13, 14]])
    np.testing.assert_array_equal(metrics.response_differs(eng.values, own.values, eng.cu_seqlens, [2, 4]),
                                  flip[[4, 5, 11, 12, 13, 14]])  # the arrays' form, which the Routes form calls
    with pytest.raises(R3LabError, match="differ"):
        response_differs(eng, own.take([0]), [2])


def test_rl_token_logprobs_pools_each_modes_last_token_table(tmp_path):
    import numpy as np

    from r3lab.errors import R3LabError
    from r3lab.runs import RunWriter, load, rl_token_logprobs

    want = {}
    for mode, seed in (("R3", 0), ("none", 0), ("R3", 1)):
        with RunWriter(tmp_path, f"{mode}-{seed}", "rl", {"mode": mode, "seed": seed}) as w:
            for step in (0, 4):
                cols = {"logp_old": np.full(3, -step - seed - 0.5), "logp_infer": np.full(3, -1.0 * step),
                        "flipped": np.array([True, False, step == 4])}
                w.write_tokens(step, cols)
            want.setdefault(mode, []).append(cols)  # the last step's table
    runs = [load(p) for p in sorted(tmp_path.iterdir())]
    logps, flipped = rl_token_logprobs(runs)
    assert list(logps) == ["none", "R3"]  # none, R2, R3 order, whatever the runs' order
    for mode, tables in want.items():
        np.testing.assert_array_equal(logps[mode][0], np.concatenate([t["logp_old"] for t in tables]))
        np.testing.assert_array_equal(logps[mode][1], np.concatenate([t["logp_infer"] for t in tables]))
        np.testing.assert_array_equal(flipped[mode], np.concatenate([t["flipped"] for t in tables]))
    assert rl_token_logprobs(runs, step=0)[0]["none"][0].tolist() == [-0.5] * 3
    with pytest.raises(R3LabError, match="not at 2"):
        rl_token_logprobs(runs, step=2)
    with RunWriter(tmp_path, "d", "drift", {}) as w:
        w.write_tokens(0, {"logp_old": np.zeros(1)})
    with pytest.raises(R3LabError, match="is a 'drift' run, not an RL run"):
        rl_token_logprobs([load(tmp_path / "d")])


# --- ticks chosen from the data's range -------------------------------------------------------------------

@pytest.mark.parametrize("log", [False, True], ids=["linear", "log"])
@pytest.mark.parametrize("percent", [False, True], ids=["number", "percent"])
def test_tick_labels_are_distinct_and_read_back_over_1e_7_to_1e3(log, percent):
    import numpy as np

    from r3lab.viz import axis_ticks

    checked = 0
    for lo in np.geomspace(1e-7, 1e3, 31):
        for spread in (1.0005, 1.01, 1.3, 2, 7, 10, 300, 1e5, 1e9):
            hi = lo * spread
            if hi > 1e3 * 1.0001 and spread > 10:
                continue
            t = axis_ticks([lo, (lo + hi) / 2, hi], log=log, percent=percent)
            vals, text = t["tickvals"], t["ticktext"]
            assert len(vals) >= 2, (lo, hi, log, t)
            assert len(set(text)) == len(text), (lo, hi, log, percent, text)
            back = [float(s.rstrip("%")) / (100 if percent else 1) for s in text]  # each label reads as its value
            step = min(abs(b - a) for a, b in zip(vals, vals[1:], strict=False))
            for v, b in zip(vals, back, strict=True):
                assert abs(b - v) <= (1e-6 * v if log else 1e-6 * step), (v, b, text)
            checked += 1
    assert checked > 200


def test_ticks_answer_the_issue_cases():
    from r3lab.viz import axis_ticks, tick_labels

    # a share axis below 1%: no "1%, 1%, 0%"
    assert axis_ticks([0.0012, 0.0087], percent=True, include_zero=True)["ticktext"] == ["0%", "0.2%", "0.4%",
                                                                                          "0.6%", "0.8%"]
    # a log axis over three decades: decade labels, no "902.8071μ"
    assert axis_ticks([6e-7, 9e-4], log=True)["ticktext"] == ["1e-6", "1e-5", "1e-4", "1e-3"]
    # a log axis inside one decade (the monitor's 50μ-350μ): three ticks, not nine
    assert axis_ticks([5e-5, 3.5e-4], log=True)["ticktext"] == ["5e-5", "1e-4", "2e-4"]
    assert tick_labels([0.1 * 3, 0.1 * 6]) == ["0.3", "0.6"]  # float noise never shows
    assert axis_ticks([None, float("nan")]) == {} and axis_ticks([0.0, -1.0], log=True) == {}
    assert axis_ticks([0, 1], integer=True)["tickvals"] == [0.0, 1.0]  # RL steps: whole numbers


# --- the labels table ---------------------------------------------------------------------------------------

def _record_keys() -> set[str]:
    """Every key the RL and drift records use: read from every committed run's steps (bench/results: the RL, drift,
    staleness and task runs, so the async and per-update keys too), not from the writer's source text."""
    from pathlib import Path

    import numpy as np
    import orjson

    from r3lab import metrics

    root = Path(__file__).resolve().parent.parent
    keys: set[str] = set()
    for steps in sorted((root / "bench" / "results").rglob("steps.jsonl")):
        for line in steps.read_bytes().splitlines():
            keys |= set(orjson.loads(line))
    keys |= {f"mismatch/{k}" for k in metrics.mismatch_metrics(np.zeros(3), np.full(3, -0.1))}
    keys |= {f"mismatch/k3_kl_{n}" for n in ("flipped", "agreeing")}
    from r3lab.config import RLMetric
    from r3lab.experiments.rl import UPDATE_STATS

    keys |= {f"train/{k}" for k in UPDATE_STATS}  # the per-update statistics, averaged per step
    keys |= {v for k, v in vars(RLMetric).items() if not k.startswith("_") and isinstance(v, str)}
    keys |= {k for k, _, _ in __import__("r3lab.experiments.rl", fromlist=["COMPARISON_METRICS"]).COMPARISON_METRICS}
    return keys - {"model", "trainer_dtype", "seed", "_tokens"}  # the cell's name, not a metric


def test_every_metric_key_of_the_rl_and_drift_records_has_a_label_and_unit():
    import re

    from r3lab import labels

    keys = _record_keys()
    assert len(keys) > 50 and "routing/engine_max_vio" in keys and "k3_flipped_r3" in keys
    assert {"async/behaviour_weight_mean", "async/route_change_lag", "train/grad_norm_max"} <= keys  # staleness runs
    missing = sorted(k for k in keys if not labels.is_known(k))
    assert not missing, f"keys without a label in r3lab/labels.py: {missing}"
    for k in keys:
        assert labels.label(k) != k and not re.search(r"\w/\w", labels.label(k)), k  # human words, not the raw key
        assert labels.kind(k) in ("percent", "number", "count", "seconds") and labels.scale(k) in ("linear", "log")
    assert labels.axis_title("mismatch/k3_kl") == "train-inference k3 KL (nats/token)"
    assert labels.unit("routing/engine_trainer_disagreement") == "%" and labels.kind("train/clip_frac") == "percent"
    assert labels.label("mean/train/clip_frac") == "clipped tokens (run mean)"  # the summary's keys
    assert labels.label("my/own_metric") == "my/own_metric" and not labels.is_known("my/own_metric")
    assert labels.format_value("routing/engine_trainer_disagreement", 0.0531) == "5.31%"
    assert labels.format_value("mismatch/k3_kl", 2.0891e-4) == "2.09e-4"
    assert labels.format_value("mismatch/tokens", 359.0) == "359" and labels.format_value("x", None) == "n/a"


def test_labels_imports_neither_torch_nor_plotly():
    import subprocess
    import sys

    code = "import sys, r3lab.labels; print(sorted(m for m in ('torch', 'plotly') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_rl_curves_use_the_labels_table_not_raw_keys():
    from pathlib import Path

    from r3lab.runs import list_runs
    from r3lab.viz import rl_curves_figure

    root = Path(__file__).resolve().parent.parent / "bench" / "results" / "rl"
    runs = [r for _, r in list_runs(root) if r.name.startswith("tiny-qwen3-moe-default-")]
    fig = rl_curves_figure(runs, "routing/engine_trainer_disagreement")
    assert fig.layout.title.text == "engine-trainer routing differs (token x layer)"
    assert fig.layout.yaxis.title.text.endswith("(%)") and all(t.endswith("%") for t in fig.layout.yaxis.ticktext)
    assert len(set(fig.layout.yaxis.ticktext)) == len(fig.layout.yaxis.ticktext)


# --- honest marks and the notebook display ---------------------------------------------------------------------

def test_finish_notes_undrawn_legend_entries_and_refuses_bars_on_a_log_axis():
    import plotly.graph_objects as go

    from r3lab.errors import R3LabError
    from r3lab.viz import NOT_DRAWN, ONE_COLUMN, finish

    fig = go.Figure()
    fig.add_scatter(x=[1, 2], y=[0.0, 0.0], name="zero floor")
    fig.add_scatter(x=[1, 2], y=[1e-3, 2e-3], name="drawn")
    fig.add_scatter(x=[1, 2], y=[None, float("nan")], name="empty")
    fig.add_scatter(x=[1, 2], y=[0.0, 0.0], name="hidden", showlegend=False)
    fig = finish(fig, ONE_COLUMN, yaxis_type="log")
    assert [t.name for t in fig.data] == [f"zero floor (0 everywhere: {NOT_DRAWN} on the log axis)", "drawn",
                                          f"empty (no value: {NOT_DRAWN})", "hidden"]
    linear = finish(go.Figure(go.Scatter(x=[1, 2], y=[0, 0], name="zero")), ONE_COLUMN)
    assert linear.data[0].name == "zero"  # a zero line draws on a linear axis
    with pytest.raises(R3LabError, match="bars on a log axis"):
        finish(go.Figure(go.Bar(x=["a"], y=[3.0], name="b")), ONE_COLUMN, yaxis_type="log")


def test_long_titles_wrap_to_the_paper_width_and_notebooks_get_no_fixed_width(monkeypatch):
    import plotly.graph_objects as go
    import plotly.io as pio

    from r3lab.viz import NOTEBOOK_CONFIG, ONE_COLUMN, LabFigure, finish

    long = "engine vs trainer routing per layer " * 4
    fig = finish(go.Figure(go.Scatter(x=[0, 1], y=[0, 1])), ONE_COLUMN, title=long, subtitle="what the counts count")
    lines = fig.layout.title.text.split("<br>")
    assert len(lines) > 1 and max(map(len, lines)) <= 60 and fig.layout.margin.t > 60
    assert isinstance(fig, LabFigure) and isinstance(fig, go.Figure)
    assert fig.layout.width == ONE_COLUMN["width"] and fig.to_dict()["layout"]["width"] == 520  # exports: paper size
    shown = fig.notebook_dict()["layout"]
    assert "width" not in shown and shown["autosize"] is True and shown["height"] == ONE_COLUMN["height"]
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")  # what JupyterLab's kernel uses
    bundle = fig._repr_mimebundle_()
    plotly_json = bundle["application/vnd.plotly.v1+json"]
    assert "width" not in plotly_json["layout"] and plotly_json["config"]["responsive"] is NOTEBOOK_CONFIG["responsive"]


def test_one_seed_draws_no_error_bars_and_legends_count_seeds_in_the_singular(tmp_path):
    from r3lab.runs import RunWriter, load
    from r3lab.viz import MODE_COLORS, SOURCE_COLORS, drift_figure

    with RunWriter(tmp_path, "d1", "drift", {}) as w:
        w.log_step({"step": 0, "model": "m", "trainer_dtype": "float32", "seed": 0, "k3_none": 2e-4, "k3_r3": 7e-5,
                    "k3_flipped_none": 2e-3, "k3_flipped_r3": 6e-5})
        w.finish({})
    fig = drift_figure(load(tmp_path / "d1"))
    assert all(t.type == "scatter" and t.error_y.visible is False for t in fig.data)  # points, no stub bars
    assert "1 seed)" in fig.layout.title.text and "no spread" in fig.layout.title.subtitle.text
    assert not set(SOURCE_COLORS.values()) & set(MODE_COLORS.values())  # engine/trainer never wear a mode's colour


def test_band_colours_blend_hex_and_refuse_anything_else():
    """One colour helper for every band and second-engine line: the same arithmetic the figures were drawn with."""
    from r3lab.errors import R3LabError
    from r3lab.viz.style import lighter, translucent

    assert translucent("#1f77b4", 0.15) == "rgba(31,119,180,0.15)"
    assert lighter("#1f77b4") == "#8fbbda"  # (31+224/2, 119+136/2, 180+75/2) rounded half to even: 143, 187, 218
    assert lighter("#000000", 1.0) == "#ffffff" and lighter("#d62728", 0.0) == "#d62728"
    for bad in ("red", "#fff", "rgb(1,2,3)", "#12345g"):
        with pytest.raises(R3LabError, match="#rrggbb"):
            translucent(bad, 0.5)
