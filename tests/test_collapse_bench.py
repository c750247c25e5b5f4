"""bench/bench_collapse.py: the registered protocol is the issue's, its decision rule and tests on planted runs,
and its --quick path (2 steps of arms A and B) runs end to end on the session's int4 engine."""

import sys
from pathlib import Path

import numpy as np
import pytest

from r3lab.paths import model_dir

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
try:
    import bench_collapse
finally:
    sys.path.pop(0)


def test_the_protocol_names_the_setting_arms_tests_and_rule():
    p = bench_collapse.PROTOCOL
    for phrase in ("ladder task", "tiny-qwen3-moe", "16 tokens", "4 prompts x 8 samples", "2 mini-batches",
                   "lr 3e-3", "clip 0.2", "gradient-norm clip 1.0", "400 steps", "A: none", "B: R3", "C: none",
                   "14 seeds", "Fisher's exact test, two-sided, alpha 0.05", "Kaplan-Meier", "log-rank",
                   "at least 6 of 14 and B in at most 1", "at most 2", "Branching: none"):
        assert phrase in p, phrase
    cfgs = bench_collapse.plan()
    assert len(cfgs) == 3 * 14
    a, b, c = cfgs["A-s0"], cfgs["B-s0"], cfgs["C-s13"]
    assert (a.mode, a.engine_quant, b.mode, b.engine_quant, c.mode, c.engine_quant) == (
        "none", "int4", "R3", "int4", "none", "none")
    assert (a.task, a.max_tokens, a.prompts_per_step, a.samples_per_prompt, a.mini_batches, a.lr, a.clip_eps,
            a.max_grad_norm, a.steps) == ("ladder", 16, 4, 8, 2, 3e-3, 0.2, 1.0, 400)


def test_the_decision_rule_and_the_primary_test_where_they_disagree():
    d = bench_collapse.decision
    assert d(7, 14, 1, 14) == "reproduction" and d(6, 14, 0, 14) == "reproduction"
    assert d(6, 14, 1, 14).startswith("count rule met, primary test not significant (p 0.077")
    assert d(2, 14, 0, 14) == "bounded null" and d(4, 14, 3, 14) == "inconclusive"
    assert d(9, 10, 0, 10).startswith("not decided")


def _planted(tmp_path, name, cfg, reward, k3):
    from r3lab.runs import RunWriter

    w = RunWriter(tmp_path, name, "rl", cfg.to_dict())
    for i in range(reward.size):
        w.log_step({"step": i, "reward_mean": float(reward[i]), "mismatch/k3_kl": float(k3[i]),
                    "routing/flipped_token_share": 0.1, "mismatch/k3_kl_flipped": float(5 * k3[i]),
                    bench_collapse.LOW_PROB: 0.01, bench_collapse.ZERO_ADV: 0.25, "train/grad_norm_max": 2.0,
                    "train/entropy": 0.1, "mismatch/is_eff_sample_size": 0.9})
    w.finish({})
    w.close()


def test_the_report_counts_late_collapses_and_ranks_the_k3_before_each(tmp_path):
    from r3lab.runs import list_runs

    rng = np.random.default_rng(0)
    for arm in ("A", "B"):
        for seed in range(3):
            cfg = bench_collapse.base_config(steps=120, seed=seed, **bench_collapse.ARMS[arm])
            reward = np.full(120, 0.5)
            k3 = rng.uniform(1e-4, 2e-4, 120)
            if arm == "A" and seed < 2:  # two collapses at step 90, each after the run's largest k3
                reward[90:] = 0.0
                k3[85] = 1.0
            _planted(tmp_path, f"{arm}-s{seed}", cfg, reward, k3)
    text = bench_collapse.report([r for _, r in list_runs(tmp_path)], wall_s=3600.0, planned=6)
    assert "| A: none, int4 engine | 3 | 2 | 0.67 |" in text and "| B: R3, int4 engine | 3 | 0 | 0.00 |" in text
    assert "| A vs B (primary) | 2/3 vs 0/3 | 0.400 |" in text  # Fisher: 2 of 3 vs 0 of 3, p = 6/15
    assert "| A-s0 | 90 | 1 (85) | 1 of 120 | 0.50 |" in text  # 0.1 x 5 k3 / k3: half on flipped tokens
    assert "not decided: 3 and 3 seeds" in text and "1.00 hours of wall time" in text
    assert bench_collapse.PROTOCOL in text


def test_the_quick_run_goes_end_to_end(engine_pool, tmp_path):
    from r3lab.runs import list_runs

    with engine_pool.lease(model_dir("tiny-qwen3-moe"), seed=0, engine_quant="int4") as eng:
        bench_collapse.run_plan(tmp_path, bench_collapse.plan(steps=2, seeds=(0,), arms=("A", "B")),
                                engines={"int4": eng})
    runs = [r for _, r in list_runs(tmp_path)]
    assert sorted(r.name for r in runs) == ["A-s0", "B-s0"] and all(len(r.step_records) == 2 for r in runs)
    for r in runs:
        assert 0 <= r.step_records[-1][bench_collapse.LOW_PROB] <= 1
        assert 0 <= r.step_records[-1][bench_collapse.ZERO_ADV] <= 1
    text = bench_collapse.report(runs, wall_s=None, planned=2, title=" (--quick)")
    assert "| A: none, int4 engine | 1 | 0 |" in text and "| A vs B (primary) | 0/1 vs 0/1 | 1.000 |" in text


@pytest.mark.parametrize("flag", ["--report"])
def test_the_report_without_committed_runs_names_the_command(flag, monkeypatch, tmp_path):
    monkeypatch.setattr(bench_collapse, "REFERENCE", tmp_path / "nothing")
    with pytest.raises(SystemExit, match="--work DIR"):
        bench_collapse.main([flag])
