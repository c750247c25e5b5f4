"""The ``local`` placement of both sides (:mod:`r3lab.cluster.placement`): the engine and the trainer in this
process, what an experiment gets when its config names no other place.

The engine is a :class:`~r3lab.rollout.RolloutEngine` (vLLM's engine core in this process unless the options say
``in_process=False``); the trainer is loaded by the trainer registry's own loader
(:func:`r3lab.trainer_registry.load_trainer`: transformers here, Megatron-core on spawned gloo ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from r3lab.trainer_registry import TrainerOptions, load_trainer

__all__: list[str] = []  # the placement registry reaches the builders by path


def build_engine(config: Any, path: Path, options: dict[str, Any]) -> Any:
    """A :class:`~r3lab.rollout.RolloutEngine` on the checkpoint at ``path`` with ``options`` (seed, dtype, ...)."""
    from r3lab.rollout import RolloutEngine  # vLLM is imported when it starts, not here

    return RolloutEngine(path, **options)


def build_trainer(config: Any, path: Path, options: TrainerOptions) -> Any:
    """Trainer ``config.trainer`` loaded from ``path`` with ``options``, in this process (its ranks spawned here)."""
    return load_trainer(config.trainer, path, options)
