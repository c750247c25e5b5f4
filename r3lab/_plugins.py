"""Extension points: another distribution adds a codec, an importer, a trainer or a model family by entry point.

A distribution declares its additions in its own ``pyproject.toml``; nothing in r3lab is edited::

    [project.entry-points."r3lab.codecs"]
    zlib = "my_pkg.codecs:Zlib"            # an IdCodec or ByteCodec subclass whose codec_id is "zlib"

    [project.entry-points."r3lab.importers"]
    my-rl = "my_pkg.importer:IMPORTER"     # an ImporterSpec whose kind is "my-rl"

    [project.entry-points."r3lab.trainers"]
    my-trainer = "my_pkg.trainer:TRAINER"  # a TrainerSpec named "my-trainer"

    [project.entry-points."r3lab.families"]
    my_moe = "my_pkg.family:FAMILY"        # a ModelFamily whose model_type is "my_moe"

An entry point's name is the name its object is registered under, and must be the object's own (its ``codec_id``,
``kind``, ``name`` or ``model_type``), so the name in the metadata and the name a user types are one. Each of the four
registries (:data:`r3lab.compaction.codecs.CODECS`, :data:`r3lab.importers.registry.REGISTRY`,
:data:`r3lab.trainer_registry.TRAINER_REGISTRY`, :data:`r3lab.families.FAMILIES`) is a :class:`PluginRegistry`: a
mapping that holds r3lab's own entries from import and reads its group's entry points once, on the first lookup.
Importing r3lab therefore imports no plugin, and a plugin's module may import r3lab's modules (the registry it is
read into included). The module an entry point names should stay light: a trainer spec names its loader as
``"module:function"`` and an importer spec its module, both imported only when used.

Nothing is skipped silently. A name that r3lab or another distribution holds already (a plugin adds names, it never
replaces one), an entry point that fails to import, or an object of the wrong type or name is a
:class:`~r3lab.errors.ConfigError` that names the group, the entry point and the distributions; the registry then
stays unread, so every later lookup raises the same error until the distribution is fixed or uninstalled.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Iterator, MutableMapping
from importlib import metadata
from typing import Any, TypeVar

from r3lab.errors import ConfigError

__all__ = ["PluginRegistry", "GROUP_PREFIX", "declared_entry_points"]

V = TypeVar("V")

#: every entry point group r3lab reads starts with this (``r3lab.codecs``, ``r3lab.importers``, ...)
GROUP_PREFIX = "r3lab."

#: the distribution the entries registered in code belong to (r3lab's built-in entries)
_BUILT_IN = "r3lab"


@functools.cache
def declared_entry_points() -> dict[str, tuple[tuple[metadata.EntryPoint, str], ...]]:
    """``group -> ((entry point, distribution name), ...)`` for every ``r3lab.*`` group of the installed
    distributions, sorted by entry point name; the distributions are read once per process (one pass for all four
    registries). A distribution found twice on the path counts once, the first found, as ``importlib.metadata``
    counts it."""
    found: dict[str, list[tuple[metadata.EntryPoint, str]]] = {}
    seen: set[str] = set()
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue  # a distribution without a name (a broken install) declares nothing r3lab can name
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        for ep in dist.entry_points:
            if ep.group.startswith(GROUP_PREFIX):
                found.setdefault(ep.group, []).append((ep, name))
    return {group: tuple(sorted(eps, key=lambda e: (e[0].name, e[1]))) for group, eps in found.items()}


class PluginRegistry(MutableMapping[str, V]):
    """A registry: name -> entry, r3lab's own entries from import, then those of entry point group ``group``.

    The group's entry points are read on the first lookup (reading an entry, its length, iterating, ``in``), once.
    Writing (``registry[name] = entry``, ``del``) and :meth:`peek` never read them: r3lab's own entries are written
    while their modules import, before any plugin may be read. ``adopt(name, obj)`` checks what an entry point
    loaded and returns the entry to keep, or raises :class:`~r3lab.errors.ConfigError` saying what is wrong with it.
    ``what`` names an entry in messages (``"codec"``, ``"trainer"``, ...).
    """

    def __init__(self, group: str, what: str, adopt: Callable[[str, Any], V]) -> None:
        if not group.startswith(GROUP_PREFIX):
            raise ConfigError(f"an r3lab entry point group starts with {GROUP_PREFIX!r}, got {group!r}")
        self.group = group
        self.what = what
        self._adopt = adopt
        self._entries: dict[str, V] = {}
        #: name -> the distribution whose entry point added it (r3lab's own entries are not listed)
        self.distributions: dict[str, str] = {}
        self._state = "unread"  # -> "reading" -> "read"; back to "unread" when reading fails
        self._lock = threading.RLock()

    # ---- writes, and the look that writing r3lab's own entries needs: never read the plugins --------------------
    def peek(self, name: str) -> V | None:
        """The entry under ``name`` as registered so far, without reading the plugins (None: none yet)."""
        return self._entries.get(name)

    def __setitem__(self, name: str, entry: V) -> None:
        self._entries[name] = entry
        self.distributions.pop(name, None)  # now registered in code

    def __delitem__(self, name: str) -> None:
        del self._entries[name]
        self.distributions.pop(name, None)

    # ---- lookups: read the plugins first ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> V:
        self._read()
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        self._read()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        self._read()
        return iter(self._entries)

    def __len__(self) -> int:
        self._read()
        return len(self._entries)

    def __repr__(self) -> str:
        self._read()
        return f"PluginRegistry({self.group!r}, {self._entries!r})"

    @property
    def read(self) -> bool:
        """Whether the group's entry points have been read into the registry."""
        return self._state == "read"

    def origin(self, name: str) -> str:
        """The distribution that holds ``name``: a plugin's, or ``r3lab`` for an entry registered in code."""
        return self.distributions.get(name, _BUILT_IN)

    def _read(self) -> None:
        if self._state == "read":
            return
        with self._lock:
            if self._state != "unread":  # read by another thread meanwhile, or being read by this one: a plugin's
                return  # module that looks its registry up while it imports sees the entries read so far
            self._state = "reading"
            added: list[str] = []
            try:
                declared = declared_entry_points().get(self.group, ())
                self._refuse_twice_declared(declared)
                for ep, dist in declared:
                    entry = self._load(ep, dist)
                    held = self._entries.get(ep.name)
                    if held is not None and held is not entry:  # the plugin's own module may have registered it
                        raise ConfigError(
                            f"entry point group {self.group!r}: the {self.what} {ep.name!r} of distribution {dist} "
                            f"({ep.value}) clashes with the {self.what} {ep.name!r} of distribution "
                            f"{self.origin(ep.name)}; a plugin adds names, it never replaces one: rename the entry "
                            f"point in {dist}, or uninstall it")
                    self._entries[ep.name] = entry
                    self.distributions[ep.name] = dist
                    added.append(ep.name)
            except BaseException:
                for name in added:  # all or nothing: no half-read group stays behind
                    self._entries.pop(name, None)
                    self.distributions.pop(name, None)
                self._state = "unread"
                raise
            self._state = "read"

    def _refuse_twice_declared(self, declared: tuple[tuple[metadata.EntryPoint, str], ...]) -> None:
        by_name: dict[str, list[str]] = {}
        for ep, dist in declared:
            by_name.setdefault(ep.name, []).append(f"{dist} ({ep.value})")
        twice = {name: dists for name, dists in by_name.items() if len(dists) > 1}
        if twice:
            name, dists = next(iter(twice.items()))
            raise ConfigError(f"entry point group {self.group!r}: the {self.what} {name!r} is declared by "
                              f"{len(dists)} distributions, {' and '.join(dists)}; one name, one {self.what}: "
                              "uninstall all but one")

    def _load(self, ep: metadata.EntryPoint, dist: str) -> V:
        where = f"the {self.what} plugin {ep.name!r} ({ep.value}) of distribution {dist}, entry point group " \
                f"{self.group!r}"
        try:
            obj = ep.load()
        except Exception as e:
            raise ConfigError(f"{where}, fails to import: {type(e).__name__}: {e}. Fix {dist} or uninstall it") from e
        try:
            return self._adopt(ep.name, obj)
        except Exception as e:  # a ConfigError says what is wrong with the object; anything else, what failed
            raise ConfigError(f"{where}: {e}" if isinstance(e, ConfigError) else
                              f"{where}, cannot be checked: {type(e).__name__}: {e}") from e
