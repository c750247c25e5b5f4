"""SkyRL ``trainer.dump_data_batch`` pickles into r3lab runs, with routes.

Read from SkyRL's source (NovaSky-AI/SkyRL): ``main`` at commit ``a9564572`` (2026-08-21), and the pull requests
merged on 2026-09-18 as #2235, #2236 and #2238, which reopen #2080, #2081 and #2083 with their commits unchanged;
read at those pull requests' heads ``c1e71a0b`` (#2080), ``0caad2f2`` (#2081) and ``ec57e6f4`` (#2083).

* ``skyrl/train/trainer.py`` ``dump_data`` writes ``{export_path}/dumped_data/{file_name}.pkl`` with
  ``file_name = f"global_step_{N}_training_input"`` (``fully_async_trainer.py`` the same) through
  ``TensorBatch.save`` (``pickle.dump(self, f)``, the default protocol: 4 before Python 3.14, 5 from it). It runs
  after advantages are computed and after ``training_input.pop("rewards")``: **the dump has no rewards**, only
  ``advantages``/``returns``. ``dumped_evals/`` beside it is not read.
* ``skyrl/backends/skyrl_train/training_batch.py`` ``TensorBatch.__reduce__`` is ``(_rebuild_tensor_batch,
  (type(self), self.__getstate__()))`` (since #1379, 2026-03-24), state ``{"batch_dict": {key: serialized field |
  None}, "batch_size", "device": torch.device, "metadata": dict}``. Before #1379 the batch (a ``dict`` subclass)
  pickled by default: ``NEWOBJ(TrainingInputBatch)`` and its items through torch's storage pickling
  (``torch._utils._rebuild_tensor_v2``); such dumps are refused, named (layout ``dict-pickle``), as are those of the
  ``skyrl_train`` package (before the 2026-02 move into ``skyrl``, #1148, and so before #1379).
* ``_serialize_tensor``: ``{"format": "numpy", "data": bytes, "shape", "dtype": str}``, ``{"format": "torch",
  "data": torch.save bytes}`` (bfloat16; read with ``weights_only=True``), ``{"format": "tensor_list", "items"}``
  (pixel values: not read). Since #2235 every ``"format"`` is a member of ``class TensorFormat(StrEnum)`` (``numpy``,
  ``numpy_view``, ``torch``, ``tensor_list``, ``packed_tensor``), which pickles as ``REDUCE(TensorFormat,
  ("packed_tensor",))`` (``Enum.__reduce_ex__``): the global ``skyrl.backends.skyrl_train.training_batch.TensorFormat``
  is allowed here and mapped to a stand-in that returns the plain name (a name it does not know is a newer layout).
  ``TensorBatch.__getstate__`` writes a ``PackedTensor`` as ``{"format": "packed_tensor", "values": ...,
  "cu_seqlens": {"format": "numpy", int32 [B + 1]}}``; since #2236 the fields in ``ZERO_COPY_KEYS``
  (``rollout_expert_indices``, and #2238's ``rollout_sample_support``) serialize as ``{"format": "numpy_view",
  "data": the numpy array itself}`` (out of band under Ray; in a file the array pickles in-band: numpy's
  ``_reconstruct`` + ``BUILD`` under protocol 4, ``numpy._core.numeric._frombuffer`` under protocol 5, both rebuilt
  here from raw bytes by :mod:`r3lab.importers.unpickle`'s stand-ins). Any other global under ``skyrl.`` is a
  newer layout (:class:`~r3lab.errors.UnknownLayoutError`); globals outside SkyRL, torch.device and numpy's array
  reconstructors are refused as unsafe.
* ``skyrl/backends/skyrl_train/utils/packed_tensor.py`` ``PackedTensor``: ``values [sum(segment lengths), ...]`` and
  ``cu_seqlens`` (int32, runs from 0 to the row count, one offset per segment boundary).
  ``skyrl/train/dataset/preprocess.py`` ``_collate_rollout_expert_indices``: segment ``i`` of
  ``rollout_expert_indices`` holds ``P_i + R_i`` rows (every real token), the captured rows first, then
  ``replay_padding_row`` (``[0..K-1]`` in every layer) for the uncaptured suffix (``utils/replay_utils.py``);
  ``router_padding_mask`` stays dense ``[B, S]`` (``make_router_padding_mask``: True on left padding and on positions
  past the captured length). ``skyrl/train/generators/skyrl_gym_generator.py``: the batched path hands vLLM's
  ``P + R - 1`` rows (the mask marks them); the agent loop's ``RoutedExpertTrace.finalize``
  (``skyrl/backends/skyrl_train/utils/routed_experts.py``) pads the trace itself to ``P + R`` rows with the same dummy
  rows, so the mask counts them as captured: here a trailing run of exact dummy rows inside the mask's prefix is read
  as uncaptured too (top-k >= 2, where a real row holds distinct ids in every layer and ``[0..K-1]`` in all of them is
  no plausible capture). ``rollout_sample_support`` (SkyRL #2238) is the sampler's bounded support per response token
  (top-k vocabulary ids, ``-1`` padded, int32 ``[sum(R_i), top_k]``): r3lab has no place for it and ignores it by
  name.
* ``training_batch.py`` ``pad_training_input_batch`` appends ``metadata["pad_size"]`` DP pad rows at the end (copies
  of row 0, ``loss_mask`` zero, ``router_padding_mask`` all True); packed fields get one segment per pad row, as long
  as segment 0, of dummy rows (``append_packed_replay_padding``; SkyRL #2238: ``append_packed_field_padding``).
  Dropped.
* ``preprocess.py`` ``convert_prompts_responses_to_batch_tensors`` (layout since SkyRL #1285, 2026-03-20):
  ``sequences``/``attention_mask`` ``[B, S]`` left-padded (``S = max(P_i + R_i)``), response tensors ``[B, max R]``
  right-aligned with ``response_mask`` 1 on the last ``R_i`` columns (``loss_mask``, ``rollout_logprobs`` engine
  log-probs, ``action_log_probs`` trainer log-probs, ``advantages``). Tokens are read where ``attention_mask`` is 1
  and response values where ``response_mask`` is 1, so the layout before SkyRL #1285 (response right-padded) reads
  the same.
* Dense routes (before SkyRL #2235) ``rollout_expert_indices`` ``[B, S, layers, topk]`` (uint8/int16/int32,
  ``compact_routed_expert_indices``) hold the engine's captured rows from the sequence's first real position; since
  #1908 (2026-07-29) ``router_padding_mask`` is True on left padding and on the uncaptured suffix, which holds dummy
  rows ``[0..k-1]``. Before SkyRL #1908 (read at ``68326807a~1``) the suffix was zero-filled and no mask was written:
  there the captured prefix ends at the last row that is not all zero (exact for top-k >= 2).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3lab._extras import importing
from r3lab.errors import ImportFormatError, UnsafeFileError
from r3lab.importers.common import LayerMap, Sample, write_run
from r3lab.importers.layouts import Layout, LayoutsSeen, unknown_layout
from r3lab.importers.unpickle import (
    NUMPY_GLOBALS,
    NUMPY_PROTOCOL5_GLOBALS,
    Rebuilder,
    numeric_dtype,
    resolve,
    restricted_load,
)

__all__ = ["import_skyrl", "step_files", "iter_samples", "load_batch", "detect", "OPTIONS", "FORMAT", "LAYOUTS",
           "REBUILD", "BATCH_CLASS", "TENSOR_FORMAT", "Packed"]

FORMAT = "skyrl"
OPTIONS: dict[str, str] = {
    "config": "the model's config.json (or its folder): maps the routes' layer axis to global layer ids",
}
MODULE = "skyrl.backends.skyrl_train.training_batch"
REBUILD = (MODULE, "_rebuild_tensor_batch")
BATCH_CLASS = (MODULE, "TrainingInputBatch")
TENSOR_FORMAT = (MODULE, "TensorFormat")
_FILE = re.compile(r"^global_step_(\d+)_training_input\.pkl$")
WRITER = "SkyRL's dump_data_batch"
KIND = "SkyRL dump_data_batch"

LAYOUTS: tuple[Layout, ...] = (
    Layout("dict-pickle",
           "NovaSky-AI/SkyRL@c7348d07~1 skyrl/backends/skyrl_train/training_batch.py (before #1379: TensorBatch, a "
           "dict subclass, pickled by default)",
           "NEWOBJ(TrainingInputBatch), its tensors through torch's storage pickling (torch._utils._rebuild_tensor_v2)",
           "refused, named: loading it would call torch's reconstructors"),
    Layout("tensorbatch-2026-03",
           "NovaSky-AI/SkyRL@68326807~1 skyrl/backends/skyrl_train/training_batch.py TensorBatch.__reduce__, "
           "skyrl/train/dataset/preprocess.py (#1379 to #1908)",
           "_rebuild_tensor_batch + state dict, 'format' plain strings, dense rollout_expert_indices "
           "[B, S, layers, top_k] zero-filled past the capture, no router_padding_mask key",
           "routes, engine & trainer log-probs, advantages (no rewards: popped before the dump)"),
    Layout("tensorbatch-2026-07",
           "NovaSky-AI/SkyRL@a9564572 skyrl/backends/skyrl_train/training_batch.py, skyrl/train/dataset/"
           "preprocess.py make_router_padding_mask (#1908 to #2235)",
           "as tensorbatch-2026-03 with a router_padding_mask key ([B, S], True past the capture)",
           "routes, engine & trainer log-probs, advantages (no rewards)"),
    Layout("packed-2026-09",
           "NovaSky-AI/SkyRL@0caad2f2 (head of #2081, merged unchanged as #2236) and @ec57e6f4 (#2083 = #2238) "
           "skyrl/backends/skyrl_train/training_batch.py TensorFormat, skyrl/backends/skyrl_train/utils/"
           "packed_tensor.py PackedTensor, skyrl/train/dataset/preprocess.py (#2235/#2236/#2238, merged 2026-09-18)",
           "'format' values pickled as TensorFormat members; rollout_expert_indices a packed_tensor (values "
           "[sum(P_i+R_i), layers, top_k], numpy_view since #2236; int32 cu_seqlens [B+1])",
           "routes (each segment's captured prefix), engine & trainer log-probs, advantages (no rewards); "
           "rollout_sample_support (#2238) not read"),
)

_FORMATS = frozenset({"numpy", "numpy_view", "torch", "tensor_list", "packed_tensor"})  # TensorFormat's members
_PACKED_KEYS = frozenset({"rollout_expert_indices"})  # packed fields r3lab reads
_IGNORED = {"rollout_sample_support": "the sampler's bounded support per response token (#2238): no place in r3lab",
            "pixel_values": "images", "image_grid_thw": "images"}
_OWN = frozenset({"skyrl", "skyrl_train"})  # SkyRL's packages (skyrl_train before the 2026-02 move into skyrl, #1148)
_PRE1379_GLOBALS = frozenset({("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"),
                              ("torch._utils", "_rebuild_tensor")})


@dataclass(frozen=True)
class Packed:
    """A ``PackedTensor`` field: ``values [rows, ...]`` and ``cu_seqlens [segments + 1]`` (checked)."""

    values: np.ndarray
    cu_seqlens: np.ndarray

    def __len__(self) -> int:
        return len(self.cu_seqlens) - 1

    def segment(self, i: int) -> np.ndarray:
        return self.values[int(self.cu_seqlens[i]):int(self.cu_seqlens[i + 1])]


def _pre1379(path: str, what: str) -> UnsafeFileError:
    return UnsafeFileError(
        f"{path!r} is a SkyRL dump from before #1379 (2026-03-24; layout 'dict-pickle': {what}): TrainingInputBatch "
        "pickled as a plain dict subclass, its tensors through torch's storage pickling. r3lab does not read this "
        "layout (an older writer, not an attack): loading it would call torch's reconstructors and torch.load's full "
        "unpickler. Re-dump with SkyRL at or after #1379, which writes numpy bytes r3lab reads without running code")


class _Globals(dict):
    """The allowed globals; an unknown ``skyrl.*`` global is a newer layout, the pre-#1379 torch ones are named."""

    def __init__(self, table: dict[tuple[str, str], Any], path: str):
        super().__init__(table)
        self.path = path

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        return isinstance(key, tuple) and (key in _PRE1379_GLOBALS or str(key[0]).split(".")[0] in _OWN)

    def __missing__(self, key: tuple[str, str]) -> Any:
        if key in _PRE1379_GLOBALS or str(key[0]).split(".")[0] == "skyrl_train":
            raise _pre1379(self.path, f"it names {key[0]}.{key[1]}")
        raise unknown_layout(KIND, repr(self.path), f"it names the global {key[0]}.{key[1]}, which no SkyRL layout "
                             "this r3lab reads contains", LAYOUTS)


