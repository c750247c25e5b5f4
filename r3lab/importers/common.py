"""What every importer shares: loading files without running code, the model's layer map, and the run writer.

Safety: nothing an importer reads may run code. ``.pt`` files go through ``torch.load(weights_only=True)``
(PyTorch's restricted unpickler: tensors, containers and plain scalars only); where a framework stores numpy
arrays (Miles) the numpy reconstructors are allowed explicitly (:data:`NUMPY_ALLOWLIST`), nothing else. A file
that needs any other class is refused with :class:`UnsafeFileError`, which says why and what to do. Plain pickles
(``.pkl`` and the like) are refused by suffix before they are opened, except SkyRL's and verl's dumps, which their
importers read with :mod:`r3lab.importers.unpickle` (only the globals each writer records, as inert stand-ins).

Row convention: a sample of ``P`` prompt and ``R`` response tokens carries ``P + R - 1`` route rows, row ``t``
routing the input at position ``t`` (``len(tokens) - 1`` rows in slime/Miles' ``rollout_routed_experts``;
the same convention as r3lab's engine routes, ``r3lab.metrics.response_rows``). Every sample is checked;
one that breaks it keeps its tokens and log-probs, its routes are left out, and the break is recorded in the
run's config (``capture``) for ``r3lab doctor``.

Layer axis: engines return rows for every decoder layer, dense ones too (verl #5037, vLLM #33013); others
return MoE layers only. :class:`LayerMap` maps a dump's layer axis to global layer ids with the model's
``config.json`` (``r3lab.moe_layout``) and refuses an axis that matches neither.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab._extras import importing
from r3lab.errors import ImportFormatError, UnsafeFileError
from r3lab.moe_layout import MoELayout
from r3lab.routes import SENTINEL, Routes
from r3lab.runs import IMPORT_KIND, RunWriter
from r3lab.vocabulary import CAPTURE_LOG_KEY, RLMetric

__all__ = [
    "NUMPY_ALLOWLIST", "refuse_pickles", "read_jsonl", "file_sha256", "file_hashes", "Sample", "CaptureLog",
    "write_run", "mtp_layer_count", "MTP_CONFIG_KEYS", "jsonl_samples", "layout_config", "FLOAT_COLUMNS",
]

REFUSED_SUFFIXES = {".pkl": "a Python pickle", ".pickle": "a Python pickle", ".dill": "a dill pickle",
                    ".joblib": "a joblib pickle"}
_TOKEN_CHUNK = 4096  # samples per parquet row group: what an import holds of a step's token columns at once


def _numpy_allowlist() -> list[Any]:
    import numpy.dtypes as npd

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    kinds = ("Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64", "Float16",
             "Float32", "Float64")
    return [_reconstruct, np.ndarray, np.dtype, *(getattr(npd, f"{k}DType") for k in kinds)]


NUMPY_ALLOWLIST = _numpy_allowlist()
"""The only globals a Miles dump may name beyond torch's own: numpy's array reconstructor, ndarray, dtype and the
plain numeric dtype classes (no object arrays: ``numpy.dtypes.ObjectDType`` is not on the list)."""


def refuse_pickles(path: Path) -> None:
    """Refuse plain pickles by suffix: they execute code when loaded (SkyRL/verl dumps have their own importers)."""
    what = REFUSED_SUFFIXES.get(path.suffix.lower())
    if what:
        raise UnsafeFileError(
            f"{str(path)!r} is {what}; loading it would execute whatever code it names, so r3lab does not open it "
            "as a torch file. SkyRL's dump_data_batch pickles and verl's gen_batch.dp are read by `r3lab import "
            "skyrl` / `r3lab import verl` (a restricted unpickler); for anything else, re-export the run with the "
            "framework's JSON/JSONL option (or torch.save of plain tensors, lists and dicts) and import that.")


def safe_torch_load(path: str | os.PathLike, *, numpy_arrays: bool = False) -> Any:
    """``torch.load(weights_only=True)``: tensors, containers and scalars only (plus numpy arrays if asked)."""
    with importing("torch", for_=f"reading the torch file {str(path)!r}"):
        import torch

    p = Path(path)
    refuse_pickles(p)
    if not p.is_file():
        raise ImportFormatError(f"{str(p)!r} does not exist")
    allow = NUMPY_ALLOWLIST if numpy_arrays else []
    try:
        with torch.serialization.safe_globals(allow):
            return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:300]
        raise UnsafeFileError(
            f"{str(p)!r} needs more than tensors, lists, dicts{' and numpy arrays' if numpy_arrays else ''} to "
            f"load ({first}); loading it fully could run code, so r3lab refuses. Re-export it with the "
            "framework's JSON option, or save only tensors, lists, dicts and numbers (Sample.to_dict(), not "
            "Sample objects)") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ImportFormatError(f"{str(p)!r} is not a readable torch file: {e}") from e


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-empty line, one at a time (a large file never sits in memory)."""
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ImportFormatError(f"{str(path)!r} line {i} is not JSON: {e}") from e
            if not isinstance(obj, dict):
                raise ImportFormatError(f"{str(path)!r} line {i} is not a JSON object")
            yield i, obj


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class LayerMap:
    """The model's MoE layers (global ids) and how to read a dump's layer axis of a given size."""

    layout: MoELayout
    mtp_layers: int = 0  # multi-token-prediction layers after the decoder (config: num_nextn_predict_layers, ...)

    @classmethod
    def from_config(cls, path: str | os.PathLike) -> LayerMap:
        """From a model's ``config.json`` (or the folder holding it)."""
        p = Path(path)
        if p.is_dir():
            cfg_file = p / "config.json"
            mtp = mtp_layer_count(json.loads(cfg_file.read_text())) if cfg_file.is_file() else 0
            return cls(MoELayout.from_model_dir(p), mtp)
        if not p.is_file():
            raise ImportFormatError(f"model config {str(p)!r} does not exist (pass the model's config.json)")
        try:
            cfg = json.loads(p.read_text())
        except ValueError as e:
            raise ImportFormatError(f"model config {str(p)!r} is not JSON: {e}") from e
        return cls(MoELayout.from_config(cfg), mtp_layer_count(cfg))

    @property
    def mtp_ids(self) -> np.ndarray:
        """Ids given to MTP layers on a dump's layer axis: after the decoder's (``num_hidden_layers + i``)."""
        n = self.layout.num_hidden_layers
        return np.arange(n, n + self.mtp_layers, dtype=np.int64)

    @property
    def moe_ids(self) -> np.ndarray:
        return np.asarray(self.layout.moe_layer_ids, dtype=np.int64)

    def axis_ids(self, size: int, where: str) -> np.ndarray:
        """Global layer id of each entry of a dump's layer axis: every decoder layer, or the MoE layers only."""
        if size == self.layout.num_hidden_layers:
            return np.arange(size, dtype=np.int64)
        if size == len(self.layout.moe_layer_ids):
            return self.moe_ids
        if self.mtp_layers and size == self.layout.num_hidden_layers + self.mtp_layers:
            return np.concatenate([np.arange(self.layout.num_hidden_layers, dtype=np.int64), self.mtp_ids])
        if self.mtp_layers and size == len(self.layout.moe_layer_ids) + self.mtp_layers:
            return np.concatenate([self.moe_ids, self.mtp_ids])
        mtp = (f", nor those plus its {self.mtp_layers} MTP layers" if self.mtp_layers else
               "; if the dump holds MTP layers' rows too, the config declares none (num_nextn_predict_layers)")
        raise ImportFormatError(
            f"{where}: a layer axis of {size} matches neither the model's {self.layout.num_hidden_layers} decoder "
            f"layers nor its {len(self.layout.moe_layer_ids)} MoE layers ({self.layout.architecture}){mtp}; pass the "
            "config.json of the model that made this dump (--config)")


MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
"""Config keys that count a model's multi-token-prediction layers (DeepSeek-V3/GLM-4-MoE, Qwen3-Next, others)."""


def mtp_layer_count(cfg: Mapping[str, Any]) -> int:
    """How many MTP layers a model's config declares (0 when none); they are not decoder layers."""
    src = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), Mapping) else cfg
    for key in MTP_CONFIG_KEYS:
        v = src.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


@dataclass
class Sample:
    """One sample as an importer hands it over: everything per token is over the response (``R`` tokens)."""

    step: int
    tokens: np.ndarray  # all P + R token ids
    response_length: int
    logp_infer: np.ndarray | None = None  # engine log-prob of each response token
    logp_train: np.ndarray | None = None  # trainer log-prob of each response token
    loss_mask: np.ndarray | None = None
    routes: np.ndarray | None = None  # [rows, layer axis, top_k] as in the dump (signed: -1 marks an uncaptured row)
    weights: np.ndarray | None = None  # routing weights beside the ids, the same shape (float), when the dump has them
    reward: float | None = None
    advantage: np.ndarray | None = None
    index: int | None = None
    status: str | None = None
    speculative: bool = False
    prefix_capture: bool = False  # the dump itself marks rows past len(routes) as not captured (SkyRL, verl)
    routes_absent: bool = False  # the dump has no routes field at all (R3 was off): no capture to check, no failure
    where: str = ""  # file and sample number, for messages
    flags: tuple[str, ...] = ()  # what the importer noticed on this sample; counted per step and in the summary


