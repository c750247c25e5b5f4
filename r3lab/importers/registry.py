"""The importer registry: one entry per dump kind, read by :func:`r3lab.importers.import_run` and ``r3lab import``.

Each entry names the module that imports that kind; the module exports ``import_<kind>(src, out, **options) ->
Path``, ``detect(path) -> str | None`` (a short reason when a folder looks like that framework's, else None),
``OPTIONS: dict[str, str]`` (keyword option name -> help text) and ``LAYOUTS`` (the dump layouts it reads, each a
:class:`r3lab.importers.layouts.Layout`, recognised from the bytes and recorded in the run). Modules are imported
only when an entry is used, so an entry whose module is not in this r3lab is a clear error
(:class:`ImporterMissingError`), not a broken package. Adding an importer = one module + one :data:`REGISTRY`
entry; nothing else lists kinds. Another distribution adds one without editing r3lab by entry point, in group
``r3lab.importers``: the entry point's name is the kind and its object the kind's :class:`ImporterSpec`
(:mod:`r3lab._plugins`); the group is read into :data:`REGISTRY` on its first lookup.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from r3lab._plugins import PluginRegistry
from r3lab.errors import ConfigError, ImporterMissingError, ImportFormatError

__all__ = ["REGISTRY", "spec"]

AUTO = "auto"  # the kind that asks every importer's detect


@dataclass(frozen=True)
class ImporterSpec:
    """One dump kind: its module and import function, what it is and what it reads."""

    kind: str
    module: str  # e.g. "r3lab.importers.slime"
    function: str  # e.g. "import_slime"
    description: str  # one line: the framework and what the import gives
    reads: str  # what SRC is

    def load(self) -> ModuleType:
        """The importer module; :class:`ImporterMissingError` if this r3lab does not have it."""
        if not self.available:
            have = [k for k, s in REGISTRY.items() if s.available]
            raise ImporterMissingError(f"the {self.kind} importer ({self.module}) is not in this r3lab; this "
                                       f"r3lab imports {have}")
        return importlib.import_module(self.module)

    @property
    def available(self) -> bool:
        """Whether this r3lab has the module (found without importing it)."""
        return importlib.util.find_spec(self.module) is not None

    @property
    def import_function(self) -> Callable[..., Path]:
        mod = self.load()
        fn = getattr(mod, self.function, None)
        if not callable(fn):
            raise ImporterMissingError(f"{self.module} has no {self.function}() (the registry's {self.kind} entry)")
        return fn

    @property
    def options(self) -> Mapping[str, str]:
        """Keyword option -> help text: what ``import_run(kind, ..., **options)`` and ``r3lab import KIND`` take."""
        return dict(getattr(self.load(), "OPTIONS", {}))

    @property
    def layouts(self) -> tuple[Any, ...]:
        """The dump layouts this kind's importer reads, oldest first (:class:`r3lab.importers.layouts.Layout`)."""
        return tuple(getattr(self.load(), "LAYOUTS", ()))

    def detect(self, path: Path) -> str | None:
        """A short reason when ``path`` looks like this kind's dump, else None (None also when it cannot tell)."""
        fn = getattr(self.load(), "detect", None)
        return None if fn is None else fn(path)


def _entry(kind: str, module: str, description: str, reads: str) -> ImporterSpec:
    return ImporterSpec(kind, f"r3lab.importers.{module}", f"import_{module}", description, reads)


def _plugin_importer(name: str, spec: Any) -> ImporterSpec:
    """What an ``r3lab.importers`` entry point loaded, checked: the :class:`ImporterSpec` of kind ``name``, whose
    module can be found."""
    if not isinstance(spec, ImporterSpec):
        raise ConfigError(f"an r3lab.importers entry point names an ImporterSpec, got {spec!r}")
    if spec.kind != name or name == AUTO:
        raise ConfigError(f"its kind is {spec.kind!r}: name the entry point after the kind (any but {AUTO!r})")
    if not spec.available:
        raise ConfigError(f"its importer module {spec.module!r} cannot be found")
    return spec


