"""Per-token tables of RL runs, pooled per replay mode for the drift figures."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from r3lab.config import MODES
from r3lab.errors import RunFormatError
from r3lab.runs.reader import Run
from r3lab.vocabulary import RunKind


def mode_order(modes: Iterable[str]) -> list[str]:
    """none, R2, R3 first, in that order (:data:`r3lab.config.MODES`); other modes after them."""
    return sorted(modes, key=lambda m: MODES.index(m) if m in MODES else len(MODES))


def rl_token_logprobs(runs: Sequence[Run], step: int | None = None) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]],
                                                                               dict[str, np.ndarray]]:
    """Per replay mode, the sampled tokens of RL runs at one stored step (default: each run's last), seeds pooled:
    ``({mode: (logp_old, logp_infer)}, {mode: flipped})`` for the drift figures. ``logp_old`` is the trainer's
    old-policy log-prob the loss uses (under R3 with the engine's routes replayed)."""
    pairs: dict[str, list[Any]] = {}
    for r in runs:
        r.require_kind(RunKind.RL)
        have = r.token_steps()
        if not have or (step is not None and step not in have):
            raise RunFormatError(f"run {r.name!r} has token tables at steps {have}, not at {step}")
        t = r.tokens([have[-1] if step is None else step])
        pairs.setdefault(r.config["mode"], []).append(t)
    order = mode_order(pairs)
    logps = {m: (np.concatenate([t["logp_old"] for t in pairs[m]]), np.concatenate([t["logp_infer"] for t in pairs[m]]))
             for m in order}
    return logps, {m: np.concatenate([t["flipped"] for t in pairs[m]]).astype(bool) for m in order}
