"""slime rollout dumps (and their train dumps) into r3lab runs.

Read in THUDM/slime at ``624b824a`` (2026-08-21, the newest commit of ``main`` when read; ``--dump-details`` and the
train dump also at ``d38dc29c9``, before #2266):

* ``--save-debug-rollout-data TEMPLATE`` (``--dump-details D`` sets ``D/rollout_data/{rollout_id}.pt``,
  ``slime/utils/arguments.py``): ``save_debug_rollout_data`` (``slime/observability/rollout_data_utils.py``)
  writes ``torch.save({"rollout_id": N, "samples": [Sample.to_dict(), ...]})``. Eval rollouts go through the same
  template with ``rollout_id="eval_N"`` (``slime/ray/rollout.py`` ``RolloutManager.eval``): the path says
  ``eval_N`` while the dict still says ``"rollout_id": N``. **Eval rollouts are never training steps**: r3lab skips
  them and records them (file, rollout id, sample count) under ``eval_rollouts`` in the run's config; an ``eval_N``
  file passed alone is refused. Training samples are the rollout's flattened groups in order
  (``_get_rollout_data``), so a sample's position in ``samples`` is its ``rollout_position``.
* ``Sample`` (``slime/utils/types.py``): ``tokens`` (prompt + response), ``response_length``, ``loss_mask`` (over the
  response; multi-turn tool tokens are 0), ``rollout_log_probs``, ``rollout_routed_experts`` (an int32 tensor
  ``[len(tokens) - 1, num_layers, topk]``: all decoder layers, turns concatenated via ``routed_experts_start_len``),
  ``reward`` (a float or a dict: ``--reward-key``), ``index`` (the global ``Sample.index``,
  ``slime/rollout/data_source.py`` ``RolloutDataSource.get_samples``), ``status`` and ``spec_info`` (a top-level dict
  ``{spec_accept_token_num, spec_draft_token_num, spec_verify_ct, completion_token_num}``, non-zero only when
  SGLang speculative decoding ran: that is what marks a sample speculative; keys in ``metadata`` are read too).
* ``--save-debug-train-data``: both layouts (v2 since slime #2266, per-rank v1 before it) are read by
  :mod:`r3lab.importers.train_dumps`, which gives each sample its trainer ``log_probs`` and ``advantages``.

Newer slime (read in the index's stored versions of THUDM/slime, newer than ``624b824a`` and on no ``main`` commit
read):

* ``slime/ray/training_recovery.py`` at ``13b347f8`` (``TrainingRecovery``): with ``--save-debug-rollout-data`` and
  the Megatron backend, ``remember_converted`` writes ``<dump>.train-recovery.pt`` beside each rollout dump (the
  path is the dump's own plus that suffix, through a ``.tmp`` renamed into place): ``torch.save`` of the converted
  global batch (``BatchBuilder.convert``: per-sample lists ``tokens``, ``response_lengths``, ``rewards``,
  ``raw_reward``, ``loss_masks``, ...) kept so a restarted trainer can replay it; ``release_batches`` deletes it once
  a checkpoint covers the rollout. ``persist`` writes the journal ``.slime-recovery/<sha256 of the session>.pt``
  (through ``<sha256>.tmp``) in the rollout dumps' folder: ``RestorePlan`` and ``ReplayBatch`` dataclasses, loadable
  only with ``weights_only=False``. Neither holds anything a run lacks (the rollout dump has the samples, the train
  dump the trainer's log-probs and advantages; the converted ``rewards`` are the normalised ones advantages are
  built from), so r3lab never opens them: they are told apart by the names their writer gives them, skipped, and
  listed under ``recovery_files`` in the run's config (layout ``recovery-files``).
* ``Sample.weight_versions`` (``slime/utils/types.py``: one SGLang ``meta_info["weight_version"]`` per engine call)
  are read into ``weight_versions`` in the run's config, per rollout, with slime's own staleness
  (``slime/utils/staleness.py`` at ``85f762da``: ``current_weight_version - min(sample versions)``, a sample whose
  versions are not all integers unknown). The dump does not record the rollout manager's current version, so r3lab
  takes the newest version any sample of that rollout or an earlier one carries: a lower bound of slime's number.
  The run's ``staleness`` (the largest, read by the doctor's policy-lag check) and ``old_logprobs`` ("current":
  slime's trainer computes the old log-probs at its current weights; ``--keep-old-actor`` is not in the dump) are
  set when the rollouts are on-policy (0) or trainer log-probs were imported; a one-step-off pipeline
  (``train_async.py``) generates each rollout at a single version and shows staleness 0 here, as in slime's metric.
* Samples (and v2 train-dump samples) may carry ``rollout_topk_token_ids`` / ``rollout_topk_log_probs`` (the
  sampler's top-k heads, ``[response_length, k]``): token candidates, not routes; r3lab has no column for them and
  leaves them out by name (:data:`IGNORED_KEYS`).

Layouts (:data:`LAYOUTS`) are told apart from the bytes: a rollout dump is ``{'rollout_id', 'samples'}`` (Miles adds
``'metadata'``), train dumps as :func:`r3lab.importers.train_dumps.train_layout` says; any other dict is refused as a
layout this r3lab does not read.

A dict reward is read at ``reward_key`` (default: the dict's ``"score"``, else its only number). Everything is
loaded with ``torch.load(weights_only=True)`` (:func:`r3lab.importers.train_dumps.load_dump`): tensors, containers,
numbers and numpy arrays/scalars (a custom rollout or reward function may leave numpy values in a ``Sample``);
nothing that could run code.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import ImportFormatError, MissingExtraError, R3LabError
from r3lab.importers.common import LayerMap, Sample, write_run
from r3lab.importers.layouts import Layout, LayoutsSeen, unknown_layout
from r3lab.importers.train_dumps import TrainDumps, TrainRollout, TrainRow, load_dump, to_numpy

__all__ = [
    "rollout_files", "eval_files", "recovery_files", "iter_samples", "detect", "OPTIONS", "FORMAT", "LAYOUTS",
    "IGNORED_KEYS", "WeightVersions", "sample_from_dict", "reward_of", "rollout_layout",
]

_SLIME = "THUDM/slime"
LAYOUTS: tuple[Layout, ...] = (
    Layout("rollout", f"{_SLIME}@624b824a slime/observability/rollout_data_utils.py save_debug_rollout_data "
           "(--save-debug-rollout-data)",
           "a dict of exactly {'rollout_id', 'samples'}, samples as Sample.to_dict()",
           "routes, engine log-probs, rewards, loss masks, weight versions"),
    Layout("train-v1", f"{_SLIME}@d38dc29c9 slime/utils/train_dump_utils.py (before #2266)",
           "one file per global rank: {'rollout_id', 'rank', 'rollout_data'}",
           "trainer log-probs, advantages (joined on Sample.index, CP slices reassembled)"),
    Layout("train-v2", f"{_SLIME}@624b824a slime/observability/train_data_utils.py _build_dump_payload (#2266)",
           "format_version 2, one file per rollout, samples with rollout_position",
           "trainer log-probs, advantages (joined on rollout_position)"),
    Layout("train-v2-topk", f"{_SLIME}@d92cb5de slime/observability/train_data_utils.py (sampler heads)",
           "format_version 2 whose samples carry rollout_topk_token_ids / rollout_topk_log_probs",
           "trainer log-probs, advantages (the top-k heads are not routes: left out)"),
    Layout("recovery-files", f"{_SLIME}@13b347f8 slime/ray/training_recovery.py TrainingRecovery",
           "<dump>.train-recovery.pt files and a .slime-recovery/ journal beside the rollout dumps",
           "nothing: skipped unopened, listed under recovery_files in the run config"),
)

FORMAT = "slime"
OPTIONS: dict[str, str] = {
    "config": "the model's config.json (or its folder): maps the routes' layer axis to global layer ids",
    "train": "the --save-debug-train-data folder (or one file): trainer log-probs and advantages per sample",
    "reward_key": "which key of a dict reward to import (as slime's --reward-key); default 'score'",
}
_EVAL = re.compile(r"(?:^|[^A-Za-z0-9])eval_(\d+)(?:$|[^0-9])")
_ID = re.compile(r"(\d+)$")
SPECULATIVE_KEYS = ("spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct", "spec_accept_length")
IGNORED_KEYS = ("rollout_topk_token_ids", "rollout_topk_log_probs", "rollout_topk_valid_mask")
"""Sample keys r3lab reads past by name: the sampler's top-k token heads (candidates, not routes; no run column)."""
RECOVERY_SUFFIXES = (".train-recovery.pt", ".train-recovery.pt.tmp")  # TrainingRecovery.remember_converted
RECOVERY_DIR = ".slime-recovery"  # TrainingRecovery.journal's folder (without the straw transport)
_DETECT_MAX_BYTES = 64 << 20  # detect() opens one dump only when it is at most this large


