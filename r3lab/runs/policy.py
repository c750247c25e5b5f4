"""Saved policies on disk: the folder format an RL run's ``--save-every`` writes and ``--init-from`` reads, and the
checks the doctor runs on it. Torch-free: the state file is written and read by the RL loop
(:mod:`r3lab.experiments.rl.policy`); here only its metadata and its digest are read.

A saved policy is one folder per save inside its run (format ``r3lab-policy``, version 1, as the run's config
``save_format`` names it: ``r3lab-policy-1``)::

    <run>/policy/step-<S:06d>/
      policy.json   {"format": "r3lab-policy", "version": 1, "step": S (updates taken: the policy samples step S),
                     "run", "model", "trainer", "trainer_dtype", "router_dtype", "lr", "seed", "optimizer": bool,
                     "numpy_rng": the loop's numpy bit-generator state, "rewards": the mean reward of steps 0..S-1
                     (the collapse detector's history, ancestors' steps included),
                     "state": {"file": "state.pt", "sha256": ..., "bytes": ...}}
      state.pt      torch.save of {"model": the trainer model's state_dict, "optimizer": AdamW's state_dict or None,
                     "torch_rng": torch's CPU RNG state}

Version rule: any change to what these files mean bumps the version; a reader refuses versions it does not know.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from r3lab.config import POLICY_FORMATS
from r3lab.errors import ConfigError, RunFormatError

__all__ = ["POLICY_FORMAT", "POLICY_VERSION", "POLICY_DIR", "META_FILE", "STATE_FILE", "policy_path", "saved_steps",
           "read_policy_meta", "file_digest", "parse_init_from", "resolve_init_from", "policy_problems"]

POLICY_FORMAT = "r3lab-policy"
POLICY_VERSION = 1
POLICY_DIR = "policy"
META_FILE = "policy.json"
STATE_FILE = "state.pt"
META_KEYS = ("format", "version", "step", "run", "model", "trainer", "trainer_dtype", "router_dtype", "lr", "seed",
             "optimizer", "numpy_rng", "rewards", "state")
if f"{POLICY_FORMAT}-{POLICY_VERSION}" not in POLICY_FORMATS:  # the config's save_format names this format
    raise RunFormatError(f"{POLICY_FORMAT}-{POLICY_VERSION} is not among the config's POLICY_FORMATS {POLICY_FORMATS}")


def policy_path(run: str | os.PathLike[str], step: int) -> Path:
    """The folder of the policy a run saved after ``step`` updates."""
    return Path(run) / POLICY_DIR / f"step-{int(step):06d}"


def saved_steps(run: str | os.PathLike[str]) -> list[int]:
    """The steps at which ``run`` saved its policy (folders with a ``policy.json``), ascending."""
    root = Path(run) / POLICY_DIR
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("step-") and p.name[5:].isdigit() and (p / META_FILE).is_file():
            out.append(int(p.name[5:]))
    return sorted(out)


def file_digest(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_policy_meta(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """A saved policy's ``policy.json``, its format and version checked (an unknown one is refused, not guessed)."""
    p = Path(folder) / META_FILE
    try:
        meta = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunFormatError(f"saved policy {p}: unreadable ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != POLICY_FORMAT:
        raise RunFormatError(f"saved policy {p}: format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                             f"not {POLICY_FORMAT!r}")
    if meta.get("version") != POLICY_VERSION:
        raise RunFormatError(f"saved policy {p}: version {meta.get('version')!r}; this r3lab reads version "
                             f"{POLICY_VERSION} only")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise RunFormatError(f"saved policy {p}: missing {missing}")
    return meta


def parse_init_from(spec: str) -> tuple[str, int | None]:
    """``RUN[:STEP]`` -> (RUN, STEP or None). STEP, when given, is a non-negative integer."""
    run, sep, step = spec.rpartition(":")
    if not sep or not step.isdigit():
        return spec, None
    if not run:
        raise ConfigError(f"init_from {spec!r}: no run before ':{step}'", field="init_from")
    return run, int(step)


def resolve_init_from(spec: str, runs_root: str | os.PathLike[str] | None) -> Path:
    """The saved policy folder ``spec`` (``RUN[:STEP]``) names: RUN a run folder (or a run name under
    ``runs_root``), STEP one of its saves (default: its last). Errors name what is there."""
    run, step = parse_init_from(spec)
    candidates = [Path(run)] + ([Path(runs_root) / run] if runs_root is not None else [])
    folder = next((c for c in candidates if c.is_dir()), None)
    if folder is None:
        raise ConfigError(f"init_from {spec!r}: no run folder {' or '.join(map(str, candidates))}",
                          field="init_from")
    steps = saved_steps(folder)
    if not steps:
        raise ConfigError(f"init_from {spec!r}: run {folder} saved no policy (run it with --save-every N)",
                          field="init_from")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise ConfigError(f"init_from {spec!r}: run {folder} saved its policy at steps {steps}, not {step}",
                          field="init_from")
    return policy_path(folder, step)


def policy_problems(run: str | os.PathLike[str], config: dict[str, Any]) -> tuple[int, list[str]]:
    """The saved policies of a run checked against its config and their own metadata: (saves found, problems).
    A problem: an unreadable or unknown format, a step that is no multiple of ``save_every`` or past the run's
    steps, a model or seed other than the run's, a reward history of the wrong length, a state file missing or not
    the bytes its digest names."""
    problems: list[str] = []
    steps = saved_steps(run)
    every, total = int(config.get("save_every") or 0), int(config.get("steps") or 0)
    want = config.get("save_format", POLICY_FORMATS[0])
    if want not in POLICY_FORMATS:
        problems.append(f"the config's save_format {want!r} is none of {list(POLICY_FORMATS)}")
    for s in steps:
        folder = policy_path(run, s)
        try:
            meta = read_policy_meta(folder)
        except RunFormatError as e:
            problems.append(str(e))
            continue
        if meta["step"] != s:
            problems.append(f"{folder.name}: policy.json says step {meta['step']}")
        if every and s % every:
            problems.append(f"{folder.name}: not a multiple of save_every {every}")
        if total and s > total:
            problems.append(f"{folder.name}: past the run's {total} steps")
        for key in ("model", "seed", "trainer"):
            if key in config and meta[key] != config[key]:
                problems.append(f"{folder.name}: {key} {meta[key]!r}, the run's is {config[key]!r}")
        if len(meta["rewards"]) != s:
            problems.append(f"{folder.name}: {len(meta['rewards'])} rewards of history for step {s}")
        state = folder / str(meta["state"].get("file", STATE_FILE))
        if not state.is_file():
            problems.append(f"{folder.name}: {state.name} missing")
        elif state.stat().st_size != meta["state"].get("bytes") or file_digest(state) != meta["state"].get("sha256"):
            problems.append(f"{folder.name}: {state.name} is not the file its policy.json names (size or sha256)")
    return len(steps), problems
