"""The RL trainer of a config, the trainer-side copy of the behaviour weights, and what a run must say about it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from r3lab.config import RLConfig
from r3lab.errors import ConfigError, R3LabError
from r3lab.paths import model_dir
from r3lab.trainer_registry import TRAINER_REGISTRY, TrainerOptions
from r3lab.trainer_registry import load_trainer as load_registered
from r3lab.trainers import Scorer, Trainer
from r3lab.trainers.base import LoadsWeights

__all__ = ["load_trainer", "scorer_at", "trainer_notes"]


def load_trainer(config: RLConfig, path: str | os.PathLike) -> Trainer:
    """The RL trainer of ``config``: transformers (``trainer_dtype`` with ``router_dtype`` routers) or Megatron-core
    on ``tp * pp * dp`` CPU ranks (``config.trainer == "megatron"``, fp32 routers), each with AdamW at ``lr``; with
    ``config.cluster``, on a Ray cluster (:func:`r3lab.cluster.load_trainer`)."""
    options = TrainerOptions(dtype=config.trainer_dtype, router_dtype=config.router_dtype, tp=config.tp, pp=config.pp,
                             ep=config.ep, lr=config.lr, megatron_loader=config.megatron_loader)
    if config.cluster is not None:  # on the Ray cluster: Megatron's ranks as actors in one placement group
        from r3lab.cluster import load_trainer as load_on_cluster

        return load_on_cluster(config.trainer, path, options, cluster=config.cluster,
                               resources=config.trainer_resources, timeout_s=config.cluster_timeout)
    return load_registered(config.trainer, path, options)


def scorer_at(config: RLConfig, path: str | os.PathLike, weights: Any, *, scorer: Any = None) -> Scorer:
    """A scorer of ``config``'s trainer kind holding ``weights`` (a snapshot from ``export_weights``): the trainer-side
    copy of the behaviour weights. ``scorer`` (one this returned before) is reused: only the weights are loaded.

    Built by :func:`load_trainer`, so it runs in the trainer's own dtypes, mode and numerics; the trainer kind must
    load weights back (:class:`r3lab.trainers.base.LoadsWeights`).
    """
    if scorer is None:
        scorer = load_trainer(config, path)
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