def is_eval(path: Path) -> bool:
    """Whether a rollout dump is an eval rollout: ``eval_N`` where the template put the rollout id."""
    return _EVAL.search(path.stem) is not None


def _rollout_dir(src: Path) -> Path:
    """The folder holding the rollout dumps: SRC itself, or ``SRC/rollout_data`` (the ``--dump-details`` root)."""
    if (src / "rollout_data").is_dir() and not any(f.suffix == ".pt" for f in src.iterdir()):
        return src / "rollout_data"
    return src


def is_recovery(f: Path) -> bool:
    """A training-recovery neighbour of the rollout dumps (``<dump>.train-recovery.pt``), named so by its writer."""
    return f.name.endswith(RECOVERY_SUFFIXES)


def _all_dumps(src: str | os.PathLike) -> list[Path]:
    p = Path(src)
    if p.is_file():
        if is_recovery(p):
            raise ImportFormatError(f"{str(p)!r} is a slime training-recovery file (TrainingRecovery: the converted "
                                    "batch kept for a trainer restart), not a rollout dump; pass the rollout dumps")
        return [p]
    if not p.is_dir():
        raise ImportFormatError(f"{str(p)!r} is neither a dump file nor a folder of them")
    d = _rollout_dir(p)
    files = [f for f in d.iterdir() if f.is_file() and f.suffix == ".pt" and not is_recovery(f)]
    if not files:
        raise ImportFormatError(f"no .pt rollout dumps in {str(d)!r}")
    return files


