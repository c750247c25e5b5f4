"""Run the engine and the trainer ranks as Ray actors on a cluster, with the results of one machine.

    from r3lab.cluster import RayEngine, load_trainer
    engine = RayEngine("data/models/tiny-qwen3-moe", resources='{"GPU": 1}')        # an actor placed by resources
    trainer = load_trainer("megatron", path, TrainerOptions(tp=2, lr=1e-3), resources='{"GPU": 1}')  # rank actors

``--cluster ray`` on ``r3lab drift`` / ``r3lab rl`` / ``r3lab rescore`` (the configs' ``cluster`` field, which the
notebooks and the dashboard pass as a keyword) runs the same experiment code with these in place of the local
engine and trainer. Modules: :mod:`~r3lab.cluster.connect` (joining a cluster as Ray's tools do; resources),
:mod:`~r3lab.cluster.waits` (all-or-none bounded waits), :mod:`~r3lab.cluster.engine` (:class:`RayEngine`),
:mod:`~r3lab.cluster.megatron` (:class:`RayMegatronTrainer`, :class:`RemoteWeights`) and
:mod:`~r3lab.cluster.trainer` (:class:`RayTrainer`, :func:`load_trainer`).

Layering: this package joins the inference side and the trainer side like an experiment does; ``rollout``,
``trainers`` and ``staging`` never import it. ``ray`` is imported when a function here runs, not on import, and
the Megatron rank actors' module (torch, the Megatron trainer) when :class:`RayMegatronTrainer` or
:class:`RemoteWeights` is first named.
"""

import importlib
from typing import Any

from r3lab.cluster.connect import (
    DEFAULT_RESOURCES,
    actor_options,
    check_placeable,
    connect,
    parse_resources,
    resolve_address,
)
from r3lab.cluster.engine import RayEngine
from r3lab.cluster.trainer import RayTrainer, load_trainer
from r3lab.cluster.waits import Member, gather
from r3lab.errors import ClusterError  # noqa: F401  (importable here as before; exported by r3lab.errors)

__all__ = [
    "DEFAULT_RESOURCES",
    "Member",
    "RayEngine",
    "RayMegatronTrainer",
    "RayTrainer",
    "RemoteWeights",
    "actor_options",
    "check_placeable",
    "connect",
    "gather",
    "load_trainer",
    "parse_resources",
    "resolve_address",
]

_LAZY = {"RayMegatronTrainer": "r3lab.cluster.megatron", "RemoteWeights": "r3lab.cluster.megatron"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'r3lab.cluster' has no attribute {name!r}")
