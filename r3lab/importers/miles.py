"""Miles rollout and train dumps into r3lab runs (slime's reader, numpy arrays allowed).

Read in radixark/miles at ``31f1ca96`` (2026-08-21, the newest commit of ``main`` when read):

* ``--save-debug-rollout-data`` (``--dump-details D`` sets ``D/rollout_data/{rollout_id}.pt`` and
  ``D/train_data/{rollout_id}_{rank}.pt``, ``miles/utils/arguments.py`` ``miles_validate_args``):
  ``save_debug_rollout_data`` (``miles/ray/rollout/debug_data.py``) writes
  ``torch.save({"rollout_id": N, "metadata": {...}, "samples": [Sample.to_dict()]})``, eval rollouts as ``eval_N``
  through the same template with ``"rollout_id": N`` (``miles/ray/rollout/rollout_manager.py``; Miles' reader tells them
  apart by the ``eval_`` prefix, ``miles/dashboard/dump_reader.py:rollout_ids``). It also writes
  ``D/dashboard_columns/rollout_{N}.parquet`` and ``D/trajectory/`` beside ``rollout_data/``.
  ``Sample.rollout_routed_experts`` is a numpy int32 array ``[len(tokens) - 1, num_layers, topk]``
  (``miles/utils/types.py``); ``spec_info`` is slime's top-level dict.
* ``--save-debug-train-data`` (``miles/utils/train_dump_utils.py``): one file per global rank,
  ``{"rollout_id", "rank", "rollout_data", "cp_rank", "cp_size", "qkv_format"}``, ``rollout_data`` the rank's DP
  shard (``partition`` popped, ``miles/ray/rollout/train_data_conversion.py:process_rollout_data_shard``;
  ``sample_indices`` = ``Sample.index``), CP fields as that CP rank's zigzag slice, TP ranks duplicate. Read by
  :mod:`r3lab.importers.train_dumps`: joined on ``Sample.index``, CP reassembled per ``qkv_format`` (thd, bshd),
  TP copies checked equal and dropped.

Layouts (:data:`LAYOUTS`, told apart from the bytes by :func:`r3lab.importers.slime.rollout_layout` and
:func:`r3lab.importers.train_dumps.train_layout`): the rollout dump without ``metadata`` (Miles as forked from slime,
``e0be9a075``; its reader still takes files without it, ``_load_rollout_data_file``) and with it; the per-rank train
dump as slime v1 before #2581 (``62a66297b``, 2026-08-17) and with ``cp_rank``/``cp_size``/``qkv_format`` since.
slime's format_version 2 train dump is not a Miles layout and is refused (import it as slime). Weight versions and
training-recovery neighbours are read as :mod:`r3lab.importers.slime` reads them (Miles writes no recovery files at
``31f1ca96``; its ``Sample.weight_versions`` are slime's).

Eval rollouts are skipped and recorded (see :mod:`r3lab.importers.slime`). Loading a numpy array through
``torch.load(weights_only=True)`` needs numpy's reconstructors: they, and only they, are allowed
(:data:`r3lab.importers.common.NUMPY_ALLOWLIST`).
"""

from __future__ import annotations

import os
from pathlib import Path

from r3lab.importers.layouts import Layout
from r3lab.importers.slime import LAYOUTS as _SLIME_LAYOUTS
from r3lab.importers.slime import OPTIONS as _SLIME_OPTIONS
from r3lab.importers.slime import _detect, import_slime

__all__ = ["detect", "OPTIONS", "FORMAT", "LAYOUTS"]

_MILES = "radixark/miles"
_RECOVERY = next(lay for lay in _SLIME_LAYOUTS if lay.name == "recovery-files")
LAYOUTS: tuple[Layout, ...] = (
    Layout("rollout", f"{_MILES}@e0be9a075 (forked from slime) save_debug_rollout_data",
           "a dict of exactly {'rollout_id', 'samples'}", "routes (numpy), engine log-probs, rewards, weight versions"),
    Layout("rollout-metadata", f"{_MILES}@31f1ca96 miles/ray/rollout/debug_data.py save_debug_rollout_data",
           "a dict of exactly {'rollout_id', 'metadata', 'samples'}",
           "routes (numpy), engine log-probs, rewards, weight versions"),
    Layout("train-v1", f"{_MILES}@62a66297b^ miles/utils/train_dump_utils.py (before #2581)",
           "one file per global rank: {'rollout_id', 'rank', 'rollout_data'}",
           "trainer log-probs, advantages (joined on Sample.index, CP slices inferred)"),
    Layout("train-cp", f"{_MILES}@31f1ca96 miles/utils/train_dump_utils.py (#2581)",
           "per rank: {'rollout_id', 'rank', 'rollout_data', 'cp_rank', 'cp_size', 'qkv_format'}",
           "trainer log-probs, advantages (CP slices reassembled, TP copies dropped)"),
    _RECOVERY,
)

FORMAT = "miles"
OPTIONS: dict[str, str] = {
    **_SLIME_OPTIONS,
    "train": "the --save-debug-train-data folder (train_data/{id}_{rank}.pt): trainer log-probs and advantages, "
             "CP slices reassembled, TP copies dropped",
}


def import_miles(src: str | os.PathLike, out: str | os.PathLike, *, config: str | os.PathLike | None = None,
                 train: str | os.PathLike | None = None, reward_key: str | None = None) -> Path:
    """Import Miles rollout dumps (a file, ``rollout_data/`` or the ``--dump-details`` folder) into ``out``."""
    return import_slime(src, out, config=config, train=train, reward_key=reward_key, source_format=FORMAT,
                        numpy_arrays=True, layouts=LAYOUTS)


def detect(path: Path) -> str | None:
    """A reason when ``path`` looks like a Miles dump, else None (names first; at most one small file opened)."""
    return _detect(Path(path), "miles")
