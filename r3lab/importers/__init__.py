"""Bring your own run: importers of the field's R3 dumps into ordinary r3lab runs (one module per framework).

``import_run(kind, src, out, **options)`` dispatches to :func:`import_slime`, :func:`import_miles`,
:func:`import_nemo_rl` or :func:`import_prime_rl`. Importers read files and write runs; they import neither
engines nor trainers, and nothing they read can run code (see :mod:`r3lab.importers.common`).
:func:`run_figures` draws every figure a run's fields allow (own or imported; notebook 06).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from r3lab.errors import ImportFormatError, UnsafeFileError
from r3lab.importers.common import IMPORT_KIND, LayerMap, safe_torch_load, sample_tokens
from r3lab.importers.figures import (
    NotAvailable,
    column_or_note,
    drawn,
    health_figure,
    in_place,
    noise_floors,
    of_kind,
    rl_token_logprobs,
    routes_or_note,
    run_figures,
    token_logprobs,
)
from r3lab.importers.miles import import_miles
from r3lab.importers.nemo_rl import import_nemo_rl
from r3lab.importers.prime_rl import import_prime_rl
from r3lab.importers.slime import import_slime

__all__ = ["KINDS", "IMPORT_KIND", "import_run", "import_slime", "import_miles", "import_nemo_rl", "import_prime_rl",
           "ImportFormatError", "UnsafeFileError", "LayerMap", "safe_torch_load", "sample_tokens",
           "run_figures", "health_figure", "NotAvailable", "drawn", "in_place", "routes_or_note", "of_kind",
           "token_logprobs", "noise_floors", "column_or_note", "rl_token_logprobs"]

KINDS = {"slime": import_slime, "miles": import_miles, "nemo-rl": import_nemo_rl, "prime-rl": import_prime_rl}


def import_run(kind: str, src: str | os.PathLike, out: str | os.PathLike, **options: Any) -> Path:
    """Import a dump of framework ``kind`` (one of :data:`KINDS`) into the run folder ``out``."""
    if kind not in KINDS:
        raise ImportFormatError(f"unknown dump kind {kind!r}; r3lab imports {sorted(KINDS)}")
    if kind in ("nemo-rl", "prime-rl"):
        extra = {k: v for k, v in options.items() if v is not None}
        if extra:
            raise ImportFormatError(f"{kind} dumps have no routes or train dumps; options {sorted(extra)} do not apply")
        return KINDS[kind](src, out)
    return KINDS[kind](src, out, **options)
