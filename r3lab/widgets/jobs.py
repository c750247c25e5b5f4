"""RL jobs in child processes: ``python -m r3lab rl ...`` started from a notebook, its output kept, its process
group ended on close. The knobs are :class:`r3lab.config.RLConfig`'s (checked there before anything starts)."""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from r3lab._process import Closing, end_process_group
from r3lab.config import DEFAULT_MODES, MODES, RL_QUICK_SEEDS, RLConfig, run_names
from r3lab.errors import ConfigError
from r3lab.paths import runs_dir
from r3lab.runs import RunFollower, mark_stopped
from r3lab.vocabulary import RunKind

__all__ = ["stop_job"]


class RLJob(Closing):
    """``python -m r3lab rl ...`` in a child process (its own process group) writing runs to ``runs_root``.

    Its output is read by a thread into a bounded tail (:meth:`tail`), so a failure's message is shown, never
    swallowed. ``close()`` (or ``with``) ends the process group if it still runs; idempotent.
    """

    def __init__(self, args: Sequence[str], *, runs_root: Path, prefix: str, modes: Sequence[str],
                 seeds: Sequence[int], steps: int):
        self.runs_root, self.prefix, self.steps = Path(runs_root), prefix, int(steps)
        self.run_names = run_names(prefix, modes, seeds)  # run_comparison's order
        self.command = [sys.executable, "-m", "r3lab", RunKind.RL, *args]  # `r3lab rl`: the command writing rl runs
        self._tail: collections.deque[str] = collections.deque(maxlen=400)
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"r3lab-job-{prefix}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        out = self.process.stdout
        if out is None:  # pragma: no cover - Popen was given stdout=PIPE
            return
        for line in out:
            self._tail.append(line.rstrip("\n"))
        out.close()

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the job's stdout and stderr (vLLM's warnings included)."""
        return "\n".join(list(self._tail)[-lines:])

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None if the job still runs after ``timeout`` seconds."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self, grace_s: float = 10.0) -> None:
        """End the job's whole process group (vLLM's workers too): SIGTERM, then SIGKILL after ``grace_s``."""
        end_process_group(self.process, grace_s=grace_s)
        self._reader.join(timeout=5)


def stop_job(job: RLJob | None, follower: RunFollower | None, reason: str) -> None:
    """Stop following ``job`` and end it (its whole process group); the runs it left unfinished are marked stopped
    on disk with ``reason``, so ``r3lab runs`` and the widgets' rows say stopped (the dashboard's and the dial's
    Stop)."""
    if follower is not None:
        follower.stop()  # first: its thread's last look cannot read the killed job as a failure
    if job is not None:
        running = job.running
        job.close()
        if running:
            for name in job.run_names:
                if (job.runs_root / name / "config.json").is_file():
                    mark_stopped(job.runs_root / name, reason)


def _as_keywords(e: ConfigError) -> ConfigError:
    """RLConfig's error with its fields written as the keywords a notebook passes (``samples_per_prompt``, not the
    command line's ``--samples-per-prompt``): the words the user typed. The fields stay on it as data."""
    return e.spelled(str)


def rl_config(config: RLConfig | None = None, **knobs: Any) -> RLConfig:
    """``config`` (default: :meth:`RLConfig.quick`, a smoke-sized run) with ``knobs`` replacing fields, checked by
    RLConfig; an unknown knob is an error that names it and the knobs there are."""
    base = config if config is not None else RLConfig.quick()
    if not knobs:
        return base
    fields = [f.name for f in dataclasses.fields(RLConfig)]
    unknown = sorted(set(knobs) - set(fields))
    if unknown:
        raise ConfigError(f"no knob(s) {unknown}; the knobs are {', '.join(fields)}")
    try:
        return RLConfig.from_dict({**base.to_dict(), **knobs})
    except ConfigError as e:
        raise _as_keywords(e) from e


def start_rl(runs_root: str | os.PathLike | None = None, *, prefix: str | None = None,
             modes: Sequence[str] = DEFAULT_MODES,
             seeds: Sequence[int] = RL_QUICK_SEEDS, config: RLConfig | None = None, **knobs: Any) -> RLJob:
    """Start an RL comparison (one run per mode and seed, named ``<prefix>-<mode>-s<seed>``) in a child process.

    The runs' knobs are ``config`` (default :meth:`RLConfig.quick`) with ``knobs`` replacing any of its fields
    (``steps=3``, ``lr=3e-3``, ...). Everything is checked here by RLConfig, so a typo fails at once; the child
    gets every field spelled out (:meth:`RLConfig.to_cli_args`). Sweep the mode and seed with ``modes``/``seeds``.
    """
    if {"mode", "seed"} & set(knobs):
        raise ConfigError("pass the replay modes and seeds as modes=[...] and seeds=[...] (one run per pair)")
    base = rl_config(config, **knobs)
    if not modes:
        raise ConfigError(f"give at least one replay mode (modes among {MODES})")
    if not seeds:
        raise ConfigError("give at least one seed")
    for mode in modes:
        for seed in seeds:
            try:
                dataclasses.replace(base, mode=mode, seed=int(seed))  # RLConfig checks each run's mode and seed
            except ConfigError as e:
                raise _as_keywords(e) from e
    root = runs_dir(runs_root)
    prefix = prefix or f"rl-{Path(base.model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    clash = [n for n in run_names(prefix, modes, seeds) if (root / n).exists()]
    if clash:
        raise ConfigError(f"runs {clash} exist in {root}; runs are never overwritten (pick another prefix)")
    args = [*base.to_cli_args(modes=modes, seeds=[int(s) for s in seeds]), "--runs", str(root), "--name", prefix,
            "--no-progress"]
    return RLJob(args, runs_root=root, prefix=prefix, modes=modes, seeds=seeds, steps=base.steps)
