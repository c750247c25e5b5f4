"""Reading runs back: a finished, running or killed run folder, and every run folder under a root."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from r3lab.compaction import decode
from r3lab.errors import RunFormatError
from r3lab.paths import results_dir
from r3lab.routes import Routes
from r3lab.runs.format import (
    READABLE_VERSIONS,
    RUN_FORMAT,
    RUN_FORMAT_VERSION,
    SAMPLES_VERSION,
    STOPPED_FILE,
    routes_file,
    samples_file,
    step_of,
    tokens_file,
)
from r3lab.runs.samples import Samples
from r3lab.vocabulary import RunKind

if TYPE_CHECKING:
    import pandas as pd


def parse_step_line(line: bytes, path: str | os.PathLike[str], lineno: int) -> dict[str, Any]:
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
    stopped: dict[str, Any] | None = None  # stopped.json (format 2): the run was stopped before its end
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
    def state(self) -> str:
        """``finished`` (summary.json), ``stopped`` (stopped.json), else ``running or killed`` (a process that
        died without a word, or a version-1 run that was stopped, looks the same as one still running)."""
        if self.finished:
            return "finished"
        return "stopped" if self.stopped is not None else "running or killed"

    @property
    def threads(self) -> dict[str, Any] | None:
        """The CPU thread settings the run was written under (r3lab.runs.writer.threads); None: not recorded (a
        run written before r3lab recorded them)."""
        t = self.meta.get("threads")
        return dict(t) if t is not None else None

    @property
    def cpu(self) -> dict[str, Any] | None:
        """The processor the run was written on (r3lab.runs.writer.cpu); None: not recorded (a run written before
        r3lab recorded it)."""
        c = self.meta.get("cpu")
        return dict(c) if c is not None else None

    def rerun_command(self, runs: str = "RUNS", name: str | None = None) -> str:
        """The shell command that runs this RL run's config again with ``r3lab rl`` into ``runs`` (folder
        ``<name>-<mode>-s<seed>``; default name: this run's, less its ``-<mode>-s<seed>`` ending, so that the rerun's
        folder has this run's name), under the thread settings it recorded (``OMP_NUM_THREADS=...`` first; a run
        that recorded none gets no prefix, and a bitwise rerun then needs the thread count it ran with, found
        elsewhere)."""
        import shlex

        from r3lab.config import RLConfig, run_name

        self.require_kind(RunKind.RL)
        cfg = RLConfig.from_dict(self.config)
        if name is None:
            ending = run_name("", cfg.mode, cfg.seed)
            name = self.name[:-len(ending)] if self.name.endswith(ending) and len(self.name) > len(ending) \
                else self.name
        env = [f"{k}={v}" for k, v in (self.threads or {}).items() if k != "torch" and v is not None]
        return " ".join([*env, "r3lab", RunKind.RL, *map(shlex.quote, cfg.to_cli_args()), "--runs", shlex.quote(runs),
                         "--name", shlex.quote(name), "--no-progress"])

    def require_kind(self, kind: str) -> Run:
        """This run, if it is of ``kind`` (``"rl"``, ``"drift"``); else an error naming both."""
        if self.kind != kind:
            raise RunFormatError(f"run {self.name!r} is a {self.kind!r} run, not "
                                 f"{'an RL' if kind == RunKind.RL else 'a ' + kind} run")
        return self

    @property
    def steps(self) -> pd.DataFrame:
        """One row per complete step (pandas DataFrame)."""
        import pandas as pd

        return pd.DataFrame.from_records(self.step_records)

    def token_steps(self) -> list[int]:
        """Steps with a per-token table, ascending."""
        return sorted(step_of(p) for p in (self.path / "tokens").glob("step-*.parquet"))

    def route_steps(self, what: str) -> list[int]:
        """Steps with routes stored under ``what`` (e.g. "engine", "trainer"), ascending."""
        return sorted(step_of(p) for p in (self.path / "routes").glob(f"step-*.{what}.r3"))

    def tokens(self, steps: Sequence[int] | None = None) -> pd.DataFrame:
        """Per-token rows of the given steps (default: all), one tidy DataFrame."""
        import pandas as pd
        import pyarrow.parquet as pq

        want = self.token_steps() if steps is None else [int(s) for s in steps]
        frames = []
        for s in want:
            p = tokens_file(self.path, s)
            if not p.is_file():
                raise RunFormatError(f"run {self.name!r} has no token table for step {s}")
            try:
                frames.append(pq.read_table(p).to_pandas())
            except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
                raise RunFormatError(f"{str(p)!r} is not a readable parquet file: {e}") from e
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def sample_steps(self) -> list[int]:
        """Steps with a per-sample table (format version 3), ascending."""
        return sorted(step_of(p) for p in (self.path / "samples").glob("step-*.parquet"))

    def samples(self, step: int) -> Samples:
        """Every sample of ``step``: token ids and the engine's log-probs (:class:`r3lab.runs.samples.Samples`)."""
        import pyarrow.parquet as pq

        p = samples_file(self.path, step)
        if not p.is_file():
            version = self.meta.get("version")
            why = (f"it was written in format version {version}, before per-sample tables (version "
                   f"{SAMPLES_VERSION})" if isinstance(version, int) and version < SAMPLES_VERSION
                   else f"its per-sample tables are at steps {self.sample_steps()[:10]}")
            raise RunFormatError(f"run {self.name!r} has no per-sample table for step {int(step)} ({p}): {why}")
        try:
            table = pq.read_table(p)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise RunFormatError(f"{str(p)!r} is not a readable parquet file: {e}") from e
        return Samples.from_table(table, str(p))

    def routes(self, step: int, what: str) -> Routes:
        """Routes stored for ``step`` under ``what`` (decoded and validated by r3lab.compaction)."""
        p = routes_file(self.path, step, what)
        if not p.is_file():
            have = sorted(q.name for q in (self.path / "routes").glob("*.r3"))
            raise RunFormatError(f"run {self.name!r} has no routes {p.name!r} (stored: {have[:10]})")
        return decode(p.read_bytes())


