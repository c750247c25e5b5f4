"""Following runs that another process writes: each run's steps.jsonl read incrementally, from a thread.

No UI here: the widgets (``r3lab.widgets``) draw what a :class:`RunFollower` reads, and scripts may poll it
directly. A half-written last line is what a running writer leaves between two flushes: it waits for its
newline and is never an error. A complete line that is not a step record is (``RunFormatError`` naming file
and line).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from r3lab.errors import ConfigError, R3LabFailure
from r3lab.runs.format import STOPPED_FILE
from r3lab.runs.reader import load, parse_step_line


@dataclass(frozen=True)
class FollowedRun:
    """One followed run as :meth:`RunFollower.snapshot` saw it."""

    name: str
    mode: str
    seed: int
    records: list[dict[str, Any]]  # the complete step records read so far
    finished: bool  # its summary.json has landed
    total_steps: int | None  # the steps its config asks for (None if it does not say)
    stopped: bool = False  # its stopped.json has landed (stopped before its end)


class Job(Protocol):
    """What the follower needs of a job writing the runs (e.g. :class:`r3lab.widgets.RLJob`)."""

    @property
    def run_names(self) -> Sequence[str]: ...

    @property
    def running(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...


class _Tail:
    """One run folder followed: its config, and its step records read incrementally from steps.jsonl."""

    def __init__(self, path: Path):
        run = load(path)  # validates format and version; steps are read again below, incrementally
        self.path, self.meta = path, run.meta
        self.records: list[dict[str, Any]] = []
        self.finished = False
        self.stopped = False
        self._offset, self._pending, self._lines = 0, b"", 0
        self.last_change = time.monotonic()

    @property
    def mode(self) -> str:
        return str(self.meta["config"].get("mode", "?"))

    @property
    def seed(self) -> int:
        return int(self.meta["config"].get("seed", 0))

    @property
    def total_steps(self) -> int | None:
        s = self.meta["config"].get("steps")
        return int(s) if s is not None else None

    def poll(self) -> bool:
        """Read what was appended since the last poll; True if a step landed or the run finished."""

        finished = (self.path / "summary.json").is_file()  # checked first: every step is on disk before it lands
        stopped = (self.path / STOPPED_FILE).is_file()
        with open(self.path / "steps.jsonl", "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *lines, self._pending = (self._pending + data).split(b"\n")
        new = 0
        for ln in lines:
            self._lines += 1
            if ln.strip():
                self.records.append(parse_step_line(ln, self.path / "steps.jsonl", self._lines))
                new += 1
        changed = bool(new) or finished != self.finished or stopped != self.stopped
        self.finished, self.stopped = finished, stopped
        if changed:
            self.last_change = time.monotonic()
        return changed


class RunFollower:
    """Follows one run folder, or the runs named ``prefix*`` in a folder of runs, from a background thread.

    It polls every ``interval`` seconds, reads only new bytes, and calls ``on_update(self)`` from its thread
    after each change. It ends by itself when the runs are done: a single run when its ``summary.json`` lands;
    a folder when ``expect`` runs have finished, or when ``job`` has exited (then ``failed`` if it exited
    non-zero), or, given neither, when every run seen has finished and no new one appeared for ``settle_s``.
    ``stop()`` ends it at once and joins the thread. ``state``: waiting, running, stalled (no new step for
    ``stall_s``), finished, failed, stopped, or error (an unreadable run; ``error`` holds it).

    A ``source`` that does not exist yet (a job just started in a terminal creates it) is waited for up to
    ``folder_wait_s`` seconds (state waiting), then it is an error naming the folder; with ``folder_wait_s=0``
    (the default, unless a ``job`` will write it) a missing folder raises at once.
    """

    def __init__(self, source: str | os.PathLike[str], prefix: str = "", *, expect: int | None = None,
                 job: Job | None = None, interval: float = 0.5, stall_s: float = 300.0, settle_s: float = 60.0,
                 folder_wait_s: float = 0.0, on_update: Callable[[RunFollower], None] | None = None):
        src = Path(source)
        if src.exists() and not src.is_dir():
            raise ConfigError(f"{str(src)!r} is a file, not a run folder or a folder of runs")
        if folder_wait_s < 0:
            raise ConfigError(f"folder_wait_s must be >= 0, got {folder_wait_s}")
        if not src.exists() and job is None and not folder_wait_s:
            raise ConfigError(f"{str(src)!r} does not exist (give a run folder, a folder of runs, or the job that "
                              "will write it; folder_wait_s waits for a folder a job is about to create)")
        if expect is not None and expect < 1:
            raise ConfigError(f"expect must be >= 1, got {expect}")
        if interval <= 0:
            raise ConfigError(f"interval must be > 0, got {interval}")
        self.single = (src / "config.json").is_file()
        self.root, self.prefix, self.job = src, prefix, job
        self.expect = expect if expect is not None else (len(job.run_names) if job is not None else None)
        self.interval, self.stall_s, self.settle_s, self.folder_wait_s = interval, stall_s, settle_s, folder_wait_s
        self.on_update = on_update
        self.runs: dict[str, _Tail] = {}
        self.state = "waiting"
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_new_run = self._created = time.monotonic()

    # -- the loop
    def start(self) -> RunFollower:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"r3lab-follow-{self.root.name}", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while True:
                if self.poll():
                    self._notify()
                if self.state in ("finished", "failed") or self._stop.wait(self.interval):
                    break
            if self.state not in ("finished", "failed"):
                self.poll()  # what landed before the stop is shown too (state: stopped, or finished)
                self._notify()
        except Exception as e:  # noqa: BLE001 - an unreadable run or a failing callback: shown, never swallowed
            self.error, self.state = e, "error"
            try:
                self._notify()
            except Exception:  # noqa: BLE001 - the widget itself fails: at least the kernel's log has it
                traceback.print_exc()

    def _notify(self) -> None:
        if self.on_update is not None:
            self.on_update(self)

    def poll(self) -> bool:
        """One look at the disk (the thread calls this; tests may call it directly). True if anything changed."""
        job_exited = self.job is not None and not self.job.running  # before reading: a last step is not missed
        if (self.job is None and not self.root.exists()
                and time.monotonic() - self._created > self.folder_wait_s):
            raise R3LabFailure(f"{str(self.root)!r} did not appear within {self.folder_wait_s:g} s (is the job "
                               "writing there? `r3lab rl --runs DIR --name PREFIX` creates DIR/PREFIX-*)")
        changed = False
        with self._lock:
            for path in self._candidates():
                if path.name not in self.runs and (path / "steps.jsonl").is_file():
                    self.runs[path.name] = _Tail(path)
                    self._last_new_run = time.monotonic()
                    changed = True
            for tail in self.runs.values():
                changed |= tail.poll()
            state = self._state(job_exited)
        changed |= state != self.state
        self.state = state
        return changed

    def _candidates(self) -> list[Path]:
        if self.single or (self.root / "config.json").is_file():
            self.single = True
            return [self.root]
        if not self.root.is_dir():
            return []
        names = self.job.run_names if self.job is not None else None
        return [p for p in sorted(self.root.iterdir())
                if p.is_dir() and p.name.startswith(self.prefix) and (names is None or p.name in names)
                and (p / "config.json").is_file()]

    def _state(self, job_exited: bool) -> str:
        runs = list(self.runs.values())
        done = sum(t.finished for t in runs)
        if self.single and runs and runs[0].finished:
            return "finished"
        if self.expect is not None and done >= self.expect:
            return "finished"
        if self._stop.is_set():  # stop() was asked: whatever the job's exit says, it was stopped
            return "stopped"
        if job_exited and self.job is not None:
            return "failed" if self.job.returncode != 0 or done < (self.expect or 0) else "finished"
        if (self.expect is None and not self.single and runs and done == len(runs)
                and time.monotonic() - self._last_new_run > self.settle_s):
            return "finished"
        if not runs:
            return "waiting"
        latest = max(t.last_change for t in runs)
        return "stalled" if time.monotonic() - latest > self.stall_s else "running"

    # -- control
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the follower ends by itself (True) or ``timeout`` passes (False)."""
        if self._thread is None:
            raise ConfigError("the follower was never started")
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread and join it (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def snapshot(self) -> list[FollowedRun]:
        """Every run followed so far (a :class:`FollowedRun` each, by name), a consistent copy."""
        with self._lock:
            return [FollowedRun(n, t.mode, t.seed, list(t.records), t.finished, t.total_steps, t.stopped)
                    for n, t in self.runs.items()]

    def steps_landed(self) -> int:
        with self._lock:
            return sum(len(t.records) for t in self.runs.values())
