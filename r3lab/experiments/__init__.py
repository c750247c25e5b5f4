"""Experiments: join capture (``r3lab.rollout``) and replay (``r3lab.replay``) to measure what replay changes.

``drift``: the main job, trainer vs engine log-probability drift without replay and with R3, over seeds.
``rl``: a GRPO loop on CPU comparing no replay, R2 and R3, written as runs (``r3lab.runs``).
``megatron_drift``: the drift experiment with a Megatron-core trainer loaded by megatron-bridge (GPU nodes:
``scripts/gpu_check.sh``); its scoring runs on any Megatron GPTModel, CPU included.
"""

from r3lab.experiments.drift import (
    DriftConfig,
    DriftRow,
    DriftSample,
    drift_spread,
    drift_summary,
    drift_table,
    replay_drift,
    run_drift,
)

__all__ = [
    "DriftConfig",
    "DriftRow",
    "DriftSample",
    "drift_spread",
    "drift_summary",
    "drift_table",
    "replay_drift",
    "run_drift",
]