def _allowed(path: str, flags: dict[str, bool] | None = None) -> dict[tuple[str, str], Any]:
    """The globals SkyRL's writer records, each mapped to an inert stand-in for the file ``path``."""
    flags = {} if flags is None else flags

    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:  # NEWOBJ with no arguments: copyreg.__newobj__, the default dict-subclass pickle
            raise _pre1379(path, "NEWOBJ on TrainingInputBatch")
        raise UnsafeFileError(f"{path!r} calls {MODULE}.TrainingInputBatch with arguments; its writer never does "
                              "that, so r3lab refuses the file")

    batch_cls = type("TrainingInputBatch", (), {"__new__": new, "__module__": __name__,
                                                "__doc__": "stand-in: refuses to be built"})

    def rebuild(where: str, args: tuple[Any, ...]) -> dict[str, Any]:
        if len(args) != 2 or args[0] is not batch_cls or not isinstance(args[1], dict):
            raise UnsafeFileError(f"{where} called with arguments its writer never passes (expected "
                                  "TrainingInputBatch and a state dict)")
        return args[1]

    def device(where: str, args: tuple[Any, ...]) -> str:
        if not 1 <= len(args) <= 2 or not isinstance(args[0], str) or not all(isinstance(x, int) for x in args[1:]):
            raise UnsafeFileError(f"{where} called with {args!r}")
        return ":".join(str(a) for a in args)

    def tensor_format(where: str, args: tuple[Any, ...]) -> str:
        if len(args) != 1 or not isinstance(args[0], str):
            raise UnsafeFileError(f"{where} called with {args!r}; its writer passes one member value (a str)")
        if args[0] not in _FORMATS:
            raise unknown_layout(KIND, repr(path), f"a field's format is TensorFormat({args[0]!r}), a member this "
                                 f"r3lab does not know (it knows {sorted(_FORMATS)})", LAYOUTS)
        flags["tensor_format"] = True
        return str(args[0])

    table: dict[tuple[str, str], Any] = {
        REBUILD: Rebuilder(".".join(REBUILD), path, rebuild), BATCH_CLASS: batch_cls,
        TENSOR_FORMAT: Rebuilder(".".join(TENSOR_FORMAT), path, tensor_format),
        ("torch", "device"): Rebuilder("torch.device", path, device),
        **NUMPY_GLOBALS(path), **NUMPY_PROTOCOL5_GLOBALS(path)}
    return _Globals(table, path)


