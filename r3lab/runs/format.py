"""The run folder's format: its name and version, the one error type, and where each file of a run lies."""

from __future__ import annotations

import re
from pathlib import Path

from r3lab.errors import RunFormatError
from r3lab.vocabulary import RunKind

__all__ = [
    "SAMPLES_VERSION", "STOPPED_FILE", "CAPTURE_KIND", "check_run_name", "check_routes_name", "tokens_file",
    "samples_file", "routes_file", "step_of",
]

RUN_FORMAT = "r3lab-run"
# 2: stopped.json marks a run stopped before its end; config.json's versions name r3lab's path
# 3: samples/step-<step>.parquet holds every sample's token ids and engine log-probs, and the experiments store the
#    engine's routes of every step beside it, so any finished run can be scored again (``r3lab rescore``)
RUN_FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # a version-1 run has no stopped.json: unfinished means running, stopped or killed
SAMPLES_VERSION = 3  # the first version with per-sample tables (older runs cannot be scored again)
IMPORT_KIND = RunKind.IMPORTED  # the kind of a run r3lab.importers wrote from another framework's dump
STOPPED_FILE = "stopped.json"  # {"state": "stopped", "at": ISO time, "steps": complete steps, "reason": str}
# an engine-only run (r3lab capture): the files of version 3, step 0 only, no trainer's tables or routes
CAPTURE_KIND = RunKind.CAPTURE
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_WHAT = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def check_run_name(name: str) -> None:
    if not _NAME.match(name):
        raise RunFormatError(f"run name {name!r} must be letters, digits, '.', '_' or '-'")


def check_routes_name(what: str) -> None:
    if not _WHAT.match(what):
        raise RunFormatError(f"routes name {what!r} must be lower-case letters, digits, '_' or '-'")


def tokens_file(run: Path, step: int) -> Path:
    """``tokens/step-<step:06d>.parquet``: the per-token table of one step."""
    return run / "tokens" / f"step-{int(step):06d}.parquet"


def samples_file(run: Path, step: int) -> Path:
    """``samples/step-<step:06d>.parquet``: the per-sample table of one step (format version 3)."""
    return run / "samples" / f"step-{int(step):06d}.parquet"


def routes_file(run: Path, step: int, what: str) -> Path:
    """``routes/step-<step:06d>.<what>.r3``: routes of one step in r3lab's container."""
    return run / "routes" / f"step-{int(step):06d}.{what}.r3"


def step_of(file: Path) -> int:
    """The step of a ``step-<step>.*`` file name (tokens or routes)."""
    return int(file.name.split(".")[0].split("-")[1])
