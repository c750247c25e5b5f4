"""SkyRL ``trainer.dump_data_batch`` pickles into r3lab runs, with routes.

Read from SkyRL's source (NovaSky-AI/SkyRL, commit ``a9564572`` of 2026-08-21, the newest in r3lab's mirror):

* ``skyrl/train/trainer.py:1236-1242`` ``dump_data`` writes ``{export_path}/dumped_data/{file_name}.pkl`` with
  ``file_name = f"global_step_{N}_training_input"`` (``trainer.py:441-446``; ``fully_async_trainer.py:875`` the
  same). It runs after advantages are computed and after ``training_input.pop("rewards")`` (``trainer.py:434-438``):
  **the dump has no rewards**, only ``advantages``/``returns``. ``dumped_evals/`` beside it is not read.
* ``skyrl/backends/skyrl_train/training_batch.py:17-35,244-279,395-398`` ``TensorBatch.save`` is ``pickle.dump(self)``;
  ``__reduce__`` is ``(_rebuild_tensor_batch, (type(self), self.__getstate__()))`` (since #1379, 2026-03-24), state
  ``{"batch_dict": {key: {"format": "numpy", "data": bytes, "shape", "dtype": str} | {"format": "torch", "data":
  torch.save bytes} (bfloat16) | {"format": "tensor_list", "items": [...]} | None}, "batch_size", "device":
  torch.device, "metadata": dict}``. The pickle therefore names exactly
  ``skyrl.backends.skyrl_train.training_batch._rebuild_tensor_batch``, ``...training_batch.TrainingInputBatch``
  and ``torch.device``; :func:`load_batch` allows those three (as r3lab stand-ins) and nothing else. Dumps from
  before #1379 pickled the dict's items through torch's storage pickling and are refused by name.
* ``training_batch.py:504-560`` ``pad_training_input_batch`` appends ``metadata["pad_size"]`` DP pad rows at the
  end (copies of row 0, ``loss_mask`` zero, routes ``[0..k-1]``, ``router_padding_mask`` all True): dropped here.
* ``skyrl/train/dataset/preprocess.py`` ``convert_prompts_responses_to_batch_tensors`` (layout since #1285,
  2026-03-20): ``sequences``/``attention_mask`` ``[B, S]`` left-padded (``S = max(P_i + R_i)``), response tensors
  ``[B, max R]`` right-aligned with ``response_mask`` 1 on the last ``R_i`` columns (``loss_mask``,
  ``rollout_logprobs`` engine log-probs, ``action_log_probs`` trainer log-probs, ``advantages``). Tokens are read
  where ``attention_mask`` is 1 and response values where ``response_mask`` is 1, so the layout before #1285
  (response right-padded) reads the same.
* Routes ``rollout_expert_indices`` ``[B, S, layers, topk]`` (uint8/int16/int32, ``compact_routed_expert_indices``
  in ``skyrl/backends/skyrl_train/utils/routed_experts.py``) hold the engine's captured rows from the sequence's
  first real position; since #1908 (2026-07-29) ``router_padding_mask`` ``[B, S]`` (``make_router_padding_mask``)
  is True on left padding and on the uncaptured suffix, which holds dummy rows ``[0..k-1]``
  (``utils/replay_utils.py make_replay_padding_indices``). Before #1908 (read at ``68326807a~1``) the suffix was
  zero-filled and no mask was written: there the captured prefix ends at the last row that is not all zero (exact
  for top-k >= 2, whose real rows hold distinct ids).

Row convention (r3lab's ``P + R - 1``): vLLM captures ``P + R - 1`` rows (the last sampled token is never fed
back), so the first ``P + R - 1`` captured rows are the sample's routes and a padded row is never read. A sample
whose capture is shorter (SkyRL's synthetic EOS after a stop string, step-wise observations; #1908 "terminal
uncaptured suffix") keeps its tokens and log-probs; its routes are left out and the shortfall is recorded for
``r3lab doctor`` (``route rows``, from the import's capture log).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import ImportFormatError, UnsafeFileError
from r3lab.importers.common import LayerMap, Sample, write_run
from r3lab.importers.unpickle import Marker, Rebuilder, numeric_dtype, restricted_load

__all__ = ["import_skyrl", "step_files", "iter_samples", "load_batch", "detect", "OPTIONS", "FORMAT",
           "REBUILD", "BATCH_CLASS"]

FORMAT = "skyrl"
OPTIONS: dict[str, str] = {
    "config": "the model's config.json (or its folder): maps the routes' layer axis to global layer ids",
}
MODULE = "skyrl.backends.skyrl_train.training_batch"
REBUILD = (MODULE, "_rebuild_tensor_batch")
BATCH_CLASS = (MODULE, "TrainingInputBatch")
_FILE = re.compile(r"^global_step_(\d+)_training_input\.pkl$")
WRITER = "SkyRL's dump_data_batch"


def _allowed(path: str) -> dict[tuple[str, str], Any]:
    batch_cls = Marker(".".join(BATCH_CLASS), path)

    def rebuild(where: str, args: tuple[Any, ...]) -> dict[str, Any]:
        if len(args) != 2 or args[0] is not batch_cls or not isinstance(args[1], dict):
            raise UnsafeFileError(f"{where} called with arguments its writer never passes (expected "
                                  "TrainingInputBatch and a state dict)")
        return args[1]

    def device(where: str, args: tuple[Any, ...]) -> str:
        if not 1 <= len(args) <= 2 or not isinstance(args[0], str) or not all(isinstance(x, int) for x in args[1:]):
            raise UnsafeFileError(f"{where} called with {args!r}")
        return ":".join(str(a) for a in args)

    return {REBUILD: Rebuilder(".".join(REBUILD), path, rebuild), BATCH_CLASS: batch_cls,
            ("torch", "device"): Rebuilder("torch.device", path, device)}


def _tensor(v: Any, where: str) -> np.ndarray | None:
    """One ``_serialize_tensor`` entry as a numpy array (numeric dtypes only; bfloat16 via torch's safe loader)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ImportFormatError(f"{where} is {type(v).__name__}, not a serialized tensor dict")
    fmt = v.get("format", "numpy")  # no "format" key: SkyRL's legacy numpy layout
    if fmt == "numpy":
        data, shape = v.get("data"), v.get("shape")
        if not isinstance(data, bytes) or not isinstance(shape, tuple):
            raise ImportFormatError(f"{where}: a numpy tensor without bytes 'data' and a 'shape' tuple")
        arr = np.frombuffer(data, dtype=numeric_dtype(v.get("dtype"), where))
        if arr.size != int(np.prod(shape)):
            raise ImportFormatError(f"{where}: {arr.size} values for shape {shape}")
        return arr.reshape(shape)
    if fmt == "torch":
        import torch

        try:
            t = torch.load(io.BytesIO(v["data"]), map_location="cpu", weights_only=True)
        except Exception as e:
            raise UnsafeFileError(f"{where}: torch.save bytes that torch's weights-only loader refuses: {e}") from e
        if not isinstance(t, torch.Tensor):
            raise ImportFormatError(f"{where}: torch bytes hold {type(t).__name__}, not a tensor")
        return t.float().numpy() if t.is_floating_point() else t.numpy()
    if fmt == "tensor_list":
        return None  # pixel_values / image_grid_thw: not read
    raise ImportFormatError(f"{where}: unknown tensor format {fmt!r}")


def load_batch(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays by key, metadata)`` of one ``global_step_N_training_input.pkl``, loaded without running code."""
    state = restricted_load(path, _allowed(str(path)), WRITER)
    if not isinstance(state, dict) or not isinstance(state.get("batch_dict"), dict):
        raise ImportFormatError(f"{str(path)!r} is not a SkyRL TrainingInputBatch pickle (no batch_dict state)")
    arrays = {}
    for k, v in state["batch_dict"].items():
        a = _tensor(v, f"{path.name} key {k!r}")
        if a is not None:
            arrays[str(k)] = a
    meta = state.get("metadata") or {}
    return arrays, meta if isinstance(meta, dict) else {}


def step_files(src: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(global step, file)`` of one dump file, or of every one in ``dumped_data/`` (``src`` or beneath it)."""
    p = Path(src)
    if p.is_file():
        m = _FILE.match(p.name)
        if not m:
            raise ImportFormatError(f"{str(p)!r} is not named global_step_<N>_training_input.pkl")
        return [(int(m.group(1)), p)]
    if not p.is_dir():
        raise ImportFormatError(f"{str(p)!r} is neither a SkyRL dump file nor a folder")
    d = p / "dumped_data" if (p / "dumped_data").is_dir() else p
    out = sorted((int(m.group(1)), f) for f in d.iterdir() if (m := _FILE.match(f.name)) and f.is_file())
    if not out:
        raise ImportFormatError(f"no global_step_<N>_training_input.pkl in {str(d)!r} (SkyRL writes them to "
                                "{export_path}/dumped_data/ with trainer.dump_data_batch=true)")
    return out


def detect(path: Path) -> str | None:
    """Why ``path`` looks like a SkyRL export (``dumped_data/global_step_<N>_training_input.pkl``), else None."""
    p = Path(path)
    if p.is_file():
        return f"{p.name} is a SkyRL dump_data_batch file" if _FILE.match(p.name) else None
    if not p.is_dir():
        return None
    d = p / "dumped_data" if (p / "dumped_data").is_dir() else p
    names = sorted(f.name for f in d.iterdir() if _FILE.match(f.name))
    return f"{len(names)} global_step_<N>_training_input.pkl in {d.name}/ ({names[0]}, ...)" if names else None


def _captured(routes: np.ndarray, real: np.ndarray, pad_mask: np.ndarray | None, where: str) -> np.ndarray:
    """The captured route rows of one sample, from its first real position (never a padded row)."""
    seq_rows = routes[real]
    if pad_mask is not None:
        cap = ~pad_mask.astype(bool)
        if (cap & ~real).any():
            raise ImportFormatError(f"{where}: router_padding_mask marks a left-padding position as captured")
        c = int(cap.sum())
        if not cap[real][:c].all():
            raise ImportFormatError(f"{where}: the captured rows (router_padding_mask False) are not a prefix of "
                                    "the sequence")
        return seq_rows[:c]
    nonzero = np.flatnonzero(seq_rows.reshape(len(seq_rows), -1).any(axis=1))
    return seq_rows[: int(nonzero[-1]) + 1] if nonzero.size else seq_rows[:0]


def _response(arrays: dict[str, np.ndarray], key: str, i: int, resp: np.ndarray, dtype: Any) -> np.ndarray | None:
    """Sample ``i``'s values of a response-level tensor at its response columns (None when the dump lacks it)."""
    v = arrays.get(key)
    return None if v is None else np.asarray(v[i][resp], dtype=dtype)


def iter_samples(files: Sequence[tuple[int, Path]], stats: dict[str, Any] | None = None) -> Iterator[Sample]:
    """Every real (not DP-pad) sample of the dumps, one file in memory at a time."""
    stats = {} if stats is None else stats
    for step, f in files:
        a, meta = load_batch(f)
        for key in ("sequences", "attention_mask", "response_mask"):
            if key not in a:
                raise ImportFormatError(f"{f.name}: no {key!r} (keys {sorted(a)}); is this a SkyRL training input?")
        seqs, am, rm = a["sequences"], a["attention_mask"], a["response_mask"]
        B = seqs.shape[0]
        pad = int(meta.get("pad_size", 0) or 0)
        if not 0 <= pad < B:
            raise ImportFormatError(f"{f.name}: metadata pad_size {pad} for a batch of {B}")
        stats["pad_rows_dropped"] = stats.get("pad_rows_dropped", 0) + pad
        routes, rpm = a.get("rollout_expert_indices"), a.get("router_padding_mask")
        for i in range(B - pad):
            where = f"{f.name} sample {i}"
            real = am[i] != 0
            tok = seqs[i][real]
            resp = rm[i] != 0
            R = int(resp.sum())
            if R < 1 or len(tok) - R < 1:
                raise ImportFormatError(f"{where}: {len(tok)} real tokens with {R} response tokens")

            r = None
            if routes is not None:
                cap = _captured(routes[i], real, None if rpm is None else rpm[i], where)
                want = len(tok) - 1
                if len(cap) >= want:
                    r = cap[:want]
                elif len(cap):
                    r = cap  # short capture: write_run records the row count and leaves the routes out
                    stats["short_capture"] = stats.get("short_capture", 0) + 1
            yield Sample(step=step, tokens=tok.astype(np.int64), response_length=R,
                         logp_infer=_response(a, "rollout_logprobs", i, resp, np.float64),
                         logp_train=_response(a, "action_log_probs", i, resp, np.float64),
                         loss_mask=_response(a, "loss_mask", i, resp, np.int8),
                         advantage=_response(a, "advantages", i, resp, np.float64),
                         routes=r, prefix_capture=rpm is not None, where=where)
        del a


def import_skyrl(src: str | os.PathLike, out: str | os.PathLike, *, config: str | os.PathLike | None = None) -> Path:
    """Import SkyRL ``dump_data_batch`` pickles (``export_path``, ``dumped_data/`` or one file) into ``out``."""
    files = step_files(src)
    lmap = LayerMap.from_config(config) if config is not None else None
    return write_run(iter_samples(files), out, source_format=FORMAT, files=[f for _, f in files], layer_map=lmap,
                     extra={"config_json": None if config is None else str(config)})
