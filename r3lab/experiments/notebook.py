"""What the notebooks share: finished runs loaded from disk, else the experiment run small and written first.

A notebook either reads runs someone made (``r3lab drift``/``r3lab rl`` in a terminal, a benchmark's reference
runs) or, when it is given none, makes its own: one function, :func:`load_or_run`, for both experiments.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from r3lab import paths
from r3lab.config import DEFAULT_MODES, DriftConfig, RLConfig
from r3lab.errors import ConfigError
from r3lab.runs import Run, load

Folders = str | os.PathLike | Sequence[str | os.PathLike] | None


def load_or_run(folders: Folders, config: DriftConfig | RLConfig, *, modes: Sequence[str] = DEFAULT_MODES,
                seeds: Sequence[int] = (0,), runs_dir: str | os.PathLike | None = None,
                progress: bool = True) -> list[Run]:
    """The runs in ``folders`` (one folder or several); with none given, run ``config`` and load what it wrote.

    A :class:`DriftConfig` runs the drift experiment (one run); an :class:`RLConfig` runs every ``modes`` x
    ``seeds`` of it on one engine (one run each). New runs go to ``runs_dir`` (default: r3lab's runs folder).
    """
    if folders:
        given = [folders] if isinstance(folders, (str, os.PathLike)) else list(folders)
        return [load(Path(f)) for f in given]
    root = paths.runs_dir(runs_dir)
    if isinstance(config, DriftConfig):
        from r3lab.experiments.drift import run_drift

        return [load(run_drift(config, runs_root=root, progress=progress)[0].run_path)]
    if isinstance(config, RLConfig):
        from r3lab.experiments.rl import run_comparison

        return [load(r.path) for r in run_comparison(config, modes=modes, seeds=seeds, runs_root=root,
                                                     progress=progress)]
    raise ConfigError(f"load_or_run runs a DriftConfig or an RLConfig, got {type(config).__name__}")
