"""``r3lab rescore``: a finished run's stored samples scored again with another trainer, layout or dtype.

Oracles: the original run itself (the same trainer on the same stored inputs gives the same numbers, bit for bit:
the tokens, routes and threads are identical); the transformers trainer for the Megatron trainer (R3 replays the
same engine routes on both sides, so only fp32 kernel and summation order differ); and the run's own files for the
per-sample table (its engine log-probs are the per-token table's). One quick drift run is shared (module scope);
the engine and Megatron ranks hold the heavy lock (``flock /tmp/r3lab-heavy.lock``).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from r3lab.cli import main
from r3lab.errors import ConfigError, R3LabError, RunFormatError
from r3lab.experiments.drift import DriftConfig, run_drift
from r3lab.experiments.rescore import rescore_run, rescore_table
from r3lab.runs import RunWriter, load

# fp32 on both sides, different kernels and summation orders (test_trainer_megatron measured ~1e-6): the loading
# proof's bound
MEGATRON_TOL = 1e-4
DRIFT_KEYS = ("tokens", "flipped_share", "k3_none", "k3_r3", "f2_none", "f2_r3", "abs_diff_none", "abs_diff_r3",
              "k3_trainer_floor", "k3_engine_floor")


@pytest.fixture(scope="module")
def drift_run(tmp_path_factory, engine_pool):
    from r3lab.paths import model_dir

    root = tmp_path_factory.mktemp("runs")
    cfg = DriftConfig(models=("tiny-qwen3-moe",), prompts=4, max_tokens=10, seeds=(0,),
                      trainer_dtypes=("bfloat16", "float32"))
    engines = {"tiny-qwen3-moe": engine_pool.engine(model_dir("tiny-qwen3-moe"), seed=0)}  # the session's engine
    run_drift(cfg, progress=False, runs_root=root, run_name="d", engines=engines)
    return root / "d"


def test_a_drift_run_stores_every_cells_samples_and_engine_routes(drift_run):
    run = load(drift_run)
    assert run.meta["version"] == 3 and run.sample_steps() == run.route_steps("engine") == [0, 1]
    for step in (0, 1):
        s, tok = run.samples(step), run.tokens([step])
        assert len(s) == 4 and [r.size for r in s.response_ids] == tok.groupby("sample").size().tolist()
        np.testing.assert_array_equal(np.concatenate(s.logp_infer).astype(np.float64), tok["logp_infer"].to_numpy())
        assert s.prompt_ids[0].dtype == np.int32 and s.logp_infer[0].dtype == np.float32
        routes = run.routes(step, "engine")
        assert routes.lengths.tolist() == [p.size + r.size - 1 for p, r in zip(s.prompt_ids, s.response_ids,
                                                                              strict=True)]


def test_rescoring_with_the_same_trainer_reproduces_the_run_exactly(drift_run):
    out = rescore_run(drift_run, trainer="hf", out="same")
    src, new = load(drift_run), load(out)
    assert out.parent == drift_run.parent and new.kind == "drift" and new.finished
    assert new.config["rescore_of"] == "d" and new.config["source_steps"] == [0, 1]
    assert "checkpoint" in new.config["weights"]
    for a, b in zip(src.step_records, new.step_records, strict=True):
        assert (b["source_step"], b["trainer_dtype"]) == (a["step"], a["trainer_dtype"])
        for k in DRIFT_KEYS:
            assert b[k] == a[k], k
        assert (b["source/k3_none"], b["source/k3_r3"]) == (a["k3_none"], a["k3_r3"])
        assert b["vs_source/max_abs_dlogp_none"] == 0.0 and b["vs_source/max_abs_dlogp_r3"] == 0.0
        ta, tb = src.tokens([a["step"]]), new.tokens([b["step"]])
        for col in ("logp_infer", "logp_none", "logp_r3", "flipped", "logp_none_batched", "logp_engine_again"):
            np.testing.assert_array_equal(ta[col].to_numpy(), tb[col].to_numpy(), err_msg=col)
        assert src.routes(a["step"], "trainer") == new.routes(b["step"], "trainer")
        assert src.routes(a["step"], "engine") == new.routes(b["step"], "engine")
        sa, sb = src.samples(a["step"]), new.samples(b["step"])
        assert all(np.array_equal(x, y) for x, y in zip(sa.response_ids, sb.response_ids, strict=True))
    table = rescore_table(out)
    assert "rescore of drift run 'd'" in table and "0.0e+00" in table


def test_megatron_tp2_agrees_with_the_transformers_trainer_under_r3(drift_run, capsys):
    main(["rescore", str(drift_run), "--trainer", "megatron", "--tp", "2", "--trainer-dtype", "float32",
          "--no-progress"])
    printed = capsys.readouterr().out
    out = drift_run.parent / "d-rescore-megatron-tp2pp1ep1-fp32"
    new = load(out)
    (rec,) = new.step_records  # the two cells hold the same samples: scored once, in fp32
    assert rec["source_step"] == 1 and rec["source/trainer_dtype"] == "float32"
    assert new.config["trainer"] == "megatron" and new.config["tp"] == 2 and new.config["dp"] == 1
    # R3: the same engine routes replayed on both sides, the same math
    assert rec["vs_source/max_abs_dlogp_r3"] < MEGATRON_TOL
    assert rec["k3_r3"] == pytest.approx(rec["source/k3_r3"], rel=1e-2, abs=1e-7)
    # native routing: Megatron's own choice against the engine's, reported beside the transformers trainer's
    for key in ("flipped_share", "routing/engine_trainer_disagreement"):
        assert 0 <= rec[key] <= 1 and 0 <= rec[f"source/{key}"] <= 1
    assert np.isfinite(rec["k3_none"]) and np.isfinite(rec["vs_source/max_abs_dlogp_none"])
    print(f"\nhf tp1 -> megatron tp2 (fp32): flipped {rec['source/flipped_share']:.4f} -> {rec['flipped_share']:.4f}, "
          f"routes differing {rec['source/routing/engine_trainer_disagreement']:.4f} -> "
          f"{rec['routing/engine_trainer_disagreement']:.4f}, k3 none {rec['source/k3_none']:.3e} -> "
          f"{rec['k3_none']:.3e}, k3 R3 {rec['source/k3_r3']:.3e} -> {rec['k3_r3']:.3e}, max|dlogp| R3 "
          f"{rec['vs_source/max_abs_dlogp_r3']:.1e}")
    assert "megatron tp=2 pp=1 ep=1 dp=1" in printed and "| 1 | tiny-qwen3-moe |" in printed


# ---- RL runs: every step stored, step 0 scored again --------------------------------------------------------------
@pytest.fixture(scope="module")
def rl_root(tmp_path_factory, engine_pool):
    import dataclasses

    from r3lab.config import RLConfig
    from r3lab.experiments.rl import run_rl
    from r3lab.paths import model_dir

    root = tmp_path_factory.mktemp("rl")
    base = RLConfig.quick(steps=2, prompts_per_step=2, samples_per_prompt=2, max_tokens=6, mini_batches=1,
                          mode="R3", noise_every=0)
    with engine_pool.lease(model_dir(base.model), seed=0) as engine:  # the session's, restored after the runs
        run_rl(base, engine=engine, runs_root=root, run_name="rl", progress=False)
        run_rl(dataclasses.replace(base, turns=2, observation_words=2), engine=engine, runs_root=root,
               run_name="rl-turns", progress=False)
    return root


@pytest.mark.parametrize("name", ["rl", "rl-turns"])
def test_an_rl_run_stores_every_step_and_its_step_0_scores_again(rl_root, name):
    src = load(rl_root / name)
    assert src.sample_steps() == src.route_steps("engine") == [0, 1]
    s0 = src.samples(0)
    assert len(s0) == 4 and (s0.sampled is not None) == (name == "rl-turns")
    out = rescore_run(rl_root / name, trainer_dtype="float32")
    new = load(out)
    (rec,) = new.step_records
    assert rec["source_step"] == 0 and "starting checkpoint" in new.config["weights"]
    assert new.config["source_steps"] == [0] and "only step 0" in new.config["weights"]
    tok = src.tokens([0])
    keep = tok["loss_mask"].to_numpy(bool) if "loss_mask" in tok else np.ones(len(tok), bool)
    assert rec["tokens"] == int(keep.sum()) == len(new.tokens([0]))  # multi-turn: the sampled tokens only
    # the RL loop scores the batch in one padded forward on the default threads; rescore scores each sample alone
    # on one thread, as the drift experiment does: fp32 rounding of other shapes and sums, nothing more
    assert rec["vs_source/max_abs_dlogp_r3"] < 1e-4 and rec["vs_source/max_abs_dlogp_none"] < 1e-4
    flips = new.tokens([0])["flipped"].to_numpy() != tok["flipped"].to_numpy()[keep]
    assert flips.sum() <= 1  # a near-tie router may go the other way under other shapes
    assert rec["source/routing/engine_trainer_disagreement"] is None  # the RL loop counts other rows: not compared


# ---- bad input: each names the problem -----------------------------------------------------------------------------
def _copy(drift_run, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(drift_run, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["name"] = name
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_an_unfinished_run_is_refused(drift_run, tmp_path):
    run = _copy(drift_run, tmp_path, "unfinished")
    (run / "summary.json").unlink()
    with pytest.raises(R3LabError, match="'unfinished' is not finished"):
        rescore_run(run)


def test_a_missing_table_or_routes_file_is_named(drift_run, tmp_path):
    run = _copy(drift_run, tmp_path, "nosamples")
    (run / "samples" / "step-000001.parquet").unlink()
    with pytest.raises(RunFormatError, match="no per-sample table for step 1"):
        rescore_run(run)
    run = _copy(drift_run, tmp_path, "noroutes")
    (run / "routes" / "step-000000.engine.r3").unlink()
    with pytest.raises(RunFormatError, match="no routes 'step-000000.engine.r3'"):
        rescore_run(run)
    run = _copy(drift_run, tmp_path, "old")
    shutil.rmtree(run / "samples")
    cfg = json.loads((run / "config.json").read_text())
    cfg["version"] = 2
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RunFormatError, match="format version 2, before per-sample tables"):
        rescore_run(run)


def test_an_existing_output_name_is_an_error_and_the_original_stays(drift_run):
    before = sorted(p.name for p in drift_run.parent.iterdir())
    with pytest.raises(RunFormatError, match="exists; runs are never overwritten"):
        rescore_run(drift_run, out="d")
    with pytest.raises(RunFormatError, match="run name"):
        rescore_run(drift_run, out="../elsewhere")
    assert sorted(p.name for p in drift_run.parent.iterdir()) == before


def test_an_rl_run_is_scored_at_step_0_only(tmp_path):
    w = RunWriter(tmp_path, "rl", "rl", {"model": "tiny-qwen3-moe", "mode": "R3", "trainer_dtype": "float32"})
    for step in range(3):
        w.log_step({"step": step, "engine_weight_version": step})
    w.finish({})
    with pytest.raises(ConfigError, match="step 2 was sampled and scored with the weights after 2 update"):
        rescore_run(tmp_path / "rl", steps=[0, 2])
    with pytest.raises(R3LabError, match="a 'doctor' run; rescore scores drift, RL and capture runs"):
        w = RunWriter(tmp_path, "other", "doctor", {})
        w.finish({})
        rescore_run(tmp_path / "other")
    with pytest.raises(ConfigError, match="--tp/--pp/--ep set a Megatron layout"):
        rescore_run(tmp_path / "rl", tp=2)  # a layout without --trainer megatron