def _id_of(f: Path) -> int:
    m = _EVAL.search(f.stem) or _ID.search(f.stem)
    return int(m.group(1)) if m else -1


def rollout_files(src: str | os.PathLike) -> list[Path]:
    """One training rollout dump, or every training ``*{rollout_id}.pt`` of a folder in rollout-id order."""
    files = _all_dumps(src)
    if len(files) == 1 and Path(src).is_file() and is_eval(files[0]):
        raise ImportFormatError(f"{str(src)!r} is an eval rollout (eval_N in its name: slime saves eval rollouts "
                                "with the training template); eval samples are not training steps, so r3lab does "
                                "not import them as one. Pass the training rollout dumps")
    train = [f for f in files if not is_eval(f)]
    if not train:
        raise ImportFormatError(f"only eval rollouts (eval_N) in {str(src)!r}; r3lab imports training rollouts")
    return sorted(train, key=lambda f: (_id_of(f), f.name))


def eval_files(src: str | os.PathLike) -> list[Path]:
    """The eval rollouts (``eval_N``) beside the training dumps, which r3lab skips."""
    if Path(src).is_file():
        return []
    return sorted((f for f in _all_dumps(src) if is_eval(f)), key=lambda f: (_id_of(f), f.name))


def recovery_files(src: str | os.PathLike) -> dict[str, Any] | None:
    """What slime's training recovery left beside the rollout dumps (never opened), or None when nothing."""
    p = Path(src)
    if not p.is_dir():
        return None
    d = _rollout_dir(p)
    batches = sorted(f.name for f in d.iterdir() if f.is_file() and is_recovery(f))
    jd = d / RECOVERY_DIR
    journal = sorted(f.name for f in jd.iterdir() if f.is_file()) if jd.is_dir() else []
    if not batches and not journal:
        return None
    return {"imported": False, "count": len(batches) + len(journal), "train_recovery": batches,
            "journal": [f"{RECOVERY_DIR}/{n}" for n in journal],
            "note": "slime TrainingRecovery files (the converted batch per rollout, kept for a trainer restart, and "
                    "the restart journal): nothing in them that the rollout and train dumps lack; skipped unopened"}


