"""``r3lab import megatron-trace``: Megatron-LM's routing trace as an expert-load run, its doctor checks and figures.

Dumps come from tests/dumps_megatron_trace.py (RouterTracer restated); every expectation is the generator's input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from dumps_megatron_trace import E, L, inference_trace, training_trace

from r3lab.doctor import FAIL, OK, WARN, LayerLoad, diagnose, trace_load
from r3lab.errors import ImportFormatError, UnknownLayoutError
from r3lab.importers import import_run
from r3lab.importers.registry import REGISTRY, detect_kind
from r3lab.runs import load

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "data" / "models" / "tiny-qwen3-moe" / "config.json")
KIND = "megatron-trace"


def _truth_per_layer(truth, block="decoder"):
    out: dict[tuple[int, int], np.ndarray] = {}
    for (s, b, mtp, g), c in truth.counts.items():
        if b == block:
            assert c[E] == 0  # the truth is one wider, for the shifted-ids variant
            out[(s, g if block == "decoder" else mtp * 1000 + g)] = c[:E]
    return out


def _imported_per_layer(run, block="decoder"):
    t = trace_load(run)
    return {(s, int(g)): c for s in t.steps
            for g, c in zip(t.per_layer([s], block).layer_ids, t.per_layer([s], block).counts, strict=True)}


def _bad(report):
    return {c.name: c.status for c in report.checks if c.status in (WARN, FAIL)}


def test_the_model_config_is_what_the_fixtures_assume():
    cfg = json.loads(Path(CONFIG).read_text())
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]) == (L, E, 2)
    assert cfg["mlp_only_layers"] == [] and cfg["decoder_sparse_step"] == 1


@pytest.mark.parametrize("kind", [KIND, "auto"])
def test_training_trace_gives_counts_per_step_layer_and_rank(tmp_path, kind):
    truth = training_trace(tmp_path / "trace")
    path = import_run(kind, tmp_path / "trace", tmp_path / "run", config=CONFIG)
    run = load(path)
    assert run.config["source"]["format"] == KIND
    assert run.config["source_layouts"] == ["router-trace-hooks-2026-08"]
    tr = run.config["trace"]
    assert tr["pipeline_parallel"] == 2 and tr["pipeline_parallel_inferred"] is True
    assert "no token ids" in tr["note"] and "sample" in tr["note"] and "padding" in tr["padding_rows"]
    assert [r["step"] for r in run.step_records] == [3, 4] == sorted(truth.steps)
    assert run.token_steps() == [] and run.route_steps("engine") == []
    got, want = _imported_per_layer(run), _truth_per_layer(truth)
    assert sorted(got) == sorted(want)
    for k in want:  # recomputed layer 0 of each stage is counted once
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
    mtp_got, mtp_want = _imported_per_layer(run, "mtp"), _truth_per_layer(truth, "mtp")
    assert sorted(mtp_got) == sorted(mtp_want) and all((mtp_got[k] == mtp_want[k]).all() for k in mtp_want)
    t = trace_load(run)
    dec0 = (t["block"] == 0) & (t["layer"] == 0)
    assert (t["calls"][dec0] == 2 * t["distinct_calls"][dec0]).all()  # the recompute duplicates seen, not counted
    # routing weights: rank 0's logits (softmax over the top-k logits, the router state's score function)
    r0 = (t["rank"] == 0) & (t["block"] == 0)
    assert np.isfinite(t["weight_sums"][r0]).all() and np.isnan(t["weight_sums"][t["rank"] == 1]).all()
    for i in np.flatnonzero(r0):
        s, g = int(t["step"][i]), int(t["global_layer"][i])
        # rank 0 holds half the rows of global layers 0-3: its weights are its own rows' (the truth's are rank 0's)
        np.testing.assert_allclose(t["weight_sums"][i], truth.weights[(s, "decoder", -1, g)], rtol=1e-5, atol=1e-6)
        assert abs(t["weight_sums"][i].sum() - t["rows"][i]) < 1e-6 * t["rows"][i]  # weights of a row sum to 1


def test_inference_trace_has_1_based_global_layers(tmp_path):
    truth = inference_trace(tmp_path / "trace")
    assert detect_kind(tmp_path / "trace")[0] == KIND
    run = load(import_run("auto", tmp_path / "trace", tmp_path / "run", config=CONFIG))
    assert run.config["source_layouts"] == ["router-trace-indices-2026-08"]
    assert run.config["trace"]["numbering"] == {"0": "global-1"}
    assert [r["step"] for r in run.step_records] == [0, 1, 2, 3, 4]
    got, want = _imported_per_layer(run), _truth_per_layer(truth)
    assert sorted(got) == sorted(want) and {g for _, g in got} == set(range(L))
    assert all((got[k] == want[k]).all() for k in want)
    assert all(r["trace/router_rows"] == 40 * L for r in run.step_records)
    assert _bad(diagnose(run)) == {}


def test_a_clean_trace_passes_the_doctor(tmp_path):
    training_trace(tmp_path / "trace")
    rep = diagnose(import_run(KIND, tmp_path / "trace", tmp_path / "run", config=CONFIG))
    assert _bad(rep) == {}, rep.text()
    for name in ("trace expert load", "trace layer ids", "trace MTP numbering", "trace dropped records"):
        assert rep.check(name).status == OK


@pytest.mark.parametrize(("broken", "check", "status", "words"), [
    ({"dead": (2, 5)}, "trace expert load", WARN, "layer 2: experts [5] never picked"),
    ({"hot": 6}, "trace expert load", WARN, "layer 6: max_vio"),
    ({"shift": 5}, "trace layer ids", FAIL, "decoder layers [5]: expert ids up to 16 >= the model's 16, and expert 0 "
     "never picked: ids look shifted by one"),
    ({"drop": (4, 1, 2, 1)}, "trace dropped records", WARN, "fewer calls"),
])
def test_each_trace_check_fires_on_its_broken_trace(tmp_path, broken, check, status, words):
    training_trace(tmp_path / "trace", rows=160 if "dead" in broken else 48, **broken)
    rep = diagnose(import_run(KIND, tmp_path / "trace", tmp_path / "run", config=CONFIG))
    c = rep.check(check)
    assert c.status == status and words in c.line(), rep.text()
    # a shifted layer never picks expert 0: the dead-expert warning is deserved there too
    assert set(_bad(rep)) == {check} | ({"trace expert load"} if "shift" in broken else set()), rep.text()


def test_an_mtp_router_under_a_decoder_layer_number_fails(tmp_path):
    inference_trace(tmp_path / "trace", mtp_collision=True)
    rep = diagnose(import_run(KIND, tmp_path / "trace", tmp_path / "run", config=CONFIG))
    c = rep.check("trace MTP numbering")
    assert c.status == FAIL and "decoder layers [1]" in c.line() and "layer 1" in c.worst, rep.text()


def test_a_1_based_trace_read_as_stage_local_looks_shifted(tmp_path):
    inference_trace(tmp_path / "trace")
    rep = diagnose(import_run(KIND, tmp_path / "trace", tmp_path / "run", config=CONFIG,
                              layer_numbering="stage-local"))
    c = rep.check("trace layer ids")
    assert c.status == FAIL and "[8]" in c.line() and "1-based numbers read as 0-based" in c.line(), rep.text()


def test_the_figures_read_a_trace_run(tmp_path):
    from r3lab import viz

    truth = training_trace(tmp_path / "trace")
    run = load(import_run(KIND, tmp_path / "trace", tmp_path / "run", config=CONFIG))
    engine, trainer = viz.routes_or_note(run, 3, "engine"), viz.routes_or_note(run, 3, "trainer")
    assert isinstance(engine, viz.NotAvailable) and isinstance(trainer, LayerLoad)
    fig = viz.expert_load(engine, trainer, title="t")
    want = np.stack([truth.counts[(3, "decoder", -1, g)][:E] for g in range(L)]).astype(float)
    np.testing.assert_allclose(np.array(fig.data[0].z), want / want.sum(axis=1, keepdims=True))
    imb = viz.in_place(viz.load_imbalance_figure, viz.drawn({"engine": engine, "trainer": trainer}))
    assert list(imb.data[0].x) == list(range(L))
    assert isinstance(viz.in_place(viz.layer_disagreement_figure, engine, trainer), viz.NotAvailable)
    assert isinstance(viz.routes_or_note(run, 99, "trainer"), viz.NotAvailable)
    figs = viz.run_figures(run)
    assert not isinstance(figs["expert_load"], viz.NotAvailable)
    assert not isinstance(figs["load_imbalance"], viz.NotAvailable)


def test_detect_claims_only_traces(tmp_path):
    training_trace(tmp_path / "trace")
    mod = REGISTRY[KIND].load()
    for kind, spec in REGISTRY.items():
        if kind != KIND and spec.available:
            assert spec.detect(tmp_path / "trace") is None, kind
    fixtures = ROOT / "tests" / "fixtures"
    for p in sorted(fixtures.iterdir()) if fixtures.is_dir() else []:
        assert mod.detect(p) is None, p
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "router_trace_rank0.jsonl").write_text('{"tokens": [1]}\n')
    assert mod.detect(tmp_path / "other") is None


def _one_record(tmp_path, **change):
    d = tmp_path / "trace"
    d.mkdir(exist_ok=True)
    rec = {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 0, "rank": 0, "num_tokens": 2, "topk": 2,
           "top_indices": [[0, 1], [2, 3]]}
    rec.update(change)
    rec = {k: v for k, v in rec.items() if v is not None}
    (d / "router_trace_rank0.jsonl").write_text(json.dumps(rec) + "\n")
    return d


@pytest.mark.parametrize(("change", "error", "words"), [
    ({"top_indices": None}, UnknownLayoutError, "no ['top_indices']"),
    ({"routing_weights": [[0.5, 0.5]]}, UnknownLayoutError, "new keys ['routing_weights']"),
    ({"stage": "post_dispatch"}, UnknownLayoutError, "stage 'post_dispatch'"),
    ({"num_tokens": 3}, ImportFormatError, "not [num_tokens 3, topk 2]"),
    ({"rank": 1}, ImportFormatError, "rank 1 in the file of rank 0"),
    ({"block": "mtp"}, ImportFormatError, "without mtp_idx"),
    ({"top_indices": [[0, 0], [2, 3]]}, ImportFormatError, "names one expert twice"),
    ({"top_indices": [[-1, 1], [2, 3]]}, ImportFormatError, "negative expert id"),
    ({"logit_offset": 0, "logit_bytes": 64, "logit_shape": [2, 16]}, ImportFormatError, "logits_rank0.bin is missing"),
])
def test_malformed_traces_are_refused_by_name_and_leave_nothing(tmp_path, change, error, words):
    d = _one_record(tmp_path, **change)
    with pytest.raises(error, match=None) as e:
        import_run(KIND, d, tmp_path / "run", config=CONFIG)
    assert words in str(e.value) and "router_trace_rank0.jsonl line 1" in str(e.value)
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run.partial-*"))


def test_a_truncated_logits_file_is_refused(tmp_path):
    d = _one_record(tmp_path, logit_offset=0, logit_bytes=64, logit_shape=[2, 16])
    (d / "logits_rank0.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ImportFormatError, match="truncated"):
        import_run(KIND, d, tmp_path / "run")


def test_options_are_checked(tmp_path):
    d = _one_record(tmp_path)
    with pytest.raises(ImportFormatError, match="layer_numbering 'x'"):
        import_run(KIND, d, tmp_path / "run", layer_numbering="x")
    with pytest.raises(ImportFormatError, match="pipeline_parallel 3: needs every rank"):
        import_run(KIND, d, tmp_path / "run", config=CONFIG, pipeline_parallel="3")