def _worst(cur: dict[str, Any] | None, score: float, **where: Any) -> dict[str, Any]:
    return {"score": float(score), **where} if cur is None or score > cur["score"] else cur


@dataclass
class CaptureLog:
    """What the importer found on the raw routes that cannot be stored (doctor reads it from the run config)."""

    counts: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    worst: dict[str, dict[str, Any]] = field(default_factory=dict)
    # per global layer id: samples whose rows of that layer were read (seen) and looked like routing (real); arrays
    # indexed by layer id (one vector add per sample: a Python loop over the layers cost a 48-layer model's import
    # more than the rest of the check)
    _seen: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _real: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    max_id: int | None = None  # the largest expert id any row named (ids >= E: physical EPLB slots, vLLM #33013)

    def add(self, check: str, bad: int, rows: int, score: float = 0.0, **where: Any) -> None:
        self.counts[check] = self.counts.get(check, 0) + int(bad)
        self.rows[check] = self.rows.get(check, 0) + int(rows)
        if bad:
            self.worst[check] = _worst(self.worst.get(check), score if score else bad, **where)

    def add_layers(self, ids: np.ndarray, real: np.ndarray) -> None:
        """One sample's layers ``ids`` (global, distinct) were read; ``real[i]``: those of ``ids[i]`` look like
        routing."""
        if not ids.size:
            return
        need = int(ids.max()) + 1
        if need > self._seen.size:
            self._seen = np.concatenate([self._seen, np.zeros(need - self._seen.size, np.int64)])
            self._real = np.concatenate([self._real, np.zeros(need - self._real.size, np.int64)])
        self._seen[ids] += 1
        self._real[ids] += real

    @property
    def layer_seen(self) -> dict[int, int]:
        """Global layer id -> samples whose rows of that layer were read."""
        return {int(g): int(self._seen[g]) for g in np.flatnonzero(self._seen)}

    @property
    def layer_real(self) -> dict[int, int]:
        """Global layer id -> samples whose rows of that layer look like routing (every layer read is a key)."""
        return {int(g): int(self._real[g]) for g in np.flatnonzero(self._seen)}

    def to_dict(self) -> dict[str, Any]:
        return {"counts": self.counts, "rows": self.rows, "worst": self.worst,
                "layer_real": {str(k): v for k, v in self.layer_real.items()},
                "layer_seen": {str(k): v for k, v in self.layer_seen.items()}, "max_id": self.max_id}


@dataclass(frozen=True)
class _Axis:
    """What a dump's layer axis of one size means for the model (:func:`_axis`): computed once per size, not per
    sample."""

    ids: np.ndarray  # global layer id of each entry
    mtp: np.ndarray  # entries that are MTP layers (kept apart, never stored)
    moe: np.ndarray  # entries that are MoE layers (stored)
    dense: np.ndarray  # the rest: dense decoder layers
    counted: np.ndarray  # the entries whose layers the capture log counts (all but MTP)


@functools.lru_cache(maxsize=64)
def _axis(lmap: LayerMap, size: int) -> _Axis:
    ids = lmap.axis_ids(size, "")  # a size that fits nothing raises (not cached); the caller names the sample
    mtp = ids >= lmap.layout.num_hidden_layers
    moe = np.isin(ids, lmap.moe_ids)
    for a in (ids, mtp, moe):
        a.setflags(write=False)
    dense = ~moe & ~mtp
    counted = ~mtp
    dense.setflags(write=False)
    counted.setflags(write=False)
    return _Axis(ids, mtp, moe, dense, counted)