def default_train_dir(src: str | os.PathLike) -> Path | None:
    """``SRC/train_data`` when SRC is a ``--dump-details`` root (``rollout_data/`` beside ``train_data/``)."""
    p = Path(src)
    if p.is_dir() and _rollout_dir(p) != p and (p / "train_data").is_dir():
        return p / "train_data"
    return None


def _array(v: Any, where: str, name: str, dtype: Any) -> np.ndarray | None:
    if v is None:
        return None
    try:
        a = to_numpy(v)
    except ValueError as e:  # ragged nested lists
        raise ImportFormatError(f"{where}: {name} is ragged: {e}") from e
    if a.dtype == object:
        raise ImportFormatError(f"{where}: {name} is not a numeric array")
    kinds = {"i": "iu", "f": "fiu"}.get(dtype, "fiub")
    if a.size and a.dtype.kind not in kinds:
        raise ImportFormatError(f"{where}: {name} has dtype {a.dtype}")
    return a


def reward_of(v: Any, where: str, reward_key: str | None = None) -> float | None:
    """A float reward, or the number at ``reward_key`` of a dict reward."""
    if v is None:
        return None
    if isinstance(v, dict):
        if reward_key is not None:
            if reward_key not in v:
                raise ImportFormatError(f"{where}: reward dict has no {reward_key!r} (keys {sorted(v)})")
            return float(v[reward_key])
        for k in ("score", "reward", "acc"):
            if k in v:
                return float(v[k])
        nums = [k for k, x in v.items() if isinstance(x, int | float) and not isinstance(x, bool)]
        if len(nums) == 1:
            return float(v[nums[0]])
        raise ImportFormatError(f"{where}: reward is a dict {sorted(v)}; pass --reward-key to pick one")
    if hasattr(v, "item"):
        v = v.item()
    return float(v)


def is_speculative(d: dict[str, Any]) -> bool:
    """slime's ``spec_info`` (top level) is all zeros unless SGLang's speculative decoding ran."""
    spec = d.get("spec_info")
    if isinstance(spec, dict) and any(isinstance(x, int | float) and x > 0 for x in spec.values()):
        return True
    meta = d.get("metadata")
    return isinstance(meta, dict) and any(k in meta for k in SPECULATIVE_KEYS)


def sample_from_dict(d: Any, step: int, where: str, reward_key: str | None = None) -> Sample:
    """One ``Sample.to_dict()`` as an r3lab :class:`~r3lab.importers.common.Sample`."""
    if not isinstance(d, dict):
        raise ImportFormatError(f"{where}: a sample must be a dict (Sample.to_dict()), got {type(d).__name__}")
    for key in ("tokens", "response_length"):
        if key not in d:
            raise ImportFormatError(f"{where}: sample has no {key!r} (keys {sorted(d)})")
    tokens = _array(d["tokens"], where, "tokens", "i")
    if tokens is None:
        raise ImportFormatError(f"{where}: sample tokens are None")
    R = int(d["response_length"])
    status = d.get("status")
    status = getattr(status, "value", status)
    lp = _array(d.get("rollout_log_probs"), where, "rollout_log_probs", "f")
    mask = _array(d.get("loss_mask"), where, "loss_mask", None)
    routes = _array(d.get("rollout_routed_experts"), where, "rollout_routed_experts", "i")
    index = d.get("index")
    return Sample(step=step, tokens=tokens, response_length=R, logp_infer=lp, loss_mask=mask, routes=routes,
                  reward=reward_of(d.get("reward"), where, reward_key), index=None if index is None else int(index),
                  status=None if status is None else str(status), speculative=is_speculative(d), where=where)


_ROLLOUT_KEYS = {frozenset({"rollout_id", "samples"}): "rollout",
                 frozenset({"rollout_id", "metadata", "samples"}): "rollout-metadata"}


def rollout_layout(obj: Any) -> str | None:
    """The rollout-dump layout of a loaded file, from its keys: ``rollout`` (slime, older Miles),
    ``rollout-metadata`` (Miles since it added ``metadata``), or None."""
    return _ROLLOUT_KEYS.get(frozenset(obj)) if isinstance(obj, dict) else None


