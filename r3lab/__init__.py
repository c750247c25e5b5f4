"""r3lab: a research workbench for Rollout Routing Replay (R3) in RL of Mixture-of-Experts models.

The package reads as the pipeline, data flowing one way::

    routes       the container: packed ragged expert ids, cu_seqlens, global layer ids
    compaction   transport: codecs, the versioned binary container, JSON payloads, engine readers
    rollout      capture on the inference side (vLLM in-process or over HTTP)
    slicing      per-rank shards for the trainer's parallel layout          (trainer side)
    staging      routes to many trainer ranks, one chunk per DP rank        (trainer side)
    replay       routes into the trainer's routers (Megatron, transformers) (trainer side)
    trainers     the trainer interface the experiments use (transformers; megatron-bridge)
    metrics      drift and routing metrics, pure functions on arrays
    experiments  joins the two sides: the drift experiment
    viz          plotly figures from results;  widgets: live monitor and ablation dashboard
    cli          the ``r3lab`` command

Every stage module is reachable after ``import r3lab`` (``r3lab.rollout.RolloutEngine``) and is imported
on first use, so ``import r3lab`` stays light (no vLLM, no torch). The core (routes, compaction, slicing,
staging's local backend, importers, doctor, runs) needs none of r3lab's extras; what does (``replay`` and the
trainers: torch; ``viz``: plotly; Ray staging: ray) raises :class:`~r3lab.errors.MissingExtraError`, naming the
extra to install, when its package is missing.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

__version__ = "0.1.0"
#: every public module and package of r3lab, read from the package itself (never a hand-kept list)
STAGES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))
__all__ = ["__version__", *STAGES]


def __getattr__(name: str) -> Any:
    if name in STAGES:
        return importlib.import_module(f"r3lab.{name}")
    raise AttributeError(f"module 'r3lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(STAGES))