def _format(v: dict, where: str, path: Path) -> str:
    fmt = v.get("format", "numpy")  # no "format" key: SkyRL's legacy numpy layout
    if not isinstance(fmt, str):
        raise ImportFormatError(f"{where}: format {fmt!r} is not a name")
    if fmt not in _FORMATS:
        raise unknown_layout(KIND, repr(str(path)), f"{where} has the tensor format {fmt!r}, which this r3lab does "
                             f"not know (it knows {sorted(_FORMATS)})", LAYOUTS)
    return fmt


def _tensor(v: Any, where: str, path: Path) -> np.ndarray | Packed | None:
    """One ``_serialize_tensor`` entry as a numpy array (numeric dtypes only; bfloat16 via torch's safe loader)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ImportFormatError(f"{where} is {type(v).__name__}, not a serialized tensor dict")
    fmt = _format(v, where, path)
    if fmt == "numpy":
        data, shape = v.get("data"), v.get("shape")
        if not isinstance(data, bytes) or not isinstance(shape, tuple):
            raise ImportFormatError(f"{where}: a numpy tensor without bytes 'data' and a 'shape' tuple")
        dt = numeric_dtype(v.get("dtype"), where)
        if len(data) % dt.itemsize:
            raise ImportFormatError(f"{where}: {len(data)} bytes are no whole number of {dt} values")
        arr = np.frombuffer(data, dtype=dt)
        if arr.size != int(np.prod(shape)):
            raise ImportFormatError(f"{where}: {arr.size} values for shape {shape}")
        return arr.reshape(shape)
    if fmt == "numpy_view":
        arr = resolve(v.get("data"))
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
            raise ImportFormatError(f"{where}: a numpy_view whose data is "
                                    f"{getattr(arr, 'dtype', type(arr).__name__)}, not a numeric array")
        return arr
    if fmt == "torch":
        with importing("torch", for_=f"{where}: reading torch.save bytes"):
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
    values = _tensor(v.get("values"), f"{where} values", path)
    cu = _tensor(v.get("cu_seqlens"), f"{where} cu_seqlens", path)
    if not isinstance(values, np.ndarray) or not isinstance(cu, np.ndarray):
        raise ImportFormatError(f"{where}: a packed_tensor needs dense 'values' and 'cu_seqlens'")
    if values.ndim < 1:
        raise ImportFormatError(f"{where}: packed values of shape {values.shape} have no row axis")
    if cu.ndim != 1 or len(cu) < 2 or cu.dtype.kind not in "iu":
        raise ImportFormatError(f"{where}: cu_seqlens of shape {cu.shape} and dtype {cu.dtype} (SkyRL writes int32 "
                                "[segments + 1])")
    c = cu.astype(np.int64)
    if c[0] != 0 or c[-1] != values.shape[0]:
        raise ImportFormatError(f"{where}: cu_seqlens runs from {c[0]} to {c[-1]}, not from 0 to the "
                                f"{values.shape[0]} packed rows")
    if (np.diff(c) < 0).any():
        j = int(np.flatnonzero(np.diff(c) < 0)[0])
        raise ImportFormatError(f"{where}: cu_seqlens is not monotone ({c[j]} then {c[j + 1]} at offsets {j}, "
                                f"{j + 1})")
    return Packed(values, c)


def _load(path: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    """``(arrays by key, metadata, layout name)`` of one dump file, loaded without running code."""
    flags: dict[str, bool] = {}
    state = restricted_load(path, _allowed(str(path), flags), WRITER)
    if not isinstance(state, dict) or not isinstance(state.get("batch_dict"), dict):
        raise ImportFormatError(f"{str(path)!r} is not a SkyRL TrainingInputBatch pickle (no batch_dict state)")
    arrays: dict[str, Any] = {}
    for k, v in state["batch_dict"].items():
        if k in _IGNORED:
            continue
        a = _tensor(v, f"{path.name} key {k!r}", path)
        if isinstance(a, Packed) and k not in _PACKED_KEYS:
            raise unknown_layout(KIND, repr(str(path)), f"key {k!r} is a packed_tensor; this r3lab reads packed "
                                 f"fields only for {sorted(_PACKED_KEYS)}", LAYOUTS)
        if a is not None:
            arrays[str(k)] = a
    meta = state.get("metadata") or {}
    if flags.get("tensor_format") or isinstance(arrays.get("rollout_expert_indices"), Packed):
        layout = "packed-2026-09"
    elif "router_padding_mask" in arrays or ("router_padding_mask" in state["batch_dict"]
                                             and "rollout_expert_indices" not in arrays):
        layout = "tensorbatch-2026-07"  # since SkyRL #1908 a batch with routes has the mask; without, the key (None)
    else:
        layout = "tensorbatch-2026-03"
    return arrays, meta if isinstance(meta, dict) else {}, layout


def load_batch(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(arrays by key, metadata)`` of one ``global_step_N_training_input.pkl``, loaded without running code; a
    packed field is a :class:`Packed`."""
    arrays, meta, _ = _load(Path(path))
    return arrays, meta


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
        return seq_rows[:_mask_prefix(pad_mask, real, where)]
    nonzero = np.flatnonzero(seq_rows.reshape(len(seq_rows), -1).any(axis=1))
    return seq_rows[: int(nonzero[-1]) + 1] if nonzero.size else seq_rows[:0]