def _load_rollout(f: Path, numpy_arrays: bool, kind: str = FORMAT,
                  layouts: Sequence[Layout] = LAYOUTS) -> tuple[dict[str, Any], str]:
    """A rollout dump and its layout name; refused when it is no rollout dump, or one ``kind`` does not read."""
    obj = load_dump(f, numpy_arrays=numpy_arrays)
    if isinstance(obj, dict) and "samples" not in obj and ("rollout_data" in obj or "format_version" in obj):
        raise ImportFormatError(f"{str(f)!r} is a train dump (--save-debug-train-data), not a rollout dump: pass "
                                "its folder with --train and the rollout dumps as SRC")
    if not isinstance(obj, dict) or "samples" not in obj or "rollout_id" not in obj:
        raise ImportFormatError(f"{str(f)!r} is not a rollout dump: expected a dict with 'rollout_id' and "
                                f"'samples', got {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}")
    name = rollout_layout(obj)
    if name is None or name not in {lay.name for lay in layouts}:
        hint = {"rollout-metadata": " (Miles' rollout dump: import it as miles)"}.get(name or "", "")
        raise unknown_layout(kind, str(f), f"a rollout dump holding the keys {sorted(obj)}{hint}", layouts)
    if not isinstance(obj["samples"], list):
        raise ImportFormatError(f"{str(f)!r}: 'samples' is a {type(obj['samples']).__name__}, not a list")
    return obj, name


def _versions(v: Any) -> list[int] | None:
    """A sample's ``weight_versions`` as integers, or None where slime's ``sample_staleness`` would say unknown
    (none, or one that is not an optionally signed ASCII integer)."""
    if v is None or isinstance(v, str | bytes) or not hasattr(v, "__iter__"):
        return None
    vs = [str(x) for x in v]
    if not vs or any(not x.isascii() or not x.removeprefix("-").isdigit() for x in vs):
        return None
    return [int(x) for x in vs]


class WeightVersions:
    """Each training rollout's ``Sample.weight_versions``, summarised as slime's staleness metrics do."""

    def __init__(self) -> None:
        self.rollouts: dict[int, dict[str, Any]] = {}
        self.newest: int | None = None  # the newest version seen so far (rollout ids ascend)
        self.trainer_logprobs = False

    def add(self, rid: int, samples: Sequence[Any]) -> None:
        known = [v for v in (_versions(d.get("weight_versions")) if isinstance(d, dict) else None
                             for d in samples) if v is not None]
        rec: dict[str, Any] = {"samples": len(samples), "unknown": len(samples) - len(known),
                               "multi_version": sum(len(set(v)) > 1 for v in known)}
        if known:
            lo, hi = min(min(v) for v in known), max(max(v) for v in known)
            self.newest = hi if self.newest is None else max(self.newest, hi)
            ages = [self.newest - min(v) for v in known]
            rec.update(min=lo, max=hi, current=self.newest, staleness_max=max(ages),
                       staleness_mean=float(np.mean(ages)))
        self.rollouts[rid] = rec

    def config(self) -> dict[str, Any]:
        """``weight_versions`` for the run config, and ``staleness``/``old_logprobs`` where the doctor may read them."""
        ages = [r["staleness_max"] for r in self.rollouts.values() if "staleness_max" in r]
        out: dict[str, Any] = {"weight_versions": {
            "rollouts": {str(k): v for k, v in self.rollouts.items()},
            "staleness_max": max(ages) if ages else None,
            "note": "slime's staleness (slime/utils/staleness.py): current version - the sample's oldest; current "
                    "taken as the newest version seen up to that rollout (a lower bound; the dump does not record "
                    "it); samples whose versions are not integers are unknown"}}
        if not ages:
            out["weight_versions"]["note"] += ". No sample has integer weight versions: staleness unknown"
        elif max(ages) == 0 or self.trainer_logprobs:
            out["staleness"] = max(ages)
            out["old_logprobs"] = "current"  # slime's trainer scores old log-probs at its current weights
        return out


def _join(s: Sample, tr: TrainRow, where: str) -> None:
    if tr.response_length is not None and tr.response_length != s.response_length:
        raise ImportFormatError(f"{where}: the train dump says response length {tr.response_length}, the rollout "
                                f"dump {s.response_length}: the dumps do not belong together")
    if tr.tokens is not None and not np.array_equal(np.asarray(tr.tokens).reshape(-1), s.tokens):
        raise ImportFormatError(f"{where}: the train dump's tokens differ from the rollout dump's: the dumps are "
                                "from different runs, or the join key is wrong")
    s.logp_train, s.advantage = tr.logp_train, tr.advantage


