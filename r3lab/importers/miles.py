"""Miles rollout dumps into r3lab runs: slime's layout with numpy routes.

Miles (radixark/miles) keeps slime's ``--save-debug-rollout-data`` dump (``torch.save`` of ``{"rollout_id",
"samples": [Sample.to_dict()]}``; read back in ``miles/utils/debug_utils/display_debug_rollout_data.py``) but
stores ``rollout_routed_experts`` as a numpy int32 array ``[len(tokens) - 1, layers, top_k]``. Loading a numpy
array through ``torch.load(weights_only=True)`` needs numpy's reconstructors: they, and only they, are allowed
(:data:`r3lab.importers.common.NUMPY_ALLOWLIST`).
"""

from __future__ import annotations

import os
from pathlib import Path

from r3lab.importers.slime import import_slime

__all__ = ["import_miles", "FORMAT"]

FORMAT = "miles"
OPTIONS = {"config": "the model's config.json (maps the dump's layer axis to global layer ids; needed for routes)",
           "train": "the train_data/ dumps (trainer log-probs) to join",
           "reward_key": "the key of a dict reward to read (default: 'score')"}


def detect(path: Path) -> str | None:
    """Miles' rollout files are named as slime's: told apart only by their contents (not read here)."""
    return None


def import_miles(src: str | os.PathLike, out: str | os.PathLike, *, config: str | os.PathLike | None = None,
                 train: str | os.PathLike | None = None, reward_key: str | None = None) -> Path:
    """Import Miles rollout dumps (a file or a folder) into the run folder ``out``; returns its path."""
    return import_slime(src, out, config=config, train=train, reward_key=reward_key, source_format=FORMAT,
                        numpy_arrays=True)