def _check_routes(s: Sample, sample_no: int, lmap: LayerMap, log: CaptureLog
                  ) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The sample's MoE-layer ``(ids, weights or None)`` if they pass every capture check, else None (logged).

    Rows marked uncaptured with :data:`SENTINEL` end the capture there: a sample whose first ``P + R - 1`` rows are
    not all captured keeps its tokens and log-probs, its routes are left out (``prefix_capture``), as with a dump
    that marks its captured prefix itself."""
    where = {"step": s.step, "sample": sample_no}
    if s.routes is None and s.routes_absent:
        return None
    if s.routes is None:
        log.add("missing_routes", 1, 1, **where)
        return None
    log.add("missing_routes", 0, 1)
    r = s.routes
    if r.ndim != 3:
        raise ImportFormatError(f"{s.where}: routes must be [rows, layers, top_k], got shape {r.shape}")
    if s.weights is not None and s.weights.shape != r.shape:
        raise ImportFormatError(f"{s.where}: routing weights of shape {s.weights.shape} beside ids of shape {r.shape}")
    want = len(s.tokens) - 1  # P + R - 1
    r, uncaptured = _strip_sentinel_rows(r)
    if uncaptured is not None:  # rows the producer marked -1 (tunix #2046, NeMo-RL #3113): never expert ids
        log.add("sentinel_rows", int(uncaptured), 1, **where)
        if r.shape[0] < want:
            log.add("prefix_capture", 1, 1, score=want - r.shape[0], route_rows=int(r.shape[0]), expected=want,
                    **where)
            return None
        r = r[:want]
    if s.prefix_capture and r.shape[0] < want:  # a gap the dump marks itself: told apart from a wrong row count
        log.add("prefix_capture", 1, 1, score=want - r.shape[0], route_rows=int(r.shape[0]), expected=want, **where)
        return None
    if r.shape[0] != want:
        log.add("row_count", 1, 1, score=abs(r.shape[0] - want), route_rows=int(r.shape[0]), expected=want, **where)
        if s.speculative:
            log.add("speculative_rows", 1, 1, route_rows=int(r.shape[0]), expected=want, **where)
        return None
    log.add("row_count", 0, 1)
    if s.speculative:
        log.add("speculative_rows", 0, 1)
    try:
        ax = _axis(lmap, r.shape[1])
    except ImportFormatError:
        lmap.axis_ids(r.shape[1], s.where)  # a layer axis that fits nothing: refused again, naming the sample
        raise
    ids, mtp, moe = ax.ids, ax.mtp, ax.moe
    if lmap.mtp_layers:  # samples whose MTP rows were set apart (the doctor reports them; they are not a failure)
        log.add("mtp_kept_apart", int(mtp.any()), 1, **where)
    r_max = int(r.max()) if r.size else None
    if r_max is not None:
        log.max_id = max(r_max, -1 if log.max_id is None else log.max_id)
    E = lmap.layout.num_experts
    n_oor = 0
    if r_max is not None and (int(r.min()) < 0 or r_max >= E):  # the boolean arrays only where some id is out
        oor_rows = ((r < 0) | (r >= E)).any(axis=2)
        n_oor = int(oor_rows.sum())
        t, j = np.argwhere(oor_rows)[0]
        bad = r[t, j][(r[t, j] < 0) | (r[t, j] >= E)]
        log.add("ids_out_of_range", n_oor, r.shape[0] * r.shape[1], position=int(t), layer=int(ids[j]),
                value=int(bad[0]), **where)
    else:
        log.add("ids_out_of_range", 0, r.shape[0] * r.shape[1])
    srt = np.sort(r, axis=2)
    repeated = (srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2)  # [rows, axis]
    constant = (srt == srt[:1]).all(axis=(0, 2)) if r.shape[0] > 1 else np.zeros(r.shape[1], bool)
    any_repeated = repeated.any(axis=0)  # [axis]
    log.add_layers(ids[ax.counted], (~constant & ~any_repeated)[ax.counted])
    rep_moe = repeated[:, moe]
    n_rep = int(rep_moe.sum())
    if n_rep:
        t, j = np.argwhere(rep_moe)[0]
        log.add("repeated_ids", n_rep, rep_moe.size, position=int(t), layer=int(ids[moe][j]), **where)
    else:
        log.add("repeated_ids", 0, rep_moe.size)
    const_moe = constant[moe]
    if const_moe.any():
        j = int(np.argmax(const_moe))
        log.add("constant_routes", int(const_moe.sum()), int(moe.sum()), layer=int(ids[moe][j]),
                value=srt[0, np.flatnonzero(moe)[j]].tolist(), **where)
    else:
        log.add("constant_routes", 0, int(moe.sum()))
    dense = ax.dense
    if dense.any():
        dense_real = dense & ~constant & ~any_repeated
        if dense_real.any():
            log.add("dense_rows", int(dense_real.sum()), int(dense.sum()), layer=int(ids[int(np.argmax(dense_real))]),
                    **where)
        else:
            log.add("dense_rows", 0, int(dense.sum()))
    if n_oor or n_rep or const_moe.any():
        return None
    if s.weights is None:
        return r[:, moe, :], None
    w = np.asarray(s.weights[: r.shape[0]], np.float32)[:, moe, :]
    if not np.isfinite(w).all():
        raise ImportFormatError(f"{s.where}: routing weights beside the ids are not all finite")
    return r[:, moe, :], w


def _strip_sentinel_rows(r: np.ndarray) -> tuple[np.ndarray, int | None]:
    """``(rows, count)``: with rows that are entirely :data:`SENTINEL` (uncaptured), the rows before the first of
    them and how many rows were marked; ``(r, None)`` when no row is marked. Never casts -1 into an expert id: a row
    with -1 in some slots only is left as it is (the range check refuses it)."""
    if r.dtype.kind != "i" or not r.size:
        return r, None
    marked = (r == SENTINEL).all(axis=(1, 2))
    if not marked.any():
        return r, None
    return r[: int(np.argmax(marked))], int(marked.sum())


def file_hashes(files: Sequence[Path]) -> dict[str, str]:
    """SHA-256 of each source file, keyed by its path relative to the folder all of them share (POSIX ``/``).

    A file name alone is not a key: prime-rl writes a ``rank_0.jsonl`` per step folder and verl a ``gen_batch.dp``
    per step, which collided (one hash kept). Files of one folder keep their names as keys, so a run whose
    ``config.source.files`` is keyed by file name reads the same."""
    paths = [Path(os.path.abspath(f)) for f in files]
    if not paths:
        return {}
    root = Path(os.path.commonpath([q.parent for q in paths]))
    return {q.relative_to(root).as_posix(): file_sha256(q) for q in paths}


def write_run(samples: Iterable[Sample], out: str | os.PathLike, *, source_format: str, files: Iterable[Path],
              layer_map: LayerMap | None, extra: Mapping[str, Any] | None = None,
              layouts: Iterable[str] | None = None,
              late_config: Callable[[], Mapping[str, Any]] | None = None) -> Path:
    """Stream samples (grouped by step, steps ascending) into an r3lab run folder ``out``; returns its path.

    ``layouts``: the names of the dump layouts the import met (:class:`r3lab.importers.layouts.LayoutsSeen`, filled
    while ``samples`` is consumed), recorded as ``config.source_layouts`` and in the summary. A sample's ``weights``
    (routing weights beside its ids) are stored with the routes (route container format 3) when every sample of
    the step that keeps routes has them; otherwise they are dropped and counted (``samples_weights_dropped``).

    All or nothing: the run is written under a temporary name beside ``out`` and renamed at the end
    (:class:`r3lab.runs.RunWriter` ``atomic=True``); a refused or failed import (Ctrl-C included) leaves nothing.

    Per step: ``tokens/step-N.parquet`` (one row per response token: ``sample``, ``position``, ``token``,
    ``prompt_length``, ``response_length``, ``logp_infer``, ``logp_train``, ``loss_mask``, ``reward``, ...
    as the source has them), ``routes/step-N.engine.r3`` when routes exist, and a ``steps.jsonl`` record with
    the mismatch metrics (``r3lab.metrics.mismatch_metrics``, ``mismatch/`` prefix) over loss-masked tokens.
    ``prompts/step-N.parquet`` keeps the prompt tokens (``sample``, ``position``, ``token``) so the source's token
    sequences come back whole (:func:`r3lab.importers.sample_tokens`). Memory: token columns are flushed every
    few thousand samples; a step's routes are held compactly (one byte
    per id for up to 256 experts) until the step is written.
    """
    files = [Path(f) for f in files]
    outp = Path(out)
    config = {"source": {"format": source_format, "files": file_hashes(files), "paths": [str(f) for f in files]},
              "row_convention": "P+R-1", **(dict(extra or {}))}
    if layer_map is not None:
        lay = layer_map.layout
        config["model"] = {"model_type": lay.model_type, "architecture": lay.architecture,
                           "num_hidden_layers": lay.num_hidden_layers, "moe_layer_ids": list(lay.moe_layer_ids),
                           "num_experts": lay.num_experts, "top_k": lay.top_k}
        if layer_map.mtp_layers:
            config["model"]["mtp_layers"] = layer_map.mtp_layers
    log = CaptureLog()
    writer = RunWriter(outp.parent, outp.name, IMPORT_KIND, config, atomic=True)
    totals = {"samples": 0, "tokens": 0, "steps": 0, "samples_without_routes": 0}
    with writer:
        step: int | None = None
        acc: _StepAccumulator | None = None
        for s in samples:
            if step is None or s.step != step:
                if acc is not None:
                    acc.finish(writer, totals)
                if step is not None and s.step < step:
                    raise ImportFormatError(f"{s.where}: step {s.step} after step {step}; steps must ascend")
                step, acc = s.step, _StepAccumulator(s.step, writer, layer_map, log)
            acc.add(s)
        if acc is not None:
            acc.finish(writer, totals)
        if totals["samples"] == 0:
            raise ImportFormatError(f"no samples in {[str(f) for f in files]}")
        writer.add_config({CAPTURE_LOG_KEY: log.to_dict()})
        if late_config is not None:  # what the importer learnt only by reading every sample (slime's weight versions)
            writer.add_config(late_config())
        if layouts is not None:  # read once every sample is: importers fill it while they iterate
            names = list(layouts)
            writer.add_config({"source_layouts": names})
            totals_layouts = {"source_layouts": names}
        else:
            totals_layouts = {}
        writer.finish({**totals, "source_format": source_format, **totals_layouts})
    return writer.path


FLOAT_COLUMNS = ("logp_infer", "logp_train", "advantage")
"""Per-token float columns a sample may lack (NaN-filled among samples that have them); NaN = missing for that token."""

OPTIONAL_COLUMNS: dict[str, type | None] = {"loss_mask": None, "reward": np.float64, "index": np.int64}
"""Token-table columns a dump may carry, in table order: ``loss_mask`` per token (the dump's values and dtype),
``reward`` and ``index`` per sample (repeated over its response tokens). Every sample of a step carries each or
none; a step whose samples differ is refused, naming the field."""


def _positions(lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(n) for n in lengths])``, without a loop."""
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)


