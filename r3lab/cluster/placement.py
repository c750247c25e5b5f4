"""Where the engine and the trainer live, decided in one place: :func:`place`.

An experiment's config says where each side runs, through its fields: ``engine_url`` (a vLLM server the user
started: the engine is attached to it), ``cluster`` (both sides as Ray actors, placed by ``engine_resources`` and
``trainer_resources``, every call bounded by ``cluster_timeout``), neither (both in this process).
:func:`placement_of` reads it; :func:`place` returns a :class:`Placed` that starts the engine and the trainers
there. The experiments ask it for "the engine, with these options" and "a trainer, with these options", and never
ask where.

Each side has a registry of placements (:data:`PLACEMENTS`), one :class:`PlacementSpec` each, which names its
builder by module path (imported only when it builds, as the trainer registry names its loaders) and the config
field that chooses it (in parentheses):

* engine, ``local`` (the default): ``r3lab.cluster.local:build_engine``, vLLM in this process;
* engine, ``attached`` (``engine_url``): ``r3lab.cluster.attached:build_engine``, the user's server;
* engine, ``ray`` (``cluster``): ``r3lab.cluster.engine:build_engine``, vLLM in a Ray actor;
* trainer, ``local`` (the default): ``r3lab.cluster.local:build_trainer``, the registry's loader here;
* trainer, ``ray`` (``cluster``): ``r3lab.cluster.trainer:build_trainer``, Ray actors (Megatron: one per rank).

A side goes to the first placement, in registration order, whose field the config sets (``engine_url`` before
``cluster``: a drift run may sample from a server and score on Ray), else to its default. Builders take
``(config, path, options)``: the experiment's config (a placement reads its own fields there), the checkpoint, and
the engine's keyword options (a dict) or the trainer's :class:`~r3lab.trainer_registry.TrainerOptions`.

Adding a placement (a remote trainer service, say): one module with ``build_trainer(config, path, options)`` (or
``build_engine``) returning a :class:`~r3lab.trainers.base.Trainer` (an :class:`~r3lab.rollout.Engine`), and one
:func:`register_placement` entry at the end of this module naming the config field that chooses it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from r3lab.errors import ConfigError
from r3lab.rollout.base import Engine
from r3lab.trainer_registry import TrainerOptions

if TYPE_CHECKING:  # mypy proves each engine class an Engine, each trainer a Trainer, each rank transport a
    # RankTransport (tests/test_typing.py runs it over r3lab/)
    from r3lab.cluster.engine import RayEngine
    from r3lab.cluster.megatron import RayMegatronTrainer, RayRanks
    from r3lab.cluster.trainer import RayTrainer
    from r3lab.rollout import AttachedServer, RolloutEngine, RolloutServer
    from r3lab.trainers.base import Scorer, Trainer
    from r3lab.trainers.hf import HFTrainer
    from r3lab.trainers.megatron.trainer import MegatronTrainer
    from r3lab.trainers.megatron.transport import RankTransport, SpawnedRanks
    from r3lab.trainers.megatron_bridge import MegatronBridgeTrainer

    def _each_class_meets_its_protocol(in_process: RolloutEngine, launched: RolloutServer, attached: AttachedServer,
                                       engine_actor: RayEngine, hf: HFTrainer, megatron: MegatronTrainer,
                                       trainer_actor: RayTrainer, rank_actors: RayMegatronTrainer,
                                       bridge: MegatronBridgeTrainer, spawned: SpawnedRanks,
                                       ray_ranks: RayRanks) -> None:
        """Never called: mypy checks each item against its protocol and names the one that does not meet it."""
        engines: list[Engine] = [in_process, launched, attached, engine_actor]
        trainers: list[Trainer] = [hf, megatron, trainer_actor, rank_actors]
        scorers: list[Scorer] = [bridge]
        transports: list[RankTransport] = [spawned, ray_ranks]  # the Megatron trainer's two ways to its ranks
        del engines, trainers, scorers, transports


ENGINE, TRAINER = "engine", "trainer"


@dataclass(frozen=True)
class PlacementSpec:
    """One place a side can live: its name, its side, its builder and the config field that chooses it."""

    name: str
    side: str  # ENGINE or TRAINER
    builder: str  # "module:function", function(config, path, options) -> Engine / Trainer
    description: str  # one line for help texts and tables
    chosen_by: str | None = None  # the config field whose value (not None) puts the side here; None: the default
    external: bool = False  # the config names a running engine: an engine handed to the experiment too conflicts

    def build(self, config: Any, path: Path, options: Any) -> Any:
        """The builder's result (imports its module now)."""
        module, _, attr = self.builder.partition(":")
        fn: Callable[[Any, Path, Any], Any] = getattr(importlib.import_module(module), attr)
        return fn(config, path, options)


#: the placements of each side, by name, in registration order (the order a config's fields are asked in)
PLACEMENTS: dict[str, dict[str, PlacementSpec]] = {ENGINE: {}, TRAINER: {}}