def load(path: str | os.PathLike[str]) -> Run:
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
    if meta.get("version") not in READABLE_VERSIONS:
        raise RunFormatError(f"run {str(p)!r} has format version {meta.get('version')!r}; this r3lab reads versions "
                             f"{', '.join(map(str, READABLE_VERSIONS))} (writes {RUN_FORMAT_VERSION}); upgrade r3lab "
                             "to read newer runs")
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
    stopped = read_stopped(p)
    return Run(p, meta, records, summary, truncated, stopped)


def read_stopped(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run's stop mark (``stopped.json``), or None if it has none; a damaged mark names the file."""
    f = Path(path) / STOPPED_FILE
    if not f.is_file():
        return None
    try:
        mark = json.loads(f.read_text())
    except ValueError as e:
        raise RunFormatError(f"{str(f)!r} is not JSON: {e}") from e
    if not isinstance(mark, dict) or mark.get("state") != "stopped":
        raise RunFormatError(f"{str(f)!r} is not a stop mark (no \"state\": \"stopped\")")
    return mark


def list_runs(root: str | os.PathLike[str]) -> list[tuple[Path, Run | RunFormatError]]:
    """Every run folder under ``root`` by name, each read back or paired with the error that stops it reading
    (hidden folders are not runs: an atomic writer's ``.NAME.partial-*`` while it writes)."""
    rp = Path(root)
    if not rp.is_dir():
        return []
    out: list[tuple[Path, Run | RunFormatError]] = []
    for d in sorted(rp.iterdir()):
        if d.is_dir() and not d.name.startswith(".") and (d / "config.json").is_file():
            try:
                out.append((d, load(d)))
            except RunFormatError as e:
                out.append((d, e))
    return out


def load_runs(folder: str | os.PathLike[str], prefix: str = "") -> list[Run]:
    """Every run in ``folder`` whose name starts with ``prefix``, by name; raises if there is none or one is bad."""
    root = Path(folder)
    if not root.is_dir():
        raise RunFormatError(f"runs folder {str(root)!r} does not exist")
    found: list[Run] = []
    for path, run in list_runs(root):
        if not path.name.startswith(prefix):
            continue
        if isinstance(run, RunFormatError):
            raise run
        found.append(run)
    if not found:
        raise RunFormatError(f"no runs named {prefix!r}* in {str(root)!r}")
    return found


def reference_runs_dir() -> Path:
    """The committed reference RL runs of a source checkout (``bench/results/rl``)."""
    p = results_dir() / RunKind.RL  # bench/bench_rl.py writes its runs under their kind
    if not p.is_dir():
        raise RunFormatError(f"no reference runs at {p}: they ship in a source checkout's bench/results/rl "
                             "(or pass a folder of your own runs)")
    return p