def iter_samples(files: Sequence[Path], *, numpy_arrays: bool = True, train: TrainDumps | None = None,
                 reward_key: str | None = None, seen: LayoutsSeen | None = None,
                 versions: WeightVersions | None = None, kind: str = FORMAT,
                 layouts: Sequence[Layout] = LAYOUTS) -> Iterator[Sample]:
    """Every sample of the training dumps, one file in memory at a time, step = the dump's ``rollout_id``.

    ``seen`` collects the layouts met, ``versions`` each rollout's weight versions."""
    last: int | None = None
    for f in files:
        obj, name = _load_rollout(f, numpy_arrays, kind, layouts)
        if seen is not None:
            seen.add(name)
        rid = int(obj["rollout_id"])
        if last is not None and rid <= last:
            raise ImportFormatError(f"{str(f)!r} holds rollout {rid} after rollout {last}: two dumps of one rollout, "
                                    "or names that do not sort by rollout id")
        last = rid
        samples = obj["samples"]
        if versions is not None:
            versions.add(rid, samples)
        tr: TrainRollout | None = None
        if train is not None and rid in train:
            lengths = {int(d["index"]): (len(d["tokens"]), int(d.get("response_length", 0))) for d in samples
                       if isinstance(d, dict) and d.get("index") is not None and "tokens" in d}
            tr = train.rollout(rid, lengths)
            if seen is not None:
                seen.add(tr.layout_name)
            if versions is not None:
                versions.trainer_logprobs = versions.trainer_logprobs or tr.has_logprobs
            if len(tr) != len(samples):
                raise ImportFormatError(f"{f.name}: the train dump of rollout {rid} has {len(tr)} samples, the rollout "
                                        f"dump {len(samples)}")
        seen_index: set[int] = set()
        for i, d in enumerate(samples):
            where = f"{f.name} sample {i}"
            s = sample_from_dict(d, rid, where, reward_key)
            if tr is not None:
                if tr.layout != "slime v2" and s.index is not None:
                    if s.index in seen_index:
                        raise ImportFormatError(f"{where}: Sample.index {s.index} appears twice in the rollout; the "
                                                f"{tr.layout} train dump is joined on it")
                    seen_index.add(s.index)
                _join(s, tr.row(i, s.index, where), where)
            samples[i] = None  # free each sample as it is handed on
            yield s
        del obj, samples


def _eval_summary(files: Sequence[Path], numpy_arrays: bool, kind: str, layouts: Sequence[Layout],
                  seen: LayoutsSeen) -> dict[str, Any]:
    per: dict[str, int] = {}
    ids = []
    for f in files:
        obj, name = _load_rollout(f, numpy_arrays, kind, layouts)
        seen.add(name)
        per[f.name] = len(obj["samples"])
        ids.append(int(obj["rollout_id"]))
        del obj
    return {"imported": False, "rollout_ids": ids, "samples": sum(per.values()), "files": per,
            "note": "eval rollouts (eval_N) are not training steps; r3lab leaves them out of the run"}


