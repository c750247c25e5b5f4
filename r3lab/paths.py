"""Where r3lab finds its shipped data (tiny models, corpus) and where runs and figures go.

The data ships in a source checkout's ``data/``, not in the wheel. A source checkout (or an editable install of
one) is the folder above the package when it holds ``pyproject.toml`` and ``data/`` or ``.git``
(:func:`checkout`); an installed wheel has none, and nothing is ever looked up or written beside the package
there (that folder is ``site-packages``). Lookup order of the data: ``--data`` / ``$R3LAB_DATA``, then the
checkout's ``data/``, then ``./data``. Runs go to ``--runs`` / ``$R3LAB_RUNS``, else ``<data>/runs``, else
``./runs``; figures to the checkout's ``docs/figures``, else ``<data>/figures`` when a data folder is named, else
``./figures``.
"""

from __future__ import annotations

import os
from pathlib import Path

from r3lab.errors import ConfigError, R3LabError

__all__ = ["data_dir", "model_dir", "corpus_path", "runs_dir", "results_dir", "figures_dir", "bench_dir",
           "bench_script", "checkout", "MODELS"]

MODELS = ("tiny-qwen3-moe", "tiny-glm4-moe", "tiny-olmoe")  # the shipped checkpoints, in data/models/
PACKAGE_PARENT = Path(__file__).resolve().parent.parent  # a checkout's root, or site-packages for a wheel


def checkout() -> Path | None:
    """The source checkout r3lab runs from (the folder above the package, holding ``pyproject.toml`` and ``data/``
    or ``.git``), or None for an installed wheel, whose package sits in ``site-packages``."""
    root = PACKAGE_PARENT
    if (root / "pyproject.toml").is_file() and ((root / "data").is_dir() or (root / ".git").exists()):
        return root
    return None


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """The data folder: ``override``, else ``$R3LAB_DATA``, else the checkout's ``data/``, else ``./data``."""
    root = checkout()
    candidates = [override, os.environ.get("R3LAB_DATA"), root / "data" if root else None, Path("data")]
    tried = []
    for c in candidates:
        if not c:
            continue
        p = Path(c)
        if (p / "models").is_dir() or (p / "corpus").is_dir():
            return p.resolve()
        tried.append(str(p))
        if c is override or c == os.environ.get("R3LAB_DATA"):
            raise ConfigError(f"{str(p)!r} is not an r3lab data folder (it needs models/ or corpus/)")
    raise ConfigError(
        "r3lab's tiny models and corpus live in a source checkout's data/ folder, which this install "
        f"does not have (looked in {tried}); pass --data DIR or set R3LAB_DATA to that folder"
    )


def model_dir(name_or_path: str | os.PathLike, data: str | os.PathLike | None = None) -> Path:
    """A model directory: an existing path as given, else a shipped model's name under ``data/models/``."""
    p = Path(name_or_path)
    if p.is_dir():
        return p
    if p.name == str(name_or_path):  # a bare name
        q = data_dir(data) / "models" / p.name
        if q.is_dir():
            return q
        raise ConfigError(f"no model {str(name_or_path)!r} in {q.parent} (shipped: {', '.join(MODELS)})")
    raise ConfigError(f"model directory {str(p)!r} does not exist")


def corpus_path(data: str | os.PathLike | None = None) -> Path:
    """The Markov corpus the tiny models were trained on (one document a line)."""
    p = data_dir(data) / "corpus" / "markov.txt"
    if not p.is_file():
        raise ConfigError(f"corpus {str(p)!r} is missing")
    return p


def runs_dir(override: str | os.PathLike | None = None, data: str | os.PathLike | None = None) -> Path:
    """Where runs are written and listed: ``override``, else ``$R3LAB_RUNS``, else ``<data>/runs``, else ``./runs``."""
    if override:
        return Path(override)
    if os.environ.get("R3LAB_RUNS"):
        return Path(os.environ["R3LAB_RUNS"])
    try:
        return data_dir(data) / "runs"
    except R3LabError:
        return Path("runs")


def results_dir(override: str | os.PathLike | None = None) -> Path:
    """The committed results (benchmark tables, reference runs): ``override``, else the checkout's ``bench/results``.

    They ship in a source checkout, not in the wheel; a missing folder is an error that says so.
    """
    root = checkout()
    p = Path(override) if override else root / "bench" / "results" if root else None
    if p is None:
        raise ConfigError("no results folder: committed results live in a source checkout's bench/results, and this "
                          "r3lab is an installed package (clone the repository, or pass a folder of your own)")
    if not p.is_dir():
        raise ConfigError(f"no results folder at {p}: committed results live in a source checkout's bench/results "
                          "(or pass a folder of your own)")
    return p


def figures_dir(override: str | os.PathLike | None = None, data: str | os.PathLike | None = None) -> Path:
    """Where the paper figures go: ``override``, else the checkout's ``docs/figures``, else ``<data>/figures`` when
    ``data`` or ``$R3LAB_DATA`` names a folder, else ``./figures`` (never beside an installed package)."""
    if override:
        return Path(override)
    root = checkout()
    if root is not None:
        return root / "docs" / "figures"
    named = data or os.environ.get("R3LAB_DATA")
    return Path(named) / "figures" if named else Path("figures")


def bench_dir() -> Path | None:
    """A source checkout's ``bench/`` folder, or None (an installed r3lab has no benchmarks)."""
    root = checkout()
    return root / "bench" if root is not None else None


def bench_script(name: str) -> Path | None:
    """A source checkout's benchmark ``bench/bench_NAME.py`` (it may not exist), or None without a checkout."""
    folder = bench_dir()
    return folder / f"bench_{name}.py" if folder is not None else None