def _mask_prefix(pad_mask: np.ndarray, real: np.ndarray, where: str) -> int:
    """How many real positions ``router_padding_mask`` marks captured (False); they must be a prefix."""
    cap = ~pad_mask.astype(bool)
    if (cap & ~real).any():
        raise ImportFormatError(f"{where}: router_padding_mask marks a left-padding position as captured")
    c = int(cap.sum())
    if not cap[real][:c].all():
        raise ImportFormatError(f"{where}: the captured rows (router_padding_mask False) are not a prefix of "
                                "the sequence")
    return c


def _without_dummy_tail(rows: np.ndarray) -> np.ndarray:
    """``rows`` less its trailing run of SkyRL's dummy rows (``[0..K-1]`` in every layer; top-k >= 2 only)."""
    k = rows.shape[-1] if rows.ndim == 3 else 0
    if k < 2 or not len(rows):
        return rows
    dummy = (rows == np.arange(k, dtype=rows.dtype)).all(axis=(1, 2))
    real = np.flatnonzero(~dummy)
    return rows[: int(real[-1]) + 1] if real.size else rows[:0]


def _response(arrays: dict[str, Any], key: str, i: int, resp: np.ndarray, dtype: Any) -> np.ndarray | None:
    """Sample ``i``'s values of a response-level tensor at its response columns (None when the dump lacks it)."""
    v = arrays.get(key)
    if v is not None and not isinstance(v, np.ndarray):
        raise ImportFormatError(f"key {key!r} is {type(v).__name__}, not a [batch, response] tensor")
    return None if v is None else np.asarray(v[i][resp], dtype=dtype)


