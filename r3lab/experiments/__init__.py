"""Experiments: join capture (``r3lab.rollout``) and a trainer (``r3lab.trainers``) to measure what replay changes.

``drift``: the main job, trainer vs engine log-probability drift without replay and with R3, over seeds, for any
trainer (``DriftConfig.trainer``: transformers on CPU, a megatron-bridge GPTModel on a GPU node).
``rl``: a GRPO loop comparing no replay, R2 and R3, written as runs (``r3lab.runs``), over the trainer interface.
``rescore``: a finished run's stored samples scored again with another trainer, layout or dtype (``r3lab rescore``).
``notebook``: what the notebooks share (load finished runs, else run the experiment small).
"""

from r3lab.experiments.drift import (
    DriftRow,
    DriftSample,
    drift_spread,
    drift_summary,
    drift_table,
    load_scorer,
    replay_drift,
    run_drift,
    seed_inputs,
)
from r3lab.experiments.notebook import load_or_run
from r3lab.experiments.rescore import rescore_run, rescore_table

__all__ = [
    "DriftRow",
    "DriftSample",
    "drift_spread",
    "drift_summary",
    "drift_table",
    "load_scorer",
    "replay_drift",
    "run_drift",
    "seed_inputs",
    "load_or_run",
    "rescore_run",
    "rescore_table",
]
