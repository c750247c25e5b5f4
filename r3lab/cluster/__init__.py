"""Where the engine and the trainer live: in this process, attached to a server, or as Ray actors on a cluster::

    from r3lab.cluster import place
    placed = place(config, path)                         # where config says: engine_url, cluster, or this process
    with placed.engine(seed=0) as engine, placed.start_trainer(TrainerOptions(lr=1e-3)) as trainer:
        ...

:func:`place` is the one placement step (:mod:`~r3lab.cluster.placement`: the registry of placements, each side's
builder, the config field that chooses it); the experiments (``r3lab drift`` / ``r3lab rl`` / ``r3lab capture`` /
``r3lab rescore``) start their engines and trainers through it and never ask where they run. The placements:
:mod:`~r3lab.cluster.local` (this process), :mod:`~r3lab.cluster.attached` (a vLLM server the user started,
``--engine-url``) and, for ``--cluster ray`` (the configs' ``cluster`` field, which the notebooks and the dashboard
pass as a keyword), the Ray actors: :mod:`~r3lab.cluster.connect` (joining a cluster as Ray's tools do;
resources), :mod:`~r3lab.cluster.waits` (all-or-none bounded waits), :mod:`~r3lab.cluster.engine`
(:class:`RayEngine`), :mod:`~r3lab.cluster.megatron` (:class:`RayRanks`, the Megatron trainer's rank transport on
Ray; :class:`RayMegatronTrainer`, :class:`RemoteWeights`) and
:mod:`~r3lab.cluster.trainer` (:class:`RayTrainer`).

Layering: this package joins the inference side and the trainer side like an experiment does; ``rollout``,
``trainers`` and ``staging`` never import it. ``ray`` is imported when a function here runs, not on import, and
the Megatron rank actors' module (torch, the Megatron trainer) when :class:`RayRanks`, :class:`RayMegatronTrainer`
or :class:`RemoteWeights` is first named.
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
from r3lab.cluster.placement import (
    ENGINE,
    PLACEMENTS,
    TRAINER,
    Placed,
    Placement,
    PlacementSpec,
    place,
    placement_of,
    placement_spec,
    register_placement,
)
from r3lab.cluster.trainer import RayTrainer
from r3lab.cluster.waits import Member, gather

__all__ = [
    "DEFAULT_RESOURCES",
    "ENGINE",
    "PLACEMENTS",
    "TRAINER",
    "Member",
    "Placed",
    "Placement",
    "PlacementSpec",
    "RayEngine",
    "RayMegatronTrainer",
    "RayRanks",
    "RayTrainer",
    "RemoteWeights",
    "actor_options",
    "check_placeable",
    "connect",
    "gather",
    "parse_resources",
    "place",
    "placement_of",
    "placement_spec",
    "register_placement",
    "resolve_address",
]

_LAZY = {"RayMegatronTrainer": "r3lab.cluster.megatron", "RayRanks": "r3lab.cluster.megatron",
         "RemoteWeights": "r3lab.cluster.megatron"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'r3lab.cluster' has no attribute {name!r}")
