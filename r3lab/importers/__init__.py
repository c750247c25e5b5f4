"""Bring your own run: importers of the field's R3 dumps into ordinary r3lab runs (one module per framework).

``import_run(kind, src, out, **options)`` imports with the importer the registry names for ``kind``
(:data:`KINDS`, :mod:`r3lab.importers.registry`), or with ``kind="auto"`` the one whose ``detect`` recognises
``src`` (:func:`detect_kind`). An option the kind does not declare is refused by name. Imports are all or
nothing: a refused or failed one leaves no run folder. Importers read files and write runs; they import neither
engines nor trainers, and nothing they read can run code (see :mod:`r3lab.importers.common`).
The figures of an imported run (every one its fields allow, a note in place of the rest) are
:func:`r3lab.viz.run_figures`; its kind is :data:`r3lab.runs.IMPORT_KIND`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from r3lab.errors import ImportFormatError
from r3lab.importers.common import LayerMap, safe_torch_load, sample_tokens
from r3lab.importers.miles import import_miles
from r3lab.importers.nemo_rl import import_nemo_rl
from r3lab.importers.prime_rl import import_prime_rl
from r3lab.importers.registry import AUTO, REGISTRY, ImporterSpec, check_options, detect_kind
from r3lab.importers.slime import import_slime

__all__ = ["KINDS", "import_run", "import_slime", "import_miles", "import_nemo_rl", "import_prime_rl",
           "LayerMap", "safe_torch_load", "sample_tokens", "detect_kind", "AUTO", "ImporterSpec"]

KINDS: Mapping[str, ImporterSpec] = REGISTRY
"""Every dump kind by name -> its registry entry (:class:`ImporterSpec`: import function, options, detect)."""


def import_run(kind: str, src: str | os.PathLike, out: str | os.PathLike, **options: Any) -> Path:
    """Import a dump of framework ``kind`` (one of :data:`KINDS`, or ``"auto"``) into the run folder ``out``.

    ``auto`` asks every importer's ``detect``, says on stderr which kind it chose and why, and refuses a folder
    none or several recognise. ``out`` must not exist; nothing is left there if the import fails.
    """
    if kind == AUTO:
        kind, reason = detect_kind(src)
        print(f"r3lab import auto: {kind} dump ({reason})", file=sys.stderr)
    spec = REGISTRY.get(kind)
    if spec is None:
        raise ImportFormatError(f"unknown dump kind {kind!r}; r3lab imports {list(REGISTRY)} (or {AUTO!r})")
    given = check_options(kind, options)
    outp = Path(out)
    if outp.exists():
        raise ImportFormatError(f"{str(outp)!r} exists; an import writes a new run folder and never touches an "
                                "existing one (pick a new --out)")
    return spec.import_function(src, outp, **given)
