"""slime rollout dumps (and their train dumps) into r3lab runs.

Read from slime's source (THUDM/slime): ``--save-debug-rollout-data path_{rollout_id}.pt`` writes
``torch.save({"rollout_id": int, "samples": [Sample.to_dict(), ...]})`` (``slime/ray/rollout.py``; read back by
``slime/utils/debug_utils/display_debug_rollout_data.py``). ``Sample`` (``slime/utils/types.py``) has ``tokens``
(prompt + response ids), ``response_length``, ``loss_mask`` (over the response), ``rollout_log_probs`` (one per
response token), ``rollout_routed_experts`` (``[len(tokens) - 1, layers, top_k]``: a torch int32 tensor or nested
lists, or None), ``reward`` (a float or a dict), ``index``, ``group_index``, ``status``, ``weight_versions`` and
``metadata``. ``--save-debug-train-data`` writes ``torch.save({"rollout_id", "rank", "rollout_data"})`` per rank
(``slime/utils/train_dump_utils.py``); r3lab joins its per-sample trainer ``log_probs`` (CP shards already
reassembled) to the rollout samples by ``sample_indices`` when present, else by order over ranks.

A dict reward is read at ``reward_key`` (default: the dict's ``"score"``, else its only number). Everything is
loaded with ``torch.load(weights_only=True)`` (:func:`r3lab.importers.common.safe_torch_load`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import ImportFormatError
from r3lab.importers.common import LayerMap, Sample, safe_torch_load, write_run

__all__ = ["import_slime", "rollout_files", "iter_samples", "FORMAT"]

FORMAT = "slime"
_ID = re.compile(r"(\d+)(?=\.pt$)")
SPECULATIVE_KEYS = ("spec_accept_token_num", "spec_verify_ct", "speculative", "spec_accept_length")


def rollout_files(src: str | os.PathLike) -> list[Path]:
    """One ``.pt`` file, or every ``*_{rollout_id}.pt`` of a folder in rollout-id order."""
    p = Path(src)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ImportFormatError(f"{str(p)!r} is neither a dump file nor a folder of them")
    files = [f for f in p.iterdir() if f.suffix == ".pt" or f.suffix.lower() in (".pkl", ".pickle")]
    if not files:
        raise ImportFormatError(f"no .pt rollout dumps in {str(p)!r}")
    return sorted(files, key=lambda f: (int(m.group(1)) if (m := _ID.search(f.name)) else -1, f.name))


def _array(v: Any, where: str, name: str, dtype: Any) -> np.ndarray | None:
    if v is None:
        return None
    if hasattr(v, "detach"):  # a torch tensor
        v = v.detach().cpu().numpy()
    try:
        a = np.asarray(v)
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


def sample_from_dict(d: Any, step: int, where: str, reward_key: str | None = None) -> Sample:
    """One ``Sample.to_dict()`` as an r3lab :class:`~r3lab.importers.common.Sample`."""
    if not isinstance(d, dict):
        raise ImportFormatError(f"{where}: a sample must be a dict (Sample.to_dict()), got {type(d).__name__}")
    for key in ("tokens", "response_length"):
        if key not in d:
            raise ImportFormatError(f"{where}: sample has no {key!r} (keys {sorted(d)})")
    tokens = _array(d["tokens"], where, "tokens", "i")
    R = int(d["response_length"])
    meta = d.get("metadata") or {}
    status = d.get("status")
    status = getattr(status, "value", status)
    lp = _array(d.get("rollout_log_probs"), where, "rollout_log_probs", "f")
    mask = _array(d.get("loss_mask"), where, "loss_mask", None)
    routes = _array(d.get("rollout_routed_experts"), where, "rollout_routed_experts", "i")
    return Sample(step=step, tokens=tokens, response_length=R, logp_infer=lp, loss_mask=mask, routes=routes,
                  reward=reward_of(d.get("reward"), where, reward_key), index=d.get("index"),
                  status=None if status is None else str(status),
                  speculative=isinstance(meta, dict) and any(k in meta for k in SPECULATIVE_KEYS), where=where)


def _train_logps(train_files: Sequence[Path], numpy_arrays: bool) -> dict[int, dict[int, np.ndarray]]:
    """rollout_id -> {sample position: trainer log-probs} from slime train dumps."""
    out: dict[int, dict[int, np.ndarray]] = {}
    by_rollout: dict[int, list[tuple[int, Any]]] = {}
    for f in train_files:
        obj = safe_torch_load(f, numpy_arrays=numpy_arrays)
        if not isinstance(obj, dict) or "rollout_data" not in obj or "rollout_id" not in obj:
            raise ImportFormatError(f"{str(f)!r} is not a slime train dump (no rollout_id/rollout_data)")
        by_rollout.setdefault(int(obj["rollout_id"]), []).append((int(obj.get("rank", 0)), obj["rollout_data"]))
    for rid, parts in by_rollout.items():
        pos = 0
        for _, data in sorted(parts, key=lambda x: x[0]):
            if "log_probs" not in data:
                raise ImportFormatError(f"train dump of rollout {rid} has no 'log_probs' (keys {sorted(data)})")
            idx = data.get("sample_indices")
            for j, lp in enumerate(data["log_probs"]):
                key = int(idx[j]) if idx is not None else pos
                out.setdefault(rid, {})[key] = _array(lp, f"train dump of rollout {rid}", "log_probs", "f")
                pos += 1
    return out


def iter_samples(files: Sequence[Path], *, numpy_arrays: bool = False, train_files: Sequence[Path] = (),
                 reward_key: str | None = None) -> Iterator[Sample]:
    """Every sample of the dumps, one file in memory at a time, step = the dump's ``rollout_id``."""
    train = _train_logps(train_files, numpy_arrays) if train_files else {}
    for f in files:
        obj = safe_torch_load(f, numpy_arrays=numpy_arrays)
        if not isinstance(obj, dict) or "samples" not in obj:
            raise ImportFormatError(f"{str(f)!r} is not a rollout dump: expected a dict with 'samples' and "
                                    f"'rollout_id', got {type(obj).__name__}")
        rid = int(obj.get("rollout_id", 0))
        samples = obj["samples"]
        for i, d in enumerate(samples):
            s = sample_from_dict(d, rid, f"{f.name} sample {i}", reward_key)
            if rid in train:
                if i not in train[rid]:
                    raise ImportFormatError(f"{f.name} sample {i}: no trainer log-probs in the train dump")
                s.logp_train = train[rid][i]
            samples[i] = None  # free each sample as it is handed on
            yield s
        del obj, samples


def import_slime(src: str | os.PathLike, out: str | os.PathLike, *, config: str | os.PathLike | None = None,
                 train: str | os.PathLike | None = None, reward_key: str | None = None,
                 source_format: str = FORMAT, numpy_arrays: bool = False) -> Path:
    """Import slime rollout dumps (a file or a folder) into the run folder ``out``; returns its path."""
    files = rollout_files(src)
    train_files = rollout_files(train) if train is not None else []
    lmap = LayerMap.from_config(config) if config is not None else None
    return write_run(iter_samples(files, numpy_arrays=numpy_arrays, train_files=train_files, reward_key=reward_key),
                     out, source_format=source_format, files=[*files, *train_files], layer_map=lmap,
                     extra={"config_json": None if config is None else str(config)})