class _StepAccumulator:
    """One step's samples into its token/prompt tables, routes and step record.

    A NaN log-prob is missing for that token (prime-rl writes non-finite values as ``null``): the token stays in the
    table, the step's mismatch metrics are over the loss-masked tokens that have both log-probs, and the loss-masked
    tokens without are counted (``logp_missing`` in the step record, ``masked_tokens_without_logp`` in the summary).
    A sample without one of :data:`FLOAT_COLUMNS` while others of its step have it gets NaN there.
    """

    def __init__(self, step: int, writer: RunWriter, layer_map: LayerMap | None, log: CaptureLog):
        self.step, self.writer, self.layer_map, self.log = step, writer, layer_map, log
        # the chunk's samples (sample numbers chunk_start, chunk_start + 1, ...): their token arrays and per-sample
        # values; the per-token columns are built from them once per chunk (:meth:`_token_columns`)
        self.chunk_start = 0
        self.lens: list[int] = []  # response lengths
        self.prompt_lens: list[int] = []
        self.response_tokens: list[np.ndarray] = []
        self.prompt_tokens: list[np.ndarray] = []
        self.optional: dict[str, list[Any]] = {name: [] for name in OPTIONAL_COLUMNS}  # None where a sample lacks it
        self.floats: dict[str, list[np.ndarray | None]] = {}
        self.prompt_writer: Any = None  # pyarrow.parquet.ParquetWriter once the first chunk is written
        self.routes: list[np.ndarray] = []
        self.weights: list[np.ndarray | None] = []  # routing weights beside each sample's kept ids (None: none)
        self.any_routes = False
        self.n = 0
        self.ntok = 0
        self.pq_writer: Any = None
        self.lt: list[np.ndarray] = []  # log-probs of masked tokens for the step's metrics (float64, 16 B/token)
        self.li: list[np.ndarray] = []
        self.missing = 0  # loss-masked tokens with a log-prob missing (NaN) on either side
        self.rewards: list[float] = []
        self.flags: dict[str, int] = {}

    def add(self, s: Sample) -> None:
        R = int(s.response_length)
        P = len(s.tokens) - R
        if R < 1 or P < 1:
            raise ImportFormatError(f"{s.where}: {len(s.tokens)} tokens with response_length {R}; need P >= 1, R >= 1")
        for name, v in (("logp_infer", s.logp_infer), ("logp_train", s.logp_train), ("loss_mask", s.loss_mask),
                        ("advantage", s.advantage)):
            if v is not None and v.shape != (R,):
                raise ImportFormatError(f"{s.where}: {name} has {v.shape[0] if v.ndim else 0} values for "
                                        f"{R} response tokens")
        for name, v in (("logp_infer", s.logp_infer), ("logp_train", s.logp_train), ("advantage", s.advantage)):
            lst = self.floats.setdefault(name, [None] * len(self.lens))
            lst.append(None if v is None else np.asarray(v, np.float64))
        self.lens.append(R)
        self.prompt_lens.append(P)
        tokens = np.asarray(s.tokens, dtype=np.int64)
        self.prompt_tokens.append(tokens[:P])
        self.response_tokens.append(tokens[P:])
        self.optional["loss_mask"].append(s.loss_mask)
        self.optional["reward"].append(None if s.reward is None else float(s.reward))
        self.optional["index"].append(None if s.index is None else int(s.index))
        if s.reward is not None:
            self.rewards.append(float(s.reward))
        mask = np.ones(R, bool) if s.loss_mask is None else np.asarray(s.loss_mask) > 0
        if s.logp_infer is not None and s.logp_train is not None:
            lt, li = np.asarray(s.logp_train, np.float64)[mask], np.asarray(s.logp_infer, np.float64)[mask]
            both = np.isfinite(lt) & np.isfinite(li)
            self.missing += int((~both).sum())
            self.lt.append(lt[both])
            self.li.append(li[both])
        elif s.logp_infer is not None or s.logp_train is not None:
            self.missing += int(mask.sum())
        if self.layer_map is not None:
            kept = _check_routes(s, self.n, self.layer_map, self.log)
            if kept is not None:
                self.any_routes = True
                self.routes.append(kept[0].astype(np.int64).astype(_compact(self.layer_map)))
                self.weights.append(kept[1])
            else:
                self.routes.append(None)  # type: ignore[arg-type]
                self.weights.append(None)
        elif s.routes is not None:
            raise ImportFormatError(f"{s.where}: the dump has routes; pass the model's config.json (--config) so "
                                    "its layer axis can be mapped to global layer ids")
        for flag in s.flags:
            self.flags[flag] = self.flags.get(flag, 0) + 1
        self.n += 1
        self.ntok += R
        if self.n % _TOKEN_CHUNK == 0:
            self._flush()

    def _float_columns(self) -> dict[str, np.ndarray]:
        """The chunk's float columns, NaN where a sample lacks one that others (or the table so far) have."""
        have: set[str] = set(self.pq_writer.schema.names) if self.pq_writer is not None else set()
        out = {}
        for name in FLOAT_COLUMNS:
            vals = self.floats.get(name, [])
            if not any(v is not None for v in vals) and name not in have:
                continue
            vals = vals or [None] * len(self.lens)
            out[name] = np.concatenate([np.full(R, np.nan) if v is None else v
                                        for v, R in zip(vals, self.lens, strict=True)])
        return out

    def _token_columns(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The chunk's response-token columns (``sample``, ``position``, ``token``, ``prompt_length``,
        ``response_length``, then those of :data:`OPTIONAL_COLUMNS` its samples carry) and prompt-token columns
        (``sample``, ``position``, ``token``): one row per token, built from the per-sample values at once."""
        R = np.asarray(self.lens, np.int64)
        P = np.asarray(self.prompt_lens, np.int64)
        samples = np.arange(self.chunk_start, self.chunk_start + len(R), dtype=np.int64)
        cols = {"sample": np.repeat(samples, R), "position": _positions(R),
                "token": np.concatenate(self.response_tokens), "prompt_length": np.repeat(P, R),
                "response_length": np.repeat(R, R)}
        for name, dtype in OPTIONAL_COLUMNS.items():
            vals = self.optional[name]
            have = [v is not None for v in vals]
            if not any(have):
                continue
            if not all(have):
                other = self.chunk_start + have.index(not have[0])
                raise ImportFormatError(f"step {self.step}: samples differ in which fields they carry: sample "
                                        f"{self.chunk_start} {'has' if have[0] else 'lacks'} {name!r}, sample "
                                        f"{other} {'lacks' if have[0] else 'has'} it")
            cols[name] = np.concatenate(vals) if dtype is None else np.repeat(np.asarray(vals, dtype), R)
        prompt = {"sample": np.repeat(samples, P), "position": _positions(P),
                  "token": np.concatenate(self.prompt_tokens)}
        return cols, prompt

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.lens:
            return
        cols, prompt_cols = self._token_columns()
        prompt = pa.table(prompt_cols)
        if self.prompt_writer is None:
            out = self.writer.path / "prompts" / f"step-{self.step:06d}.parquet"
            out.parent.mkdir(exist_ok=True)
            self.prompt_writer = pq.ParquetWriter(out, prompt.schema)
        self.prompt_writer.write_table(prompt)
        if self.lt:  # one array per chunk instead of two per sample
            self.lt, self.li = [np.concatenate(self.lt)], [np.concatenate(self.li)]
        cols.update(self._float_columns())
        n = len(cols["sample"])
        table = pa.table({"step": np.full(n, self.step, np.int64), **cols})
        if self.pq_writer is None:
            out = self.writer.path / "tokens" / f"step-{self.step:06d}.parquet"
            out.parent.mkdir(exist_ok=True)
            self.pq_writer = pq.ParquetWriter(out, table.schema)
        elif set(table.schema.names) != set(self.pq_writer.schema.names):
            raise ImportFormatError(f"step {self.step}: samples differ in which fields they carry "
                                    f"({sorted(table.schema.names)} vs {sorted(self.pq_writer.schema.names)})")
        self.pq_writer.write_table(table.select(self.pq_writer.schema.names))
        self.chunk_start = self.n
        self.lens, self.prompt_lens, self.response_tokens, self.prompt_tokens = [], [], [], []
        self.optional = {name: [] for name in OPTIONAL_COLUMNS}
        self.floats = {}

    def finish(self, writer: RunWriter, totals: dict[str, int]) -> None:
        self._flush()
        for w in (self.pq_writer, self.prompt_writer):
            if w is not None:
                w.close()
        lm = self.layer_map
        if lm is not None and self.any_routes:
            shape = next(r for r in self.routes if r is not None).shape[1:]
            parts = [r if r is not None else np.zeros((0, *shape), _compact(lm)) for r in self.routes]
            totals["samples_without_routes"] += sum(r is None for r in self.routes)
            routes = Routes.from_list(parts, num_experts=lm.layout.num_experts, layer_ids=lm.moe_ids)
            kept_w = [w for r, w in zip(self.routes, self.weights, strict=True) if r is not None]
            have_w = [w for w in kept_w if w is not None]
            if have_w and len(have_w) == len(kept_w):
                routes = routes.with_weights(np.concatenate(have_w))
                totals["samples_with_weights"] = totals.get("samples_with_weights", 0) + len(have_w)
            elif have_w:  # the container holds weights for every row or none
                totals["samples_weights_dropped"] = totals.get("samples_weights_dropped", 0) + len(have_w)
            writer.write_routes(self.step, "engine", routes)
        elif lm is not None:
            totals["samples_without_routes"] += self.n
        rec: dict[str, Any] = {"step": self.step, "samples": self.n, "tokens": self.ntok}
        finite = [r for r in self.rewards if np.isfinite(r)]  # NaN: a sample the dump gives no reward (prime-rl)
        if finite:
            rec[RLMetric.REWARD] = float(np.mean(finite))
        for flag, k in sorted(self.flags.items()):
            rec[f"samples_{flag}"] = k
            totals[f"samples_{flag}"] = totals.get(f"samples_{flag}", 0) + k
        if self.missing:
            rec["logp_missing"] = self.missing
            totals["masked_tokens_without_logp"] = totals.get("masked_tokens_without_logp", 0) + self.missing
        if self.lt and sum(a.size for a in self.lt):
            lt, li = np.concatenate(self.lt), np.concatenate(self.li)
            rec.update({f"mismatch/{k}": v for k, v in metrics.mismatch_metrics(lt, li).items()})
        writer.log_step(rec)
        totals["samples"] += self.n
        totals["steps"] += 1
        totals["tokens"] += self.ntok


def sample_tokens(run_path: str | os.PathLike, step: int) -> list[np.ndarray]:
    """The full token sequence (prompt + response) of every sample of an imported run's step, in sample order."""
    import pandas  # noqa: F401  (what to_pandas below needs)
    import pyarrow.parquet as pq

    p = Path(run_path)
    try:
        pr = pq.read_table(p / "prompts" / f"step-{int(step):06d}.parquet").to_pandas()
        rs = pq.read_table(p / "tokens" / f"step-{int(step):06d}.parquet", columns=["sample", "token"]).to_pandas()
    except (OSError, ValueError) as e:
        raise ImportFormatError(f"{str(p)!r} step {step}: no prompt/token tables of an imported run: {e}") from e
    pg, rg = pr.groupby("sample")["token"], rs.groupby("sample")["token"]
    return [np.concatenate([pg.get_group(i).to_numpy(), rg.get_group(i).to_numpy()]) for i in sorted(rg.groups)]


