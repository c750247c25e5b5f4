"""The experiments end to end on the shipped models: the drift experiment's claims, and the RL loop."""

import numpy as np
import pytest

from r3lab.errors import ConfigError
from r3lab.experiments import DriftConfig, drift_spread, run_drift
from r3lab.paths import model_dir

# What the README claims, pinned with a stated margin. Measured over prompt seeds 0-5 at 24 prompts x 32 tokens
# (bf16 trainer with fp32 routers): the cut of k3 on route-flipped tokens was 3.8-21x (qwen3) and 12-68x (glm4),
# agreeing tokens moved by at most 14%, and the overall cut was 1.2-1.7x (qwen3) and 1.7-7.8x (glm4).
CLAIMS = {
    "tiny-qwen3-moe": {"flipped_cut_min": 4.0, "overall_cut_median": 1.2},
    "tiny-glm4-moe": {"flipped_cut_min": 8.0, "overall_cut_median": 2.0},
}
AGREEING_TOLERANCE = 0.2  # agreeing tokens: R3 / none within 1 +- 0.2 (replaying identical routes is a no-op)


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_replaying_engine_routes_cuts_drift_on_flipped_tokens(name, engine_pool):
    config = DriftConfig(models=(name,), prompts=24, max_tokens=32, seeds=(0, 1, 2), trainer_dtypes=("bfloat16",))
    rows = run_drift(config, progress=False, engines={name: engine_pool.engine(model_dir(name), seed=0)})
    assert [r.seed for r in rows] == [0, 1, 2]
    for r in rows:
        s = r.summary
        # routing differs on some tokens (the reason R3 exists), but not on most (a layer or token shift would)
        assert 0.01 < s["flipped_share"] < 0.2, s
        assert s["k3_flipped_none"] > CLAIMS[name]["flipped_cut_min"] * s["k3_flipped_r3"], (r.seed, s)
        assert s["k3_r3"] < s["k3_none"], (r.seed, s)
        assert abs(s["k3_agreeing_r3"] / s["k3_agreeing_none"] - 1) < AGREEING_TOLERANCE, (r.seed, s)
    (spread,) = drift_spread(rows)
    assert spread["cut_overall"][1] > CLAIMS[name]["overall_cut_median"], spread
    assert spread["tokens"] == sum(r.summary["tokens"] for r in rows)


def test_drift_config_refuses_nonsense():
    with pytest.raises(ValueError, match="seeds"):
        DriftConfig(seeds=(1, 1))
    with pytest.raises(ValueError, match="trainer-dtypes"):
        DriftConfig(trainer_dtypes=("float16",))
    with pytest.raises(ValueError, match="prompts"):
        DriftConfig(prompts=0)
    with pytest.raises(ValueError, match="--trainer must be one of"):
        DriftConfig(trainer="jax")


def test_the_quick_drift_config_is_a_smaller_run_of_the_same_experiment():
    """--quick shrinks the run (prompts, tokens, seeds) and changes nothing else; overrides still apply."""
    full, quick = DriftConfig(), DriftConfig.quick()
    assert (quick.prompts, quick.max_tokens, quick.seeds) == (8, 16, (0,))
    assert quick.prompts < full.prompts and quick.max_tokens < full.max_tokens and len(quick.seeds) < len(full.seeds)
    same = {k: v for k, v in quick.to_dict().items() if k not in ("prompts", "max_tokens", "seeds")}
    assert same == {k: v for k, v in full.to_dict().items() if k in same}
    assert DriftConfig.quick(prompts=3).prompts == 3
    assert DriftConfig.from_dict(quick.to_dict()) == quick


