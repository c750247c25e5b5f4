"""The RL loop (r3lab.experiments.rl) on the --quick setting: it learns, weights reach the engine, and each
replay mode feeds the trainer's forwards the routes its definition says."""

import dataclasses

import numpy as np
import pytest

import r3lab.experiments.rl as rl
from r3lab import config
from r3lab.config import RLConfig
from r3lab.errors import BatchError, ConfigError
from r3lab.experiments.rl import comparison_rows, comparison_table, run_rl
from r3lab.paths import model_dir
from r3lab.rollout import SamplingConfig
from r3lab.runs import load
from r3lab.trainers import TokenBatch, Trainer
from r3lab.trainers.hf import HFTrainer, padded_batch

QUICK = RLConfig.quick()
TIMING = ("time_generate_s", "time_weight_sync_s", "time_step_s")


@pytest.fixture(scope="module")
def engine(engine_pool):
    """The session's engine (tests/conftest.py), restored to the checkpoint after the module."""
    with engine_pool.lease(model_dir(QUICK.model), seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def spied(engine):
    """One quick run per mode, recording what every trainer call scored and replayed (through the Trainer API)."""
    calls: dict[str, list] = {}
    score, step = HFTrainer.score, HFTrainer.policy_step

    def spy_score(self, batch, *, routes=None, record=False, entropy=False):
        out = score(self, batch, routes=routes, record=record, entropy=entropy)
        calls[mode].append({"grad": False, "record": record, "routes": routes, "recorded": out.routes,
                            "rows": len(batch)})
        return out

    def spy_step(self, batch, update, *, routes=None):
        calls[mode].append({"grad": True, "record": False, "routes": routes, "recorded": None, "rows": len(batch)})
        return step(self, batch, update, routes=routes)

    runs = {}
    for mode in config.DEFAULT_MODES:  # R3W needs an engine that captures weights: its own tests below
        calls[mode] = []
        HFTrainer.score, HFTrainer.policy_step = spy_score, spy_step
        try:
            runs[mode] = run_rl(dataclasses.replace(QUICK, mode=mode, steps=2), engine=engine, progress=False)
        finally:
            HFTrainer.score, HFTrainer.policy_step = score, step
    return runs, calls


def test_quick_loop_learns_and_writes_a_readable_run(engine, tmp_path):
    before = engine.score([[2, 10, 11, 12, 13, 14]], start=1)[0]
    run = run_rl(QUICK, engine=engine, runs_root=tmp_path, run_name="quick", progress=False)
    r = np.array([s["reward_mean"] for s in run.steps])
    assert r[-3:].mean() > r[:3].mean() + 0.1, r  # the reward rises within the quick run
    after = engine.score([[2, 10, 11, 12, 13, 14]], start=1)[0]
    assert engine.weight_version == QUICK.steps and not np.allclose(before, after)  # the engine got the weights
    back = load(tmp_path / "quick")
    assert back.finished and back.steps["step"].tolist() == list(range(QUICK.steps))
    assert back.steps["reward_mean"].tolist() == pytest.approx(r.tolist())
    assert set(back.token_steps()) == {0, QUICK.steps - 1}
    assert back.routes(0, "engine").num_experts == 16
    assert back.summary["reward_last_quarter"] > back.summary["reward_first_quarter"]
    # the doctor ran on the finished run: every capture and replay check passed (health checks only warn)
    assert back.summary["doctor/failed"] == 0, back.summary["doctor/checks"]
    assert back.summary["doctor/checks"]["route rows"] == "ok"
    table = comparison_table(comparison_rows([(run.config, run.steps)]))
    assert "| tiny-qwen3-moe | R3 | 1 x 10 |" in table


def test_same_seed_same_numbers(engine):
    cfg = dataclasses.replace(QUICK, steps=3, mode="R2")
    a, b = (run_rl(cfg, engine=engine, progress=False).steps for _ in range(2))
    strip = [{k: v for k, v in s.items() if k not in TIMING} for s in a], [
        {k: v for k, v in s.items() if k not in TIMING} for s in b]
    assert strip[0] == strip[1]


def test_r2_is_no_replay_on_the_first_mini_batch_and_r3_is_not(spied):
    runs, _ = spied
    for mode in ("none", "R2"):
        assert all(s["train/first_mb_logp_gap_to_native"] == 0.0 for s in runs[mode].steps), mode
    assert max(s["train/first_mb_logp_gap_to_native"] for s in runs["R3"].steps) > 0


def test_each_mode_replays_what_its_definition_says(spied):
    runs, calls = spied
    for mode, cs in calls.items():
        updates = [c for c in cs if c["grad"]]
        assert len(updates) == 2 * QUICK.mini_batches, mode  # 2 steps x mini-batches
        if mode == "none":
            assert all(c["routes"] is None for c in updates)
            continue
        # per step: call 0 records the old policy's routes over the whole batch (R2's replay data)
        step_starts = [i for i, c in enumerate(cs) if c["record"] and c["rows"] == QUICK.prompts_per_step *
                       QUICK.samples_per_prompt]
        assert len(step_starts) == 2
        for k, start in enumerate(step_starts):
            end = step_starts[k + 1] if k + 1 < len(step_starts) else len(cs)
            old = cs[start]["recorded"]
            for c in (c for c in cs[start:end] if c["grad"]):
                given = c["routes"]
                assert given is not None and len(given) == c["rows"]
                if mode == "R2":  # the old policy's routes, never the engine's
                    rows = [i for i in range(len(old)) if any(np.array_equal(old.sequence(i), given.sequence(j))
                                                              for j in range(len(given)))]
                    assert len(rows) >= len(given), "R2 replayed routes the old policy did not choose"
    # R3: the old-log-prob recompute itself replays the engine's routes (a full-batch forward with routes)
    r3_old = [c for c in calls["R3"] if not c["grad"] and c["routes"] is not None]
    assert len(r3_old) == 2 and all(c["rows"] == QUICK.prompts_per_step * QUICK.samples_per_prompt for c in r3_old)
    assert all(c["routes"] is None for c in calls["R2"] if not c["grad"])


def test_r3_forward_uses_the_engine_routes(engine):
    results = engine.generate(["kupi kobire reti"], SamplingConfig(max_tokens=8, n=2, seed=3))
    batch = rl.RolloutBatch.from_results(results, np.zeros(2), 2)
    trainer = HFTrainer.load(model_dir(QUICK.model))
    assert isinstance(trainer, Trainer)
    out = trainer.score(batch.tokens, routes=batch.engine_routes, record=True)
    assert out.routes == batch.engine_routes.select_layers(out.routes.layer_ids)  # record after replay equals them
    own = trainer.score(batch.tokens, record=True)
    assert out.logprobs.shape == own.logprobs.shape == batch.logp_infer.shape
    assert not np.array_equal(out.logprobs, own.logprobs) or own.routes == out.routes


def test_a_mini_batch_is_scored_at_the_whole_batchs_width():
    """TokenBatch.take keeps the padded width: a mini-batch's rows are the whole batch's rows, bit for bit (the RL
    loop's mini-batch forwards run in the shapes of the old-policy forward)."""
    batch = TokenBatch.from_ids([[1, 2, 3, 4, 5, 6], [7, 8, 9], [3, 4, 5, 6]], [2, 1, 3])
    ids, mask, resp = padded_batch(batch)
    sub_ids, sub_mask, sub_resp = padded_batch(batch.take([0, 2]))
    assert sub_ids.shape == (2, 6)
    for whole, part in ((ids, sub_ids), (mask, sub_mask), (resp, sub_resp)):
        assert np.array_equal(whole[[0, 2]].numpy(), part.numpy())
    assert batch.response_lengths.tolist() == [4, 2, 1] and batch.token_sample.tolist() == [0, 0, 0, 0, 1, 1, 2]
    assert resp.sum(1).tolist() == [4, 2, 1]  # each sample's tokens after its prompt are scored
    with pytest.raises(BatchError, match="prompt length"):
        TokenBatch.from_ids([[1, 2]], [2])
    with pytest.raises(BatchError, match="width"):
        TokenBatch.from_ids([[1, 2, 3]], [1], width=2)


def test_a_train_step_returns_its_metrics_and_its_token_table_apart(engine):
    """train_step's metrics are one step line (no per-token arrays inside); the token table has one row per
    sampled token, sample-major, and its flips agree with the step's flipped share."""
    results = engine.generate(["kupi kobire reti", "ma lo"], SamplingConfig(max_tokens=6, n=2, seed=4,
                                                                             ignore_eos=True))
    batch = rl.RolloutBatch.from_results(results, np.array([0.0, 1.0, 0.5, 0.5]), 2)
    cfg = dataclasses.replace(QUICK, prompts_per_step=2, samples_per_prompt=2, mini_batches=2)
    out = rl.train_step(rl.start_trainer(cfg, model_dir(cfg.model)), batch, cfg, np.random.default_rng(0))
    assert isinstance(out, rl.StepResult)
    assert not any(isinstance(v, np.ndarray) for v in out.metrics.values())
    n = batch.logp_infer.size
    assert all(len(v) == n for v in out.tokens.values()) and out.tokens["sample"].tolist() == sorted(
        out.tokens["sample"].tolist())
    assert out.metrics["routing/flipped_token_share"] == pytest.approx(out.tokens["flipped"].mean())
    assert out.tokens["first_mb_sample"].sum() == n // 2  # half the samples, each with 6 sampled tokens


def test_truncated_importance_sampling_and_bf16_routers(engine):
    cfg = dataclasses.replace(QUICK, steps=2, tis_cap=1.01, trainer_dtype="bfloat16", router_dtype="bfloat16")
    steps = run_rl(cfg, engine=engine, progress=False).steps
    for s in steps:
        assert 0 < s["train/tis_weight_mean"] <= 1.01  # min(pi_trainer / pi_engine, cap) per token
        assert 0 <= s["mismatch/tis_clipfrac"] <= 1
    plain = run_rl(dataclasses.replace(cfg, tis_cap=None), engine=engine, progress=False).steps
    assert plain[0]["train/tis_weight_mean"] is None
    assert plain[0]["train/loss"] != steps[0]["train/loss"]  # the weights change the loss


def test_config_refuses_nonsense():
    with pytest.raises(ConfigError, match="mode"):
        RLConfig(mode="R4")
    with pytest.raises(ConfigError, match="mini-batches"):
        RLConfig(prompts_per_step=3, samples_per_prompt=3, mini_batches=2)
    with pytest.raises(ConfigError, match="--tis-cap must be > 1"):  # errors name the flag that fixes them
        RLConfig(tis_cap=0.5)
    with pytest.raises(ConfigError, match="--samples-per-prompt must be >= 2"):
        RLConfig(samples_per_prompt=1)
    with pytest.raises(ConfigError, match="--router-dtype bfloat16 needs --trainer-dtype bfloat16"):
        RLConfig(router_dtype="bfloat16")


def test_command_line_rl_and_runs(tmp_path):
    """`r3lab rl` and `r3lab runs` as a user types them, in their own process: a second in-process vLLM engine would
    tear down the global parallel state the module's engine still uses when it closes."""
    import subprocess
    import sys

    def r3lab(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "r3lab", *args], capture_output=True, text=True, timeout=600)

    out = r3lab("rl", "--quick", "--modes", "R2", "--steps", "2", "--runs", str(tmp_path), "--name", "cli",
                "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| tiny-qwen3-moe | R2 | 1 x 2 |" in out.stdout and "run: " in out.stderr
    assert load(tmp_path / "cli-R2-s0").finished
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    listing = r3lab("runs", str(tmp_path))
    assert listing.returncode == 0, listing.stderr
    assert "cli-R2-s0" in listing.stdout and "finished" in listing.stdout and "unreadable" in listing.stdout


# ---- collapse: the detector on synthetic series, and the run summary's block ---------------------------------------


def _climb(n, rng):
    t = np.arange(n)
    return 0.05 + 0.5 * (1 - np.exp(-t / 20)) + rng.normal(0, 0.04, n)


def test_collapse_detector_fires_on_a_collapse_and_stays_quiet_on_a_noisy_climb():
    from r3lab import metrics

    rng = np.random.default_rng(0)
    for seed in range(20):  # a noisy climb, with single-step dips to a third of the level, never collapses
        r = _climb(120, np.random.default_rng(seed))
        r[[40, 70, 71]] *= 0.3
        c = metrics.reward_collapse(r)
        assert c.step is None and not c.collapsed.any(), seed
    r = _climb(120, rng)
    r[60:] = 0.05 + rng.normal(0, 0.01, 60)  # the reward falls to its start and stays there
    c = metrics.reward_collapse(r)
    assert c.step == 60 and c.detected == 64
    assert not c.collapsed[:64].any() and c.collapsed[64:].all()
    assert c.streak[60:65].tolist() == [1, 2, 3, 4, 5]
    assert np.isnan(c.peak[:10]).all() and c.peak[59] == pytest.approx(r[:60].max())
    # a run that never learned cannot collapse on noise; a collapse inside the warm-up is not judged there
    assert metrics.reward_collapse(np.abs(rng.normal(0.02, 0.01, 50))).step is None
    assert metrics.reward_collapse(np.r_[0.5, np.full(30, 0.1)], warmup=3).step == 3


def test_effective_sample_size_by_hand():
    from r3lab import metrics

    assert metrics.effective_sample_size(np.zeros(7)) == pytest.approx(1.0)
    w = np.array([1.0, 3.0])  # (1 + 3)^2 / (2 * (1 + 9)) = 0.8
    assert metrics.effective_sample_size(np.log(w)) == pytest.approx(0.8)
    assert metrics.effective_sample_size(np.log(w) + 800.0) == pytest.approx(0.8)  # stable for large ratios


def test_collapse_summary_names_the_step_and_the_reason():
    rng = np.random.default_rng(1)
    r = _climb(40, rng)
    r[25:] = 0.02
    hist = [{"reward_mean": float(x), "mismatch/k3_kl": 1e-4 * (100 if i == 30 else 1), "train/clip_frac_max": 0.1,
             "mismatch/is_eff_sample_size": 0.99, "train/policy_is_ess": 0.9} for i, x in enumerate(r)]
    out = rl.collapse_summary(hist)
    assert out["collapse/step"] == 25 and out["collapse/detected_step"] == 29
    assert "step 25" in out["collapse/reason"] and "half its running peak" in out["collapse/reason"]
    assert out["collapse/first_blowup_step/mismatch/k3_kl"] == 30
    assert out["collapse/first_blowup_step/train/clip_frac_max"] is None
    quiet = rl.collapse_summary(hist[:24])
    assert quiet["collapse/step"] is None and quiet["collapse/reason"] is None


def test_gspo_and_the_edges_task_in_a_quick_run(engine, monkeypatch):
    """--loss gspo reaches the trainer's update with its clip range and sample ids; --task edges is the reward."""
    seen = []
    step = HFTrainer.policy_step

    def spy(self, batch, update, *, routes=None):
        seen.append((update.loss, update.clip_eps, update.clip_eps_high, update.token_sample.tolist(),
                     batch.token_sample.tolist()))
        return step(self, batch, update, routes=routes)

    monkeypatch.setattr(HFTrainer, "policy_step", spy)
    cfg = dataclasses.replace(QUICK, steps=2, loss="gspo", task="edges")
    run = run_rl(cfg, engine=engine, progress=False)
    assert len(seen) == 2 * QUICK.mini_batches
    assert all(s[:3] == ("gspo", 3e-4, 4e-4) and s[3] == s[4] for s in seen)
    for s in run.steps:
        assert 0 <= s["reward_mean"] <= 1 and s["train/clip_frac_max"] >= s["train/clip_frac"]
        assert 0 < s["train/policy_is_ess"] <= 1 and s["train/policy_abs_dlogp_max"] >= 0
        assert s["collapse/streak"] == 0 and s["collapse/collapsed"] is False
    grpo = run_rl(dataclasses.replace(cfg, loss="grpo"), engine=engine, progress=False).steps
    assert grpo[0]["reward_mean"] == run.steps[0]["reward_mean"]  # the same first rollout, another objective
    assert grpo[0]["train/loss"] != run.steps[0]["train/loss"]


# ---- R3W: the engine's ids and routing weights replayed -------------------------------------------------------------
R3W = dataclasses.replace(QUICK, mode="R3W", prompts_per_step=1, samples_per_prompt=2, mini_batches=1, max_tokens=4)


@pytest.fixture(scope="module")
def weight_engine(engine_pool):
    """The session's engine that captures its routers' top-k weights (what R3W replays)."""
    with engine_pool.lease(model_dir(QUICK.model), seed=0, **rl.engine_options(R3W)) as eng:
        yield eng


def _experts_inputs(model):
    """Forward pre-hooks on every MoE block's experts: the routing weights each forward mixes the experts with."""
    seen, handles = {}, []
    for name, mod in model.named_modules():
        if name.endswith(".mlp.experts"):
            layer = int(name.split(".layers.")[1].split(".")[0])
            seen[layer] = []
            handles.append(mod.register_forward_pre_hook(
                lambda m, args, g=layer: seen[g].append(args[2].detach().clone())))
    return seen, handles


@pytest.mark.parametrize("variant", ["stop", "straight"])
def test_r3w_forwards_mix_the_experts_with_the_engines_captured_weights(weight_engine, variant):
    cfg = dataclasses.replace(R3W, weight_replay=variant)
    results = weight_engine.generate(["kupi kobire reti"], SamplingConfig(max_tokens=4, n=2, seed=5))
    batch = rl.RolloutBatch.from_results(results, np.array([0.0, 1.0]), 2)
    assert batch.engine_routes.weights is not None
    trainer = HFTrainer.load(model_dir(cfg.model), lr=cfg.lr)
    _, mask, _ = padded_batch(batch.tokens)
    real = mask.reshape(-1).bool().numpy()
    seen, handles = _experts_inputs(trainer.model)
    try:
        out = rl.train_step(trainer, batch, cfg, np.random.default_rng(0))
    finally:
        for h in handles:
            h.remove()
    engine_w = batch.engine_routes.select_layers(sorted(seen))
    for j, g in enumerate(sorted(seen)):
        want = engine_w.weights[:, j, :]
        # the forwards of one step: the native old-policy score, the R3W old-policy score, the live router's
        # record (router drift), the R3W policy step; the R3W ones see the captured weights bit for bit
        same = [np.array_equal(w.numpy()[real], want) for w in seen[g]]
        assert same == [False, True, False, True], (g, same)
        live = seen[g][0].numpy()[real]
        assert not np.array_equal(live, want)  # the live router's own weights differ from the engine's
    assert out.metrics["router/live_vs_replayed_ids"] == out.metrics["router/live_vs_engine_ids"]
    assert out.metrics["router/live_vs_engine_weights_l1"] > 0


def test_r3w_refuses_an_engine_without_weights_and_a_trainer_that_replays_ids_only(engine, monkeypatch):
    from r3lab import trainer_registry

    with pytest.raises(ConfigError, match="capture_weights"):
        run_rl(dataclasses.replace(R3W, steps=1), engine=engine, progress=False)
    assert RLConfig.quick(mode="R3W", trainer="megatron").mode == "R3W"  # both RL trainers replay weights
    ids_only = dataclasses.replace(trainer_registry.TRAINER_REGISTRY["megatron"], weight_replay=False)
    monkeypatch.setitem(trainer_registry.TRAINER_REGISTRY, "megatron", ids_only)
    with pytest.raises(ConfigError, match="R3W .* the megatron trainer replays ids only"):
        RLConfig.quick(mode="R3W", trainer="megatron")
    with pytest.raises(ConfigError, match="weight-replay straight applies to --mode R3W"):
        RLConfig.quick(mode="R3", weight_replay="straight")
    assert "R3W" in config.MODES and "R3W" not in config.DEFAULT_MODES
    assert rl.engine_options(R3W)["capture_weights"] and not rl.engine_options(QUICK)["capture_weights"]