def register_placement(spec: PlacementSpec) -> PlacementSpec:
    """Add ``spec`` to its side's registry: a known side, a ``module:function`` builder, a new name, and at most one
    default (``chosen_by=None``) per side."""
    if spec.side not in PLACEMENTS:
        raise ConfigError(f"placement {spec.name!r}: side must be one of {sorted(PLACEMENTS)}, got {spec.side!r}")
    known = PLACEMENTS[spec.side]
    if spec.name in known:
        raise ConfigError(f"the {spec.side} side has a placement named {spec.name!r} already")
    if ":" not in spec.builder:
        raise ConfigError(f"placement {spec.name!r}: builder {spec.builder!r} must be 'module:function'")
    if spec.chosen_by is None and any(s.chosen_by is None for s in known.values()):
        raise ConfigError(f"placement {spec.name!r}: the {spec.side} side has a default already; name the config "
                          "field that chooses it (chosen_by)")
    known[spec.name] = spec
    return spec


def placement_spec(side: str, name: str) -> PlacementSpec:
    """The spec of ``side``'s placement ``name``; an unknown one is an error that lists the known ones."""
    known = PLACEMENTS.get(side)
    if known is None:
        raise ConfigError(f"no side {side!r}; the sides are {sorted(PLACEMENTS)}")
    spec = known.get(name)
    if spec is None:
        raise ConfigError(f"no {side} placement {name!r}; known {side} placements: {list(known)}")
    return spec


@dataclass(frozen=True)
class Placement:
    """Where each side lives: an engine placement's name and a trainer placement's (:data:`PLACEMENTS`)."""

    engine: str = "local"
    trainer: str = "local"

    def __post_init__(self) -> None:
        placement_spec(ENGINE, self.engine)
        placement_spec(TRAINER, self.trainer)


def _chosen(side: str, config: Any) -> str:
    default = None
    for spec in PLACEMENTS[side].values():
        if spec.chosen_by is None:
            default = spec.name
        elif getattr(config, spec.chosen_by, None) is not None:  # a config without the field never chooses it
            return spec.name
    if default is None:
        raise ConfigError(f"the {side} side has no default placement registered")
    return default


def placement_of(config: Any) -> Placement:
    """Where ``config`` puts each side: the first placement, in registration order, whose ``chosen_by`` field the
    config sets, else the side's default."""
    return Placement(engine=_chosen(ENGINE, config), trainer=_chosen(TRAINER, config))


class Placed:
    """An experiment's two sides, where its config puts them (made by :func:`place`): starts engines and trainers
    from the checkpoint at ``path``."""

    def __init__(self, config: Any, path: Path, placement: Placement, given_engine: Engine | None = None):
        self.config, self.path, self.placement = config, Path(path), placement
        self.given_engine = given_engine

    def start_engine(self, **options: Any) -> Engine:
        """A new engine where the placement puts it, started with ``options`` (seed, dtype, engine_quant,
        capture_weights, ...); the caller closes it (``with``)."""
        return placement_spec(ENGINE, self.placement.engine).build(self.config, self.path, options)

    def engine(self, **options: Any) -> AbstractContextManager[Engine]:
        """The engine to sample with, as a context: the caller's own (given to :func:`place`; left open), else a new
        one from :meth:`start_engine` (closed on exit)."""
        if self.given_engine is not None:
            return nullcontext(self.given_engine)
        return self.start_engine(**options)

    def start_trainer(self, options: TrainerOptions) -> Any:
        """A new trainer ``config.trainer`` where the placement puts it, with ``options`` (a
        :class:`~r3lab.trainers.base.Scorer`; a :class:`~r3lab.trainers.base.Trainer` where it takes policy steps);
        the caller closes it (``with``)."""
        return placement_spec(TRAINER, self.placement.trainer).build(self.config, self.path, options)


def place(config: Any, path: str | os.PathLike[str], *, engine: Engine | None = None,
          placement: Placement | None = None) -> Placed:
    """The placement step: where ``config`` puts the engine and the trainer (:func:`placement_of`, or
    ``placement``), ready to start them from the checkpoint at ``path``.

    ``engine``: one the caller started already (a notebook's, the test suite's shared engines), which
    :meth:`Placed.engine` hands out instead of starting one; refused when the config names a running engine of its
    own (``engine_url``): two engines for one run.
    """
    where = placement if placement is not None else placement_of(config)
    spec = placement_spec(ENGINE, where.engine)
    if engine is not None and spec.external:
        field = spec.chosen_by or "engine_url"
        raise ConfigError(f"an engine was handed in and {{{field}}} names the {spec.name} one too: give one",
                          field=field)
    return Placed(config, Path(path), where, engine)


register_placement(PlacementSpec(
    name="local", side=ENGINE, builder="r3lab.cluster.local:build_engine",
    description="vLLM in this process (RolloutEngine)"))
register_placement(PlacementSpec(
    name="attached", side=ENGINE, builder="r3lab.cluster.attached:build_engine", chosen_by="engine_url",
    external=True, description="a vLLM server the user started, at the config's engine_url (AttachedServer)"))
register_placement(PlacementSpec(
    name="ray", side=ENGINE, builder="r3lab.cluster.engine:build_engine", chosen_by="cluster",
    description="vLLM in a Ray actor placed by engine_resources (RayEngine)"))
register_placement(PlacementSpec(
    name="local", side=TRAINER, builder="r3lab.cluster.local:build_trainer",
    description="the registered trainer in this process (its ranks spawned here)"))
register_placement(PlacementSpec(
    name="ray", side=TRAINER, builder="r3lab.cluster.trainer:build_trainer", chosen_by="cluster",
    description="the registered trainer as Ray actors placed by trainer_resources (Megatron: one per rank)"))
