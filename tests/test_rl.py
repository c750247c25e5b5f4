"""The RL loop (r3lab.experiments.rl) on the --quick setting: it learns, weights reach the engine, and each
replay mode feeds the trainer's forwards the routes its definition says."""

import dataclasses

import numpy as np
import pytest

import r3lab.experiments.rl as rl
from r3lab.errors import ConfigError
from r3lab.experiments.rl import RLConfig, comparison_rows, comparison_table, run_rl
from r3lab.paths import model_dir
from r3lab.rollout import RolloutEngine
from r3lab.runs import load

QUICK = RLConfig.quick()
TIMING = ("time_generate_s", "time_weight_sync_s", "time_step_s")


@pytest.fixture(scope="module")
def engine():
    with RolloutEngine(model_dir(QUICK.model), seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def spied(engine):
    """One quick run per mode, recording the routes every policy-update forward replayed."""
    calls: dict[str, list] = {}
    real = rl.score_batch

    def spy(model, ids, mask, scored, **kw):
        out = real(model, ids, mask, scored, **kw)
        calls[mode].append({"grad": kw.get("grad", False), "record": kw.get("record", False),
                            "routes": kw.get("routes"), "recorded": out.routes, "rows": ids.shape[0]})
        return out

    runs = {}
    for mode in rl.MODES:
        calls[mode] = []
        rl.score_batch = spy
        try:
            runs[mode] = run_rl(dataclasses.replace(QUICK, mode=mode, steps=2), engine=engine, progress=False)
        finally:
            rl.score_batch = real
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
    import torch

    from r3lab.replay import load_hf_model, score_batch
    from r3lab.rollout import SamplingConfig

    results = engine.generate(["kupi kobire reti"], SamplingConfig(max_tokens=8, n=2, seed=3))
    batch = rl._make_batch(results, np.zeros(2), 2)
    model = load_hf_model(model_dir(QUICK.model))
    out = score_batch(model, batch.ids, batch.mask, batch.response, routes=batch.engine_routes, record=True)
    assert out.routes == batch.engine_routes.select_layers(out.routes.layer_ids)  # record after replay equals them
    own = score_batch(model, batch.ids, batch.mask, batch.response, record=True)
    assert not torch.equal(out.logprobs, own.logprobs) or own.routes == out.routes


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
    with pytest.raises(ConfigError, match="tis_cap"):
        RLConfig(tis_cap=0.5)
    with pytest.raises(ConfigError, match="samples_per_prompt"):
        RLConfig(samples_per_prompt=1)
    with pytest.raises(ConfigError, match="bf16 trainer"):
        RLConfig(router_dtype="bfloat16")


def test_command_line_rl_and_runs(tmp_path, capfd):
    from r3lab.cli import main

    main(["rl", "--quick", "--modes", "R2", "--steps", "2", "--runs", str(tmp_path), "--name", "cli", "--no-progress"])
    out = capfd.readouterr()
    assert "| tiny-qwen3-moe | R2 | 1 x 2 |" in out.out and "run: " in out.err
    assert load(tmp_path / "cli-R2-s0").finished
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    main(["runs", str(tmp_path)])
    listing = capfd.readouterr().out
    assert "cli-R2-s0" in listing and "finished" in listing and "unreadable" in listing