def iter_samples(files: Sequence[tuple[int, Path]], stats: dict[str, Any] | None = None,
                 seen: LayoutsSeen | None = None) -> Iterator[Sample]:
    """Every real (not DP-pad) sample of the dumps, one file in memory at a time. Every file has routes, or none
    does (a run without R3: ``enable_return_routed_experts`` off); its samples are then marked ``routes_absent``."""
    stats = {} if stats is None else stats
    with_routes: bool | None = None  # what the first file had
    for step, f in files:
        a, meta, layout = _load(f)
        if seen is not None:
            seen.add(layout)
        for key in ("sequences", "attention_mask", "response_mask"):
            if key not in a:
                raise ImportFormatError(f"{f.name}: no {key!r} (keys {sorted(a)}); is this a SkyRL training input?")
            if not isinstance(a[key], np.ndarray) or a[key].ndim != 2:
                raise ImportFormatError(f"{f.name}: {key!r} is not a [batch, positions] tensor")
        seqs, am, rm = a["sequences"], a["attention_mask"], a["response_mask"]
        B = seqs.shape[0]
        pad = int(meta.get("pad_size", 0) or 0)
        if not 0 <= pad < B:
            raise ImportFormatError(f"{f.name}: metadata pad_size {pad} for a batch of {B}")
        stats["pad_rows_dropped"] = stats.get("pad_rows_dropped", 0) + pad
        routes, rpm = a.get("rollout_expert_indices"), a.get("router_padding_mask")
        if with_routes is None:
            with_routes = routes is not None
        elif (routes is not None) != with_routes:
            raise ImportFormatError(f"{f.name} {'has' if routes is not None else 'has no'} rollout_expert_indices "
                                    f"where {files[0][1].name} {'has none' if routes is not None else 'has them'}; "
                                    "SkyRL writes routes for every step or none (import the steps apart)")
        if isinstance(routes, Packed):
            if len(routes) != B:
                raise ImportFormatError(f"{f.name}: rollout_expert_indices has {len(routes)} packed segments for a "
                                        f"batch of {B} (cu_seqlens must hold batch + 1 offsets)")
            if routes.values.ndim != 3 or routes.values.dtype.kind not in "iu":
                raise ImportFormatError(f"{f.name}: packed rollout_expert_indices values of shape "
                                        f"{routes.values.shape} and dtype {routes.values.dtype} (SkyRL writes "
                                        "integer [rows, layers, top_k])")
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
                if isinstance(routes, Packed):
                    seg = routes.segment(i)
                    if len(seg) != len(tok):
                        raise ImportFormatError(f"{where}: its packed route segment holds {len(seg)} rows for "
                                                f"{len(tok)} real tokens (SkyRL packs one row per real token)")
                    cap = seg if rpm is None else seg[:_mask_prefix(rpm[i], real, where)]
                    cap = _without_dummy_tail(cap)
                else:
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
                         routes=r, prefix_capture=rpm is not None or isinstance(routes, Packed),
                         routes_absent=routes is None, where=where)
        del a


def import_skyrl(src: str | os.PathLike, out: str | os.PathLike, *, config: str | os.PathLike | None = None) -> Path:
    """Import SkyRL ``dump_data_batch`` pickles (``export_path``, ``dumped_data/`` or one file) into ``out``.

    A run without R3 (no ``rollout_expert_indices`` in any step) imports without routes; with ``config`` its model
    is recorded all the same."""
    files = step_files(src)
    lmap = LayerMap.from_config(config) if config is not None else None
    seen = LayoutsSeen(LAYOUTS)
    return write_run(iter_samples(files, seen=seen), out, source_format=FORMAT, files=[f for _, f in files],
                     layer_map=lmap, extra={"config_json": None if config is None else str(config)}, layouts=seen)
