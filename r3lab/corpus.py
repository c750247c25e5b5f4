"""Prompts drawn from the shipped Markov corpus, the text the tiny models were trained on.

The experiments, the notebooks and the benchmarks draw their prompts here (seeded, so runs reproduce).
"""

from __future__ import annotations

import os

import numpy as np

from r3lab.errors import ConfigError
from r3lab.paths import corpus_path

__all__ = ["corpus_prompts"]


def corpus_prompts(n: int, *, words: int = 12, seed: int = 0, data: str | os.PathLike | None = None) -> list[str]:
    """``n`` distinct corpus lines chosen with ``seed``, each cut to its first ``words`` words."""
    lines = [ln for ln in corpus_path(data).read_text().splitlines() if ln.strip()]
    if not 0 < n <= len(lines):
        raise ConfigError(f"asked for {n} prompts; the corpus has {len(lines)} lines")
    rng = np.random.default_rng(seed)
    return [" ".join(lines[int(i)].split()[:words]) for i in rng.choice(len(lines), n, replace=False)]
