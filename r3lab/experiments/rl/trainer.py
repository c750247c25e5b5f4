"""The RL trainer of a config, the trainer-side copy of the behaviour weights, and what a run must say about it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from r3lab.cluster import place
from r3lab.config import RLConfig
from r3lab.errors import ConfigError, R3LabError
from r3lab.paths import model_dir
from r3lab.trainer_registry import TRAINER_REGISTRY, TrainerOptions
from r3lab.trainers import Scorer, Trainer
from r3lab.trainers.base import LoadsWeights


def trainer_options(config: RLConfig) -> TrainerOptions:
    """What the RL trainer of ``config`` is loaded with: ``trainer_dtype`` with ``router_dtype`` routers, the Megatron
    layout (``tp``, ``pp``, ``ep``; fp32 routers there) and its loader, and AdamW at ``lr``."""
    return TrainerOptions(dtype=config.trainer_dtype, router_dtype=config.router_dtype, tp=config.tp, pp=config.pp,
                          ep=config.ep, lr=config.lr, megatron_loader=config.megatron_loader)


def start_trainer(config: RLConfig, path: str | os.PathLike) -> Trainer:
    """The RL trainer of ``config`` (:func:`trainer_options`) from the checkpoint at ``path``, where the config places
    it (:func:`r3lab.cluster.place`: this process, or Ray actors); the caller closes it."""
    trainer: Trainer = place(config, path).start_trainer(trainer_options(config))
    return trainer


def scorer_at(config: RLConfig, path: str | os.PathLike, weights: Any, *, scorer: Any = None) -> Scorer:
    """A scorer of ``config``'s trainer kind holding ``weights`` (a snapshot from ``export_weights``): the trainer-side
    copy of the behaviour weights. ``scorer`` (one this returned before) is reused: only the weights are loaded.

    Built by :func:`start_trainer`, so it runs in the trainer's own dtypes, mode, numerics and placement; the trainer
    kind must load weights back (:class:`r3lab.trainers.base.LoadsWeights`).
    """
    if scorer is None:
        scorer = start_trainer(config, path)
    if not isinstance(scorer, LoadsWeights):
        raise ConfigError(f"old_logprobs='behaviour' needs a trainer that loads exported weights back "
                          f"(load_weights); the {getattr(scorer, 'name', type(scorer).__name__)!r} trainer does not")
    scorer.load_weights(weights)
    loaded: Any = scorer  # a Scorer that also loads weights
    return loaded


def trainer_notes(config: Mapping[str, Any]) -> dict[str, str]:
    """What the run summary and the comparison table must say about the trainer: ``note/group_routing`` when the
    Megatron trainer routes the model natively differently from the engine by construction (group-limited routing,
    :func:`r3lab.families.group_routing_mismatch`; the drift table says the same)."""
    if not getattr(TRAINER_REGISTRY.get(str(config.get("trainer"))), "group_routing_notes", False):
        return {}
    from r3lab.families import group_routing_note, model_group_routing

    try:
        why = model_group_routing(model_dir(config["model"], config.get("data")))
    except R3LabError as e:  # a run read on a machine without its model: say so, never drop the question
        return {"note/group_routing": f"{config['model']}: not checked ({e})"}
    if why is None:
        return {}
    return {"note/group_routing": group_routing_note(Path(str(config["model"])).name, why,
                                                     "Its \"none\" and R2 runs' engine-trainer mismatch includes")}
