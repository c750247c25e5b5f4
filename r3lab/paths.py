"""Where r3lab finds its shipped data (tiny models, corpus) and where runs go.

The data ships in a source checkout's ``data/``, not in the wheel. Lookup order: ``$R3LAB_DATA``,
then the ``data/`` beside the package (a source checkout or an editable install), then ``./data``.
"""

from __future__ import annotations

import os
from pathlib import Path

from r3lab.errors import R3LabError

__all__ = ["data_dir", "model_dir", "corpus_path", "runs_dir", "results_dir", "figures_dir", "bench_script", "MODELS"]

MODELS = ("tiny-qwen3-moe", "tiny-glm4-moe", "tiny-olmoe")  # the shipped checkpoints, in data/models/
CHECKOUT = Path(__file__).resolve().parent.parent  # a source checkout's root (an installed wheel has no bench/ there)


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """The data folder: ``override``, else ``$R3LAB_DATA``, else the checkout's ``data/``, else ``./data``."""
    candidates = [override, os.environ.get("R3LAB_DATA"), CHECKOUT / "data", Path("data")]
    tried = []
    for c in candidates:
        if not c:
            continue
        p = Path(c)
        if (p / "models").is_dir() or (p / "corpus").is_dir():
            return p.resolve()
        tried.append(str(p))
        if c is override or c == os.environ.get("R3LAB_DATA"):
            raise R3LabError(f"{str(p)!r} is not an r3lab data folder (it needs models/ or corpus/)")
    raise R3LabError(
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
        raise R3LabError(f"no model {str(name_or_path)!r} in {q.parent} (shipped: {', '.join(MODELS)})")
    raise R3LabError(f"model directory {str(p)!r} does not exist")


def corpus_path(data: str | os.PathLike | None = None) -> Path:
    """The Markov corpus the tiny models were trained on (one document a line)."""
    p = data_dir(data) / "corpus" / "markov.txt"
    if not p.is_file():
        raise R3LabError(f"corpus {str(p)!r} is missing")
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
    p = Path(override) if override else CHECKOUT / "bench" / "results"
    if not p.is_dir():
        raise R3LabError(f"no results folder at {p}: committed results live in a source checkout's bench/results "
                         "(or pass a folder of your own)")
    return p


def figures_dir(override: str | os.PathLike | None = None) -> Path:
    """Where the paper figures go: ``override``, else the checkout's ``docs/figures``."""
    return Path(override) if override else CHECKOUT / "docs" / "figures"


def bench_script(name: str) -> Path:
    """A source checkout's benchmark ``bench/bench_NAME.py`` (it may not exist: an installed r3lab has no bench/)."""
    return CHECKOUT / "bench" / f"bench_{name}.py"