def _compact(lm: LayerMap) -> np.dtype:
    from r3lab.routes import compact_dtype

    return compact_dtype(lm.layout.num_experts)


def layout_config(layer_map: LayerMap) -> dict[str, Any]:
    """The run config's ``model`` block for a model layout: what the doctor needs (MoE layers, experts, top-k)
    when an import records the model but carries no routes (``extra={"model": ...}`` with ``layer_map=None``)."""
    lay = layer_map.layout
    return {"model_type": lay.model_type, "architecture": lay.architecture, "num_hidden_layers": lay.num_hidden_layers,
            "moe_layer_ids": list(lay.moe_layer_ids), "num_experts": lay.num_experts, "top_k": lay.top_k}


def jsonl_samples(files: Iterable[tuple[int, Path]], parse: Any, *, required: tuple[str, ...], what: str
                  ) -> Iterator[Sample]:
    """The JSONL importers' sample loop: each line of each ``(step, file)``, its ``required`` keys checked, handed
    to ``parse(obj, step, where)`` (a :class:`Sample`, or None to leave the line out); ``what`` names the format in
    the error for a line that lacks a key (``"a NeMo-RL train dump"``)."""
    for step, f in files:
        for lineno, d in read_jsonl(f):
            where = f"{f.parent.name}/{f.name} line {lineno}"
            missing = [k for k in required if k not in d]
            if missing:
                raise ImportFormatError(f"{where}: no {missing} (keys {sorted(d)}); is this {what}?")
            s = parse(d, step, where)
            if s is not None:
                yield s
