"""Layout versions: which layout of its framework a dump has, named, recorded in the run, refused when unknown.

A framework's dump changes layout between its releases (SkyRL #1379, #1908, #2235; slime #2266; prime-rl #3354).
Each importer module declares the layouts it reads as ``LAYOUTS`` (a tuple of :class:`Layout`, oldest first),
recognises a dump's layout **from its bytes** (keys, field counts, state layouts, never the path), and records the
names it saw in the run's config (``config.source_layouts``; :func:`r3lab.importers.common.write_run` takes them).
A dump whose bytes match none of them is refused with :func:`unknown_layout`: the message names what was seen,
which layouts this r3lab reads, and that the format is new (not that the file is dangerous).

``r3lab import --formats`` prints :func:`formats_table` (the README's table is the same text; a test checks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r3lab.errors import UnknownLayoutError

__all__ = ["Layout", "unknown_layout", "formats_rows", "formats_table", "LayoutsSeen"]


@dataclass(frozen=True)
class Layout:
    """One layout of one framework's dump.

    ``name``: short and stable (it is written into runs: never rename one); ``writer``: the source it was read
    from (repository, commit, file, pull request); ``marks``: what in the bytes tells this layout from the others;
    ``gives``: what an import of it carries (routes, weights, log-probs, ...).
    """

    name: str
    writer: str
    marks: str
    gives: str


def unknown_layout(kind: str, where: str, seen: str, layouts: Sequence[Layout]) -> UnknownLayoutError:
    """The error for a dump of ``kind`` whose bytes match none of ``layouts``: what was seen, what r3lab reads."""
    known = "; ".join(f"{lay.name} ({lay.marks})" for lay in layouts)
    return UnknownLayoutError(
        f"{where}: {seen}. This is a {kind} dump layout this r3lab does not read (a newer or changed writer, not "
        f"an unsafe file); r3lab reads the {kind} layouts: {known}. `r3lab import --formats` lists every layout; "
        "a newer r3lab may read this one")


class LayoutsSeen:
    """The layouts an import met, in the order first seen (what the run's config records)."""

    def __init__(self, layouts: Sequence[Layout]):
        self._known = {lay.name: lay for lay in layouts}
        self.names: list[str] = []

    def add(self, name: str) -> None:
        if name not in self._known:  # a programming error of the importer, not of the dump
            raise KeyError(f"layout {name!r} is not declared in LAYOUTS ({sorted(self._known)})")
        if name not in self.names:
            self.names.append(name)

    def __iter__(self) -> Any:
        return iter(self.names)


def formats_rows(registry: Mapping[str, Any]) -> list[tuple[str, Layout]]:
    """``(kind, layout)`` for every layout of every available importer, in registry order, oldest layout first."""
    rows: list[tuple[str, Layout]] = []
    for kind, spec in registry.items():
        if spec.available:
            rows.extend((kind, lay) for lay in spec.layouts)
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def formats_table(registry: Mapping[str, Any] | None = None, kinds: Iterable[str] | None = None) -> str:
    """The Markdown table of dump kinds and their layouts (``r3lab import --formats``; the README's table)."""
    if registry is None:
        from r3lab.importers.registry import REGISTRY

        registry = REGISTRY
    want = None if kinds is None else set(kinds)
    lines = ["| kind | layout | what marks it | what an import gives | read from |", "|---|---|---|---|---|"]
    for kind, lay in formats_rows(registry):
        if want is None or kind in want:
            lines.append(f"| {kind} | `{lay.name}` | {_cell(lay.marks)} | {_cell(lay.gives)} | {_cell(lay.writer)} |")
    return "\n".join(lines)