REGISTRY: PluginRegistry[ImporterSpec] = PluginRegistry("r3lab.importers", "importer", _plugin_importer)
"""Every dump kind r3lab knows, by name (the CLI's ``r3lab import KIND`` choices, in this order): r3lab's own, then
those of the ``r3lab.importers`` entry points (read on the first lookup)."""
for _spec in (
    _entry("slime", "slime", "slime (THUDM/slime) rollout dumps, with routes, and their train dumps",
           "the --save-debug-rollout-data folder (or one .pt file)"),
    _entry("miles", "miles", "Miles (radixark/miles) rollout dumps (numpy routes) and train_data/ dumps",
           "the rollout dump folder (or one .pt file)"),
    _entry("nemo-rl", "nemo_rl", "NeMo-RL (NVIDIA-NeMo/RL) train_data_step{N}.jsonl: both log-probs, advantages",
           "the log folder (or one train_data_step<N>.jsonl)"),
    _entry("prime-rl", "prime_rl", "prime-rl (PrimeIntellect-ai/prime-rl) token exports: both log-probs",
           "the output folder or its token_exports/"),
    _entry("skyrl", "skyrl", "SkyRL (NovaSky-AI/SkyRL) dump_data_batch pickles: routes, both log-probs, "
           "advantages (no rewards)",
           "export_path or its dumped_data/"),
    _entry("verl", "verl", "verl (verl-project/verl) RolloutSkip gen_batch.dp (numpy serialization), "
           "skip.async_rollout folders and skip.rollout_tq tq_batch.pt: routes, engine log-probs, rewards",
           "RolloutSkip's dump_dir or any folder under it"),
    ImporterSpec("megatron-trace", "r3lab.importers.megatron_trace", "import_megatron_trace",
                 "Megatron-LM (NVIDIA/Megatron-LM) --moe-routing-trace-path: trainer-side expert load per step, layer "
                 "and rank (no tokens or samples)", "the trace folder of router_trace_rank<R>.jsonl files"),
):
    REGISTRY[_spec.kind] = _spec
del _spec


def spec(kind: str) -> ImporterSpec:
    """The registry entry of ``kind``; a clear error naming the kinds r3lab imports for any other name."""
    if kind not in REGISTRY:
        raise ImportFormatError(f"unknown dump kind {kind!r}; r3lab imports {list(REGISTRY)} (or {AUTO!r}: "
                                "recognise the framework from the files)")
    return REGISTRY[kind]


def detect_kind(src: str | os.PathLike, registry: Mapping[str, ImporterSpec] | None = None) -> tuple[str, str]:
    """``(kind, reason)`` of the one importer that recognises ``src``; refuses a folder none or several recognise.

    Every available importer's ``detect`` is asked. None recognising it: the error says what each looked for
    (the kinds and what they read). Several: the error names every candidate with its reason, and how to choose.
    """
    reg = REGISTRY if registry is None else registry
    p = Path(src)
    if not p.exists():
        raise ImportFormatError(f"{str(p)!r} does not exist (give a dump file or the folder a framework wrote)")
    found: list[tuple[str, str]] = []
    for kind, s in reg.items():
        if not s.available:
            continue
        reason = s.detect(p)
        if reason:
            found.append((kind, reason))
    if not found:
        looked = "; ".join(f"{k}: {s.reads}" for k, s in reg.items() if s.available)
        raise ImportFormatError(f"no importer recognises {str(p)!r}; looked for {looked}. Name the kind "
                                "(r3lab import KIND SRC) if you know which framework wrote it")
    if len(found) > 1:
        raise ImportFormatError(f"{str(p)!r} is ambiguous: " + "; ".join(f"{k} ({r})" for k, r in found)
                                + ". Name the kind: r3lab import KIND SRC, KIND one of "
                                + ", ".join(k for k, _ in found))
    return found[0]


def check_options(kind: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options given (None means not given) if ``kind`` declares each; refuses any other by name."""
    given = {k: v for k, v in options.items() if v is not None}
    declared = spec(kind).options
    unknown = sorted(set(given) - set(declared))
    if unknown:
        takes = ", ".join(sorted(declared)) or "none"
        raise ImportFormatError(f"options {unknown} do not apply to {kind} dumps ({kind} takes: {takes})")
    return given