def import_slime(src: str | os.PathLike, out: str | os.PathLike, *, config: str | os.PathLike | None = None,
                 train: str | os.PathLike | None = None, reward_key: str | None = None,
                 source_format: str = FORMAT, numpy_arrays: bool = True,
                 layouts: Sequence[Layout] = LAYOUTS) -> Path:
    """Import slime rollout dumps (a file or a folder) into the run folder ``out``; returns its path.

    Eval rollouts (``eval_N``) are skipped and listed under ``eval_rollouts`` in the run config, training-recovery
    files under ``recovery_files``. ``train`` (or ``SRC/train_data`` when SRC is a ``--dump-details`` folder) adds
    trainer log-probs and advantages. ``layouts`` are the layouts the kind reads (Miles passes its own).
    """
    files = rollout_files(src)
    evals = eval_files(src)
    seen = LayoutsSeen(layouts)
    train_src = train if train is not None else default_train_dir(src)
    dumps = (TrainDumps(train_src, numpy_arrays=numpy_arrays, kind=source_format, layouts=layouts)
             if train_src is not None else None)
    lmap = LayerMap.from_config(config) if config is not None else None
    extra: dict[str, Any] = {"config_json": None if config is None else str(config)}
    if evals:
        extra["eval_rollouts"] = _eval_summary(evals, numpy_arrays, source_format, layouts, seen)
    if (rec := recovery_files(src)) is not None:
        seen.add("recovery-files")
        extra["recovery_files"] = rec
    if dumps is not None:
        ids = sorted(_id_of(f) for f in files)
        extra["train_dump"] = {"path": str(train_src), "files": len(dumps.files),
                               "rollouts_without_train_dump": [i for i in ids if i not in dumps]}
    versions = WeightVersions()
    return write_run(iter_samples(files, numpy_arrays=numpy_arrays, train=dumps, reward_key=reward_key, seen=seen,
                                  versions=versions, kind=source_format, layouts=layouts),
                     out, source_format=source_format,
                     files=[*files, *evals, *(dumps.files if dumps else [])], layer_map=lmap, extra=extra,
                     layouts=seen, late_config=versions.config)


def detect(path: Path) -> str | None:
    """A reason when ``path`` looks like a slime dump, else None (names first; at most one small file opened)."""
    return _detect(Path(path), "slime")


def _detect(p: Path, kind: str) -> str | None:
    """Shared by slime and Miles: ``kind`` is the framework asked about."""
    if p.is_dir():
        root_miles = (p / "dashboard_columns").is_dir() or (p.parent / "dashboard_columns").is_dir()
        d = _rollout_dir(p)
        pts = sorted((f for f in d.iterdir() if f.is_file() and f.suffix == ".pt" and not is_recovery(f)),
                     key=lambda f: f.stat().st_size)
        if not pts:
            if (p / "train_data").is_dir() or p.name == "train_data":
                pts = sorted((f for f in (p / "train_data" if (p / "train_data").is_dir() else p).iterdir()
                              if f.suffix == ".pt"), key=lambda f: f.stat().st_size)
            if not pts:
                return None
        probe = pts[0]
    elif p.is_file() and p.suffix == ".pt" and not is_recovery(p):
        root_miles = (p.parent.parent / "dashboard_columns").is_dir()
        probe = p
    else:
        return None
    if not (_ID.search(probe.stem) or is_eval(probe)):
        return None
    if probe.stat().st_size > _DETECT_MAX_BYTES:  # too large to open: the names are all there is
        if root_miles:
            return f"{probe.name} beside dashboard_columns/ (Miles --dump-details)" if kind == "miles" else None
        return f"numbered .pt dumps ({probe.name}); slime and Miles name them alike"
    what = _probe(probe)
    if what is None:  # opened, and not a slime/Miles dump
        return None
    framework, reason = what
    return reason if framework == kind else None


def _probe(f: Path) -> tuple[str, str] | None:
    try:
        obj = load_dump(f)
    except MissingExtraError:  # no torch to open a .pt: saying so beats "not recognised"
        raise
    except (R3LabError, OSError):  # detection never raises: a file it cannot read is simply not recognised
        return None
    if not isinstance(obj, dict):
        return None
    keys = set(obj)
    if {"rollout_id", "samples", "metadata"} <= keys and "format_version" not in keys:
        return "miles", f"{f.name} holding {{'rollout_id','metadata','samples'}} (Miles --save-debug-rollout-data)"
    if keys == {"rollout_id", "samples"}:
        return "slime", f"{f.name} holding {{'rollout_id','samples'}} (slime --save-debug-rollout-data)"
    if obj.get("format_version") == 2 and "samples" in keys:
        return "slime", f"{f.name} holding format_version 2 (slime --save-debug-train-data since #2266)"
    if {"rollout_id", "rank", "rollout_data", "cp_rank", "cp_size", "qkv_format"} <= keys:
        return "miles", f"{f.name} holding {{'rollout_id','rank','rollout_data','cp_rank','cp_size','qkv_format'}} " \
                        "(Miles --save-debug-train-data)"
    if keys == {"rollout_id", "rank", "rollout_data"}:
        return "slime", f"{f.name} holding {{'rollout_id','rank','rollout_data'}} (slime --save-debug-train-data " \
                        "before #2266)"
    return None