def test_the_committed_reference_drift_run_is_consistent():
    """bench/results/drift-run (read by `r3lab figures`): its routes, tokens and steps say the same thing."""
    from r3lab import metrics
    from r3lab.paths import results_dir
    from r3lab.runs import load

    run = load(results_dir() / "drift-run")
    assert run.kind == "drift" and run.finished
    assert len(run.step_records) == len(run.config["models"]) * len(run.config["trainer_dtypes"]) * len(
        run.config["seeds"])
    engine = {}
    for s in run.step_records:
        tokens = run.tokens([s["step"]])
        trainer = run.routes(s["step"], "trainer")
        key = (s["model"], s["seed"])
        if s["trainer_dtype"] == "bfloat16" or key not in engine:
            engine[key] = run.routes(s["step"], "engine")
        eng = engine[key]
        assert trainer.num_experts == eng.num_experts and list(trainer.layer_ids) == list(eng.layer_ids)
        assert list(trainer.cu_seqlens) == list(eng.cu_seqlens)
        # the per-token "flipped" column is recomputed exactly from the two route sets: rows P-1 .. P+R-2
        flips = metrics.token_route_flips(eng.values, trainer.values)
        rows = metrics.response_rows(eng.cu_seqlens, tokens.groupby("sample").size().to_numpy())
        assert np.array_equal(flips[rows], tokens["flipped"].to_numpy()), s["step"]
        assert abs(tokens["flipped"].mean() - s["flipped_share"]) < 1e-12
        assert metrics.k3_kl(tokens["logp_none"], tokens["logp_infer"]) == pytest.approx(s["k3_none"], rel=1e-12)
        assert metrics.k3_kl(tokens["logp_r3"], tokens["logp_infer"]) == pytest.approx(s["k3_r3"], rel=1e-12)


def test_a_drift_run_records_the_trainers_routes_row_for_row_and_the_floor_scores(tmp_path, engine_pool):
    """The run holds engine and trainer routes of the same rows and layers; the per-token flips the experiment
    computed are exactly where those two stored route sets differ at each sampled token's input position."""
    from r3lab import metrics
    from r3lab.runs import load

    config = DriftConfig(models=("tiny-qwen3-moe",), prompts=6, max_tokens=12, seeds=(0,), trainer_dtypes=("bfloat16",))
    engines = {"tiny-qwen3-moe": engine_pool.engine(model_dir("tiny-qwen3-moe"), seed=0)}
    (row,) = run_drift(config, progress=False, runs_root=tmp_path, run_name="d", engines=engines)
    run = load(tmp_path / "d")
    engine, trainer = run.routes(0, "engine"), run.routes(0, "trainer")
    assert np.array_equal(engine.cu_seqlens, trainer.cu_seqlens) and np.array_equal(engine.layer_ids, trainer.layer_ids)
    tok = run.tokens([0])
    rows = metrics.response_rows(engine.cu_seqlens, tok.groupby("sample").size().to_numpy())
    differs = metrics.set_differs(engine.values[rows], trainer.values[rows])
    np.testing.assert_array_equal(differs.any(axis=1), tok["flipped"].to_numpy())
    assert metrics.set_differs(engine.values, trainer.values).mean() < 0.2  # the trainer's routes, not noise
    assert metrics.k3_kl(tok["logp_none_batched"], tok["logp_none"]) == pytest.approx(row.summary["k3_trainer_floor"])
    assert metrics.k3_kl(tok["logp_engine_again"], tok["logp_infer"]) == pytest.approx(row.summary["k3_engine_floor"])


def test_an_engine_given_to_the_drift_run_must_be_the_runs():
    """run_drift(engines=...) checks each given engine against the run before sampling with it (no engine starts)."""
    from types import SimpleNamespace

    qwen, glm = model_dir("tiny-qwen3-moe"), model_dir("tiny-glm4-moe")
    config = DriftConfig(models=("tiny-qwen3-moe",), prompts=2, max_tokens=4, seeds=(0,))
    with pytest.raises(ConfigError, match="holds"):
        run_drift(config, progress=False,
                  engines={"tiny-qwen3-moe": SimpleNamespace(model_dir=glm, engine_quant="none")})
    with pytest.raises(ConfigError, match="engine_quant='int4'"):
        run_drift(config, progress=False,
                  engines={"tiny-qwen3-moe": SimpleNamespace(model_dir=qwen, engine_quant="int4")})
    with pytest.raises(ConfigError, match="engine-url"):
        run_drift(DriftConfig.from_dict({**config.to_dict(), "engine_url": "http://127.0.0.1:9"}), progress=False,
                  engines={"tiny-qwen3-moe": SimpleNamespace(model_dir=qwen, engine_quant="none")})
