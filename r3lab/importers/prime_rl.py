"""prime-rl token exports (and the engine's routes from its micro-batches) into r3lab runs.

Read from PrimeIntellect-ai/prime-rl at commit ``559b4477`` (the newest commit of the mirror read; its
``deps/verifiers`` submodule is PrimeIntellect-ai/verifiers ``a60a606e``), and, for what came after it, the newer
source files as stored at the commits named below (the mirror holds none of them):

* ``src/prime_rl/trainer/rl/token_export.py`` (``trainer.enable_token_export``; ``TokenExporter.export``): one JSON
  line per packed sequence with a loss-masked token, to ``{output_dir}/token_exports/step_{S}/rank_{R}.jsonl``
  (``R`` = the world rank; CP ranks other than 0 write nothing): ``schema_version`` (1), ``step``, ``rank``,
  ``micro_step``, ``micro_sequence_idx``, ``export_sequence_idx``, ``env_name`` and per-token arrays, **every one as
  long as ``token_ids``** (the pack's padding trimmed): ``position_ids``, ``loss_mask`` (bools), ``advantages``,
  ``inference_logprobs``, ``trainer_logprobs``, ``entropy``, ``mismatch_kl``, ... Non-finite floats are written as
  ``null`` (``_json_float``); so are the optional columns that were not computed. After every rank flushed a step
  (a barrier), ``STABLE`` is touched in its folder (``mark_stable``): a step folder without it is still being
  written (or its run stopped mid-step) and is skipped, named in the run config (``unfinished_steps``).
  The newer exporter (read at prime-rl ``004274ec``, ``token_export.py``) keeps ``schema_version`` 1 and adds
  ``export_step`` (``micro_batch["run_step"]`` when the trainer serves several runs, else ``step``), ``run_id``,
  per-token ``losses`` (``{loss: {"advantage", "mask"}}`` per loss channel; ``loss_mask`` is their OR,
  ``advantages`` the ``rl`` channel's or ``null``) and per-token ``rewards`` (the sample's reward repeated,
  ``null`` when it has none: ``trainer/batch.py`` ``prepare_sample``). With a ``run_id`` the folder is per run:
  ``{output_dir}/../{run_id}/token_exports/step_{export_step}/`` (``_export_dir``), and ``STABLE`` lands once that
  run step is fully consumed. **r3lab step = the folder's step** (``S``, or ``export_step``: a line whose
  ``export_step`` differs from its folder is refused). A sample's ``rewards`` become its reward when they agree
  (``null`` left out); a sample whose rewards are all ``null`` (no reward) gets NaN, one whose tokens carry
  different rewards NaN too, flagged ``rewards_vary`` (the step's ``reward_mean`` is over the finite ones).
* ``src/prime_rl/trainer/rl/train.py``: ``trainer_logprobs`` are computed against ``shift_tensor_left(input_ids)``
  and shifted right with ``log(1/vocab)`` at position 0, so position ``t`` is the log-prob of token ``t``;
  ``inference_logprobs`` are aligned the same way. ``S`` counts from 1.

What r3lab reads: the response from the first ``loss_mask`` token ``P`` (``P >= 1``: position 0 is never read);
``logp_infer``/``logp_train``/``advantage`` over ``[P, len)``; ``loss_mask`` over the same span (a multi-turn
sample's context turns stay 0). A ``null`` log-prob is missing for that token: the token is kept, the step's
mismatch metrics are over the loss-masked tokens with both log-probs, and the loss-masked tokens without are
counted (``logp_missing`` per step, ``masked_tokens_without_logp`` in the summary). Ranks are read in rank order.
A ``schema_version`` other than 1 is refused as a layout this r3lab does not read.

Routes (filesystem transport only) come from the micro-batches the trainer read, beside ``token_exports/``:

* 559b4477: ``src/prime_rl/transports/rollouts/filesystem.py`` writes ``{output_dir}/rollouts/step_{S}/rank_{D}.bin``
  = ``msgspec.msgpack.Encoder().encode(list[MicroBatch])`` for data rank ``D``. ``MicroBatch`` and
  ``RoutedExperts`` (``transports/rollouts/types.py``) are ``array_like`` msgspec structs with ``omit_defaults``:
  msgpack arrays of their fields in declaration order, trailing defaults left out (``input_ids, loss_mask,
  advantages, inference_logprobs, position_ids, sequence_lengths, temperatures, env_names, seq_lens, ref_logprobs,
  routed_experts, mm_kwargs, ...``: at most 16; ``routed_experts`` = ``[data: bytes, shape: [tokens, layers,
  top_k], dtype]``).
* prime-rl #3354 (merged 2026-08-23, "rename transports.rollouts to transports.batch"; read at ``6bc6e998``
  ``transports/batch/filesystem.py`` and ``0f59b241`` ``transports/batch/types.py``): the same writer as
  ``FileSystemBatchSender`` to ``{output_dir}/batches/step_{S}/rank_{D}.bin``. ``MicroBatch`` then has up to 20
  fields, appended only ("array_like structs encode positionally"): field 11 is ``mm_refs`` (an array, where
  prime-rl 559b4477 had the ``mm_kwargs`` map), then ``mm_token_type_ids``, the three weight streams, ``sampling_mask``,
  ``trace_ids``, ``branch_indices`` and ``payload`` (19).
* ``transports/payload.py`` (prime-rl ``0f59b241``): per-token side arrays may travel **by handle**: ``payload`` is a
  list of ``PayloadSegment`` = ``[field, file, offset, pos, rows, dtype, shape]``: ``rows`` rows of ``field`` for
  micro-batch positions ``[pos, pos + rows)``, a C-contiguous ``[rows, *shape]`` array at byte ``offset`` of
  ``file`` (written by the inference server under a shared payload root); ``routed_experts`` is then None in the
  ``.bin``. r3lab reads the ``routed_experts`` segments' rows from their files, one sequence at a time
  (``os.pread``, as ``read_field``); rows no segment covers are uncaptured (:data:`r3lab.routes.SENTINEL`).
  ``file`` is the writer's path: where it does not exist, the same path's tail is looked for under the output
  folder (a dump copied elsewhere); a payload file found nowhere is an error naming it.
* prime-rl #3523 (open, "Add Total Router Recall for MoE training", description of 2026-09-10; its code is not in any
  source r3lab could read): routes as ``int32`` of width ``2 * top_k``, the expert ids then the FP32 bits of their
  normalized combine weights. Recognised when an ``int32`` route array's last axis is twice the model's top-k;
  split into ids and :attr:`Sample.weights` (the weight half must be finite and non-negative).
* prime-rl #3509 (open, "feat(rl): add experimental Total Router Recall"; read at ``cec3a005``
  ``transports/batch/routing.py``, ``validate_routed_experts``): ``RoutedExperts`` gains ``weights`` (``<f4``
  bytes, one per id), ``valid`` (one byte per token, 0 or 1) and ``format_version`` (0: ids only; 1: with
  weights; ids ``uint8``/``<u2``). The struct's field order is taken from that file's constructor calls (data,
  shape, dtype, weights, valid, format_version). A ``valid`` 0 row is uncaptured (never read as ids: it becomes a
  :data:`SENTINEL` row, so a sample with one inside its ``P + R - 1`` rows keeps its tokens and loses its routes,
  ``prefix_capture``); another ``format_version`` is refused as a layout this r3lab does not read.

The row meaning is established by the source:

* rows: ``trainer/batch.py`` packs samples by concatenating them in ``sequence_lengths`` order (routes too) and pads
  the pack's last sequence; the trainer enumerates the file's micro-batches as ``micro_step`` and the exporter
  splits each by ``sequence_lengths`` as ``micro_sequence_idx``: so an export line is joined to rows
  ``[offset, offset + len(token_ids))`` of micro-batch ``micro_step``, ``offset`` = the lengths before it. The join
  is checked: those ``input_ids`` must equal the line's ``token_ids`` (the file of data rank ``R`` is tried first,
  then the step's others: with CP, world rank ``R`` reads data rank ``R // cp``). A line no micro-batch matches
  gets no routes (the doctor counts it).
* per sample: verifiers' ``_attribute_routed_experts`` (``verifiers/v1/graph.py``) gives each token its own row
  (row ``t`` = the forward at position ``t``); the engine returns no row for a turn's final position and verifiers
  pads it with a copy of the last row; ``orchestrator/trajectories.py`` zero-pads a short array. The final row is
  therefore never a real route: r3lab keeps rows ``[0, len - 1)``, its ``P + R - 1`` convention.
* layers: every decoder layer (``trainer/models/*/modeling_*.py`` index ``routed_experts[:, :, layer_idx]`` by
  decoder layer), mapped to the MoE layers with the model's ``config.json`` (``--config``).

The ZMQ transport writes no files; such a dump imports without routes. The layouts met are recorded in the run
(:data:`LAYOUTS`, ``config.source_layouts``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import ImportFormatError
from r3lab.importers.common import LayerMap, Sample, jsonl_samples, layout_config, write_run
from r3lab.importers.layouts import Layout, LayoutsSeen, unknown_layout
from r3lab.routes import SENTINEL

__all__ = ["export_files", "iter_samples", "read_micro_batches", "detect", "FORMAT", "OPTIONS", "LAYOUTS"]

FORMAT = "prime-rl"
OPTIONS: dict[str, str] = {
    "config": "the model's config.json: maps the micro-batches' layer axis (every decoder layer) to the MoE layers "
              "and gives top-k (ids beside weight bits); needed when the output folder has batches/ (or rollouts/) "
              "step_S/rank_R.bin with routes"}
_PR = "PrimeIntellect-ai/prime-rl"
LAYOUTS: tuple[Layout, ...] = (
    Layout("export-v1", f"{_PR}@559b4477 src/prime_rl/trainer/rl/token_export.py (TokenExporter.export)",
           "token_exports/step_S/rank_R.jsonl lines of schema_version 1 without export_step",
           "tokens, engine & trainer log-probs, advantages, loss mask (no reward)"),
    Layout("export-v1-runs", f"{_PR}@004274ec src/prime_rl/trainer/rl/token_export.py (TokenExporter.export, "
           "_export_dir)",
           "schema_version 1 lines with export_step, run_id, per-token losses and rewards (per-run folder "
           "RUN_ID/token_exports/ when run_id is set)",
           "tokens, engine & trainer log-probs, advantages, loss mask, rewards"),
    Layout("microbatch-16", f"{_PR}@559b4477 src/prime_rl/transports/rollouts/filesystem.py, types.py (MicroBatch)",
           "rollouts/step_S/rank_D.bin: msgpack list of MicroBatch arrays of at most 16 fields, field 11 the "
           "mm_kwargs map (a micro-batch both writers write alike is told by its folder)",
           "engine routes (ids) joined to the export lines"),
    Layout("microbatch-20", f"{_PR}@0f59b241 src/prime_rl/transports/batch/types.py, @6bc6e998 batch/filesystem.py "
           "(#3354)",
           "batches/step_S/rank_D.bin: MicroBatch arrays of up to 20 fields (mm_refs, sampling_mask, trace_ids, "
           "branch_indices, payload appended)",
           "engine routes (ids) joined to the export lines"),
    Layout("payload-handles", f"{_PR}@0f59b241 src/prime_rl/transports/payload.py (PayloadSegment, read_field)",
           "MicroBatch field 19 holds [field, file, offset, pos, rows, dtype, shape] segments; routed_experts nil",
           "engine routes read from the payload files (uncovered rows uncaptured)"),
    Layout("routes-ids-weights-int32", f"{_PR} #3523 (open; PR description 2026-09-10, no code readable)",
           "routed_experts int32 of width 2 * top_k: ids, then the fp32 bits of their weights",
           "engine routes and routing weights"),
    Layout("routed-experts-v1", f"{_PR} #3509 (open) @cec3a005 src/prime_rl/transports/batch/routing.py "
           "(validate_routed_experts)",
           "RoutedExperts of 6 fields: weights (<f4 bytes), valid (a byte per token), format_version 1",
           "engine routes and routing weights; valid 0 rows uncaptured"),
)
_STEP = re.compile(r"^step_(\d+)$")
_RANK = re.compile(r"^rank_(\d+)\.jsonl$")
_BIN = re.compile(r"^rank_(\d+)\.bin$")
_BIN_DIRS = ("batches", "rollouts")  # prime-rl #3354's folder first, then 559b4477's
REQUIRED = ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")
SCHEMA_VERSIONS = (1,)
# MicroBatch's fields in declaration order (transports/batch/types.py): positions in the msgpack array
_MB = {"input_ids": 0, "sequence_lengths": 5, "routed_experts": 10, "mm": 11, "payload": 19}
_MB_FIELDS_OLD, _MB_FIELDS_NEW = 16, 20
_ROUTES_FIELD = "routed_experts"  # the PayloadSegment.field of the route rows (MicroBatch.routed_experts by handle)
_RE_FIELDS = 6  # RoutedExperts with prime-rl #3509: data, shape, dtype, weights, valid, format_version
_RE_VERSIONS = (0, 1)


def _export_root(p: Path) -> Path | None:
    """The ``token_exports`` folder of ``p`` (the output folder, a run folder, or the folder itself)."""
    if (p / "token_exports").is_dir():
        return p / "token_exports"
    if p.name == "token_exports" or any(_STEP.match(d.name) for d in p.iterdir() if d.is_dir()):
        return p
    return None


def _roots(src: str | os.PathLike) -> tuple[Path, Path]:
    """``(token_exports folder, output folder)`` for SRC = the output folder, a per-run folder, its
    ``token_exports``, or a folder holding exactly one per-run folder (``RUN_ID/token_exports``)."""
    p = Path(src)
    if not p.is_dir():
        raise ImportFormatError(f"{str(p)!r} is not a folder (pass prime-rl's output folder or its token_exports/)")
    root = _export_root(p)
    if root is not None:
        return root, root.parent
    runs = sorted(d for d in p.iterdir() if d.is_dir() and (d / "token_exports").is_dir())
    if len(runs) == 1:
        return runs[0] / "token_exports", runs[0]
    if len(runs) > 1:
        raise ImportFormatError(f"{str(p)!r} holds token exports of {len(runs)} runs ({[d.name for d in runs][:8]}): "
                                "pass the one run's folder")
    raise ImportFormatError(f"no token_exports/ in {str(p)!r} (enable trainer.enable_token_export)")


def detect(path: Path) -> str | None:
    """Why ``path`` looks like a prime-rl output folder (or a run folder, or its ``token_exports/``), else None."""
    p = Path(path)
    if not p.is_dir():
        return None
    for base in (p / "token_exports", p, *sorted(d / "token_exports" for d in p.iterdir() if d.is_dir())):
        if not base.is_dir():
            continue
        hit = next(base.glob("step_*/rank_*.jsonl"), None)
        if hit is None or not _STEP.match(hit.parent.name) or not _RANK.match(hit.name):
            continue
        bins = [d for d in _BIN_DIRS if (base.parent / d).is_dir()]
        where = "" if base.parent in (p, p.parent) else f" in {base.parent.name}/"
        return (f"token_exports/step_*/rank_*.jsonl{where} (prime-rl token export"
                + (f", {bins[0]}/ micro-batches" if bins else "") + ")")
    return None


def export_files(src: str | os.PathLike) -> tuple[list[tuple[int, Path]], list[int]]:
    """``([(step, file)], unfinished steps)``: every ``step_S/rank_R.jsonl`` of the finished (``STABLE``) steps."""
    root, _ = _roots(src)
    found, unfinished = [], []
    for d in root.iterdir():
        m = _STEP.match(d.name)
        if not (d.is_dir() and m):
            continue
        ranks = [(int(r.group(1)), f) for f in d.iterdir() if (r := _RANK.match(f.name))]
        if not ranks:
            continue
        if not (d / "STABLE").exists():
            unfinished.append(int(m.group(1)))
            continue
        found += [(int(m.group(1)), rank, f) for rank, f in ranks]
    if not found:
        why = f" (steps {sorted(unfinished)} have no STABLE marker yet: still being written)" if unfinished else ""
        raise ImportFormatError(f"no finished token_exports/step_<S>/rank_<R>.jsonl under {str(Path(src))!r}{why}")
    return [(s, f) for s, _, f in sorted(found)], sorted(unfinished)


def read_micro_batches(path: Path) -> list[list[Any]]:
    """One ``batches/`` (or ``rollouts/``) ``step_S/rank_R.bin``: its msgpack ``list[MicroBatch]`` as positional
    field lists (plain data)."""
    import msgpack

    def no_ext(code: int, data: bytes) -> Any:
        raise ImportFormatError(f"{str(path)!r}: msgpack extension type {code}; prime-rl's MicroBatch has none")

    try:
        obj = msgpack.unpackb(path.read_bytes(), raw=False, ext_hook=no_ext, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ImportFormatError(f"{str(path)!r} is not a msgpack list of prime-rl MicroBatch: {e}") from e
    if not isinstance(obj, list) or not all(isinstance(mb, list) and len(mb) > _MB["sequence_lengths"]
                                            for mb in obj):
        raise ImportFormatError(f"{str(path)!r} is not a msgpack list of prime-rl MicroBatch arrays")
    return obj


def _mb_layout(mb: list[Any], folder: str, where: str) -> str:
    """``microbatch-16`` or ``microbatch-20`` from the array itself (its length, field 11); the folder only where
    both writers write the same bytes (no field past 10, or field 11 nil and at most 16 fields)."""
    n = len(mb)
    if n > _MB_FIELDS_NEW:
        raise unknown_layout(FORMAT, where, f"a MicroBatch array of {n} fields (prime-rl's have at most "
                             f"{_MB_FIELDS_NEW})", LAYOUTS)
    mm = mb[_MB["mm"]] if n > _MB["mm"] else None
    if n > _MB_FIELDS_OLD or isinstance(mm, list):
        return "microbatch-20"
    if isinstance(mm, dict):
        return "microbatch-16"
    return "microbatch-16" if folder == "rollouts" else "microbatch-20"


@dataclass
class _Segment:
    file: str
    offset: int
    pos: int
    rows: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return int(self.dtype.itemsize * int(np.prod(self.shape)))


def _segments(raw: Any, where: str) -> list[_Segment]:
    """The ``routed_experts`` ``PayloadSegment``s of a micro-batch's ``payload`` (others are not routes)."""
    if not isinstance(raw, list):
        raise ImportFormatError(f"{where}: payload is {type(raw).__name__}, not a list of PayloadSegment")
    out = []
    for k, s in enumerate(raw):
        if not (isinstance(s, list) and len(s) == 7 and isinstance(s[0], str) and isinstance(s[1], str)
                and all(isinstance(x, int) for x in s[2:5]) and isinstance(s[5], str) and isinstance(s[6], list)):
            raise ImportFormatError(f"{where}: payload segment {k} is not [field, file, offset, pos, rows, dtype, "
                                    f"shape] (PayloadSegment): {str(s)[:120]}")
        if s[0] != _ROUTES_FIELD:
            continue
        try:
            dt = np.dtype(s[5])
        except TypeError as e:
            raise ImportFormatError(f"{where}: payload segment {k} has dtype {s[5]!r}: {e}") from e
        if dt.kind not in "iu" or len(s[6]) != 2 or min(s[2:5]) < 0:
            raise ImportFormatError(f"{where}: routed_experts payload segment {k} is not integer rows of shape "
                                    f"[layers, top_k] at non-negative offsets (dtype {s[5]}, shape {s[6]})")
        out.append(_Segment(s[1], s[2], s[3], s[4], dt, tuple(int(x) for x in s[6])))
    return out


@dataclass
class _Pack:
    """One micro-batch: its ids, sequence offsets, and its route rows (inline, or by payload handle)."""

    input_ids: np.ndarray
    offsets: np.ndarray
    routes: np.ndarray | None = None  # [tokens, layers, width] as the dump has them (a view of its bytes)
    weights: np.ndarray | None = None  # fp32 beside routes (prime-rl #3509)
    valid: np.ndarray | None = None  # one bool per token (prime-rl #3509): False rows are uncaptured
    segments: list[_Segment] = field(default_factory=list)
    where: str = ""

    @property
    def has_routes(self) -> bool:
        return self.routes is not None or bool(self.segments)


def _routed_experts(re_: Any, n_ids: int, where: str, seen: LayoutsSeen
                    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(ids, weights or None, valid or None)`` of an inline prime-rl ``RoutedExperts`` (559b4477's three fields or
    #3509's six), as views of the msgpack bytes (converted a sequence at a time)."""
    if not (isinstance(re_, list) and 3 <= len(re_) and isinstance(re_[0], bytes)):
        raise ImportFormatError(f"{where}: routed_experts is not [data, shape, dtype, ...]")
    if len(re_) > _RE_FIELDS:
        raise unknown_layout(FORMAT, where, f"a RoutedExperts array of {len(re_)} fields (r3lab reads 3, or 6 with "
                             "#3509's weights, valid, format_version)", LAYOUTS)
    data, shape, dtype = re_[:3]
    w_raw, valid_raw, version = (list(re_[3:]) + [None, None, 0])[:3]
    if not isinstance(version, int) or version not in _RE_VERSIONS:
        raise unknown_layout(FORMAT, where, f"RoutedExperts format_version {version!r} (r3lab reads "
                             f"{list(_RE_VERSIONS)})", LAYOUTS)
    try:
        dt = np.dtype(str(dtype))
    except TypeError as e:
        raise ImportFormatError(f"{where}: routed_experts dtype {dtype!r}: {e}") from e
    if dt.kind not in "iu":
        raise ImportFormatError(f"{where}: routed_experts dtype {dtype!r} is not an integer type")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(x, int) and x >= 0 for x in shape)) \
            or int(np.prod(shape)) * dt.itemsize != len(data) or shape[0] != n_ids:
        raise ImportFormatError(f"{where}: routed_experts shape {shape} does not fit {len(data)} bytes of "
                                f"{dtype} and {n_ids} input_ids")
    ids = np.frombuffer(data, dtype=dt).reshape(shape)
    if version == 0:
        if w_raw is not None or valid_raw is not None:
            raise ImportFormatError(f"{where}: routed_experts has weights/valid with format_version 0 (#3509: "
                                    "weights need format_version 1)")
        return ids, None, None
    seen.add("routed-experts-v1")
    if not isinstance(w_raw, bytes) or len(w_raw) != ids.size * 4:
        got = len(w_raw) if isinstance(w_raw, bytes) else w_raw
        raise ImportFormatError(f"{where}: routed_experts weights are {got!r} bytes, not fp32 for the {ids.size} ids "
                                f"of shape {shape}")
    if not isinstance(valid_raw, bytes) or len(valid_raw) != shape[0]:
        raise ImportFormatError(f"{where}: routed_experts valid is not one byte per token ({shape[0]} tokens)")
    valid = np.frombuffer(valid_raw, dtype=np.uint8)
    if (valid > 1).any():
        raise ImportFormatError(f"{where}: routed_experts valid bytes must be 0 or 1, found "
                                f"{int(valid[valid > 1][0])}")
    return ids, np.frombuffer(w_raw, dtype="<f4").reshape(shape), valid.astype(bool)


def _pack(mb: list[Any], where: str, folder: str, seen: LayoutsSeen) -> _Pack:
    seen.add(_mb_layout(mb, folder, where))
    ids = np.asarray(mb[_MB["input_ids"]], dtype=np.int64)
    lens = np.asarray(mb[_MB["sequence_lengths"]], dtype=np.int64)
    p = _Pack(ids, np.concatenate([[0], np.cumsum(lens)]), where=where)
    re_ = mb[_MB["routed_experts"]] if len(mb) > _MB["routed_experts"] else None
    if re_ is not None:
        p.routes, p.weights, p.valid = _routed_experts(re_, len(ids), where, seen)
        return p
    payload = mb[_MB["payload"]] if len(mb) > _MB["payload"] else None
    if payload is not None:
        p.segments = _segments(payload, where)
        if p.segments:
            seen.add("payload-handles")
    return p


class _Routes:
    """The engine's route rows of each export line, from its step's micro-batches (checked join)."""

    def __init__(self, output: Path, seen: LayoutsSeen, top_k: int | None = None):
        self.output = output
        self.seen = seen
        self.top_k = top_k
        self.step: int | None = None
        self.bins: dict[int, Path] = {}
        self.folder = ""
        self.cache: dict[int, list[_Pack]] = {}
        self.chosen: dict[Path, int] = {}
        self.files: dict[str, Path] = {}  # payload file as written -> where it was found

    def step_bins(self, step: int) -> tuple[str, dict[int, Path]]:
        for folder in _BIN_DIRS:
            d = self.output / folder / f"step_{step}"
            bins = {int(m.group(1)): f for f in d.glob("rank_*.bin") if (m := _BIN.match(f.name))}
            if bins:
                return folder, bins
        return "", {}

    def has_any(self, steps: Sequence[int]) -> bool:
        """Whether the micro-batches carry routes: the first step with ``.bin`` files, its smallest file
        (``routed_experts`` is None throughout, and no payload segment names it, when the engine ran without
        ``enable_return_routed_experts``)."""
        probe = LayoutsSeen(LAYOUTS)
        for s in steps:
            folder, bins = self.step_bins(s)
            if bins:
                f = min(bins.values(), key=lambda b: b.stat().st_size)
                return any(_pack(mb, f"{f.parent.name}/{f.name} micro-batch {i}", folder, probe).has_routes
                           for i, mb in enumerate(read_micro_batches(f)))
        return False

    def _load(self, step: int) -> None:
        if step != self.step:
            self.step, self.cache, self.chosen = step, {}, {}
            self.folder, self.bins = self.step_bins(step)

    def _packs(self, rank: int) -> list[_Pack]:
        if rank not in self.cache:
            f = self.bins[rank]
            self.cache[rank] = [_pack(mb, f"{self.folder}/{f.parent.name}/{f.name} micro-batch {i}", self.folder,
                                      self.seen) for i, mb in enumerate(read_micro_batches(f))]
        return self.cache[rank]

    def _payload_file(self, name: str, where: str) -> Path:
        if name in self.files:
            return self.files[name]
        p = Path(name)
        tried = [p] if p.is_absolute() else []
        parts = p.parts[1:] if p.is_absolute() else p.parts
        tried += [self.output.joinpath(*parts[i:]) for i in range(len(parts))]
        for q in tried:
            if q.is_file():
                self.files[name] = q
                return q
        raise ImportFormatError(f"{where}: payload file {name!r} of its routed_experts segments does not exist "
                                f"(looked at {[str(q) for q in tried[:4]]}); copy the payload files with the dump "
                                "(their path tail under the output folder is found)")

    def _read_segments(self, p: _Pack, a: int, b: int) -> np.ndarray:
        """Rows ``[a, b)`` of the micro-batch's ``routed_experts`` segments; rows none covers are SENTINEL."""
        shape = tuple(max(d) for d in zip(*(s.shape for s in p.segments), strict=True))
        out = np.full((max(b - a, 0), *shape), SENTINEL, dtype=np.int64)
        for s in p.segments:
            lo, hi = max(s.pos, a), min(s.pos + s.rows, b)
            if lo >= hi:
                continue
            f = self._payload_file(s.file, p.where)
            n = (hi - lo) * s.row_bytes
            with open(f, "rb") as fh:
                fh.seek(s.offset + (lo - s.pos) * s.row_bytes)
                data = fh.read(n)
            if len(data) != n:
                raise ImportFormatError(f"{p.where}: payload file {str(f)!r} has {len(data)} of the {n} bytes its "
                                        f"segment names at offset {s.offset} (rows {s.pos}..{s.pos + s.rows})")
            rows = np.frombuffer(data, dtype=s.dtype).reshape(hi - lo, *s.shape)
            out[lo - a:hi - a, :s.shape[0], :s.shape[1]] = rows
        return out

    def _split(self, r: np.ndarray, w: np.ndarray | None, dtype_i32: bool, where: str
               ) -> tuple[np.ndarray, np.ndarray | None]:
        """prime-rl #3523: ``int32`` rows of width ``2 * top_k`` = ids, then the fp32 bits of their weights."""
        K = self.top_k
        if K is None or r.shape[2] == K or w is not None:
            return r, w
        if r.shape[2] != 2 * K or not dtype_i32:
            raise ImportFormatError(f"{where}: route rows are {r.shape[2]} wide, the model's top-k is {K} (r3lab reads "
                                    "top-k ids, or #3523's int32 ids and fp32 weight bits of width 2 * top-k): pass "
                                    "the config.json of the model that made this dump (--config)")
        self.seen.add("routes-ids-weights-int32")
        captured = ~(r == SENTINEL).all(axis=(1, 2))
        ids = r[:, :, :K].copy()
        bits = r[:, :, K:].astype(np.int64).astype(np.uint32)  # the int32 payload's bit patterns
        wt = bits.view(np.float32).reshape(ids.shape).copy()
        wt[~captured] = 0.0
        if not (np.isfinite(wt).all() and (wt >= 0).all()):
            raise ImportFormatError(f"{where}: the upper half of the int32 routes (#3523's fp32 weight bits) holds "
                                    "values that are not finite non-negative weights")
        return ids, wt

    def rows(self, step: int, rank_file: Path, rank: int, d: dict[str, Any], tok: np.ndarray
             ) -> tuple[np.ndarray | None, np.ndarray | None]:
        self._load(step)
        m, j = d.get("micro_step"), d.get("micro_sequence_idx")
        if not isinstance(m, int) or not isinstance(j, int):
            return None, None
        order = [self.chosen[rank_file]] if rank_file in self.chosen else []
        order += [r for r in ([rank] if rank in self.bins else []) + sorted(self.bins) if r not in order]
        for r in order:
            packs = self._packs(r)
            if m >= len(packs) or j + 1 >= len(packs[m].offsets):
                continue
            p = packs[m]
            a = int(p.offsets[j])
            if a + len(tok) > int(p.offsets[j + 1]) or not np.array_equal(p.input_ids[a:a + len(tok)], tok):
                continue
            self.chosen[rank_file] = r
            b = a + len(tok) - 1
            if p.routes is not None:
                rr = p.routes[a:b].astype(np.int64)
                ww = None if p.weights is None else p.weights[a:b].astype(np.float32)
                if p.valid is not None:
                    rr[~p.valid[a:b]] = SENTINEL  # uncaptured rows (prime-rl #3509 valid 0): never expert ids
                return self._split(rr, ww, p.routes.dtype == np.dtype(np.int32), p.where)
            if p.segments:
                i32 = all(s.dtype == np.dtype(np.int32) for s in p.segments)
                return self._split(self._read_segments(p, a, b), None, i32, p.where)
            return None, None
        return None, None


def _floats(v: Any, key: str, where: str, n: int) -> np.ndarray:
    if not isinstance(v, list) or len(v) != n:
        raise ImportFormatError(f"{where}: {key} has {len(v) if isinstance(v, list) else v!r} values for {n} "
                                "token_ids (prime-rl writes every array as long as token_ids)")
    try:
        return np.asarray([np.nan if x is None else x for x in v], dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ImportFormatError(f"{where}: {key} is not a list of numbers: {e}") from e


REWARDS_VARY = "rewards_vary"


def _parser(routes: _Routes | None, seen: LayoutsSeen):
    def parse(d: dict[str, Any], step: int, where: str) -> Sample:
        version = d.get("schema_version")
        if version not in SCHEMA_VERSIONS:
            raise unknown_layout(FORMAT, where, f"a token export line of schema_version {version!r} (r3lab reads "
                                 f"{list(SCHEMA_VERSIONS)})", LAYOUTS)
        runs = "export_step" in d
        seen.add("export-v1-runs" if runs else "export-v1")
        if runs and d["export_step"] != step:
            raise ImportFormatError(f"{where}: export_step {d['export_step']!r} in the folder of step {step} "
                                    "(prime-rl files a line under step_<export_step>)")
        tok = np.asarray(d["token_ids"], dtype=np.int64)
        n = len(tok)
        mask = d["loss_mask"]
        if not isinstance(mask, list) or len(mask) != n:
            raise ImportFormatError(f"{where}: loss_mask has {len(mask) if isinstance(mask, list) else mask!r} "
                                    f"values for {n} token_ids")
        m = np.asarray([bool(x) for x in mask])
        on = np.flatnonzero(m)
        if on.size == 0 or on[0] < 1:
            raise ImportFormatError(f"{where}: the loss mask names no completion after a prompt")
        P = int(on[0])
        inf = _floats(d["inference_logprobs"], "inference_logprobs", where, n)
        tr = _floats(d["trainer_logprobs"], "trainer_logprobs", where, n)
        adv = d.get("advantages")
        adv_arr = None if adv is None else _floats(adv, "advantages", where, n)[P:]
        if isinstance(adv, list) and all(x is None for x in adv):
            adv_arr = None  # no rl channel: the newer exporter writes null throughout
        reward: float | None = None
        flags: tuple[str, ...] = ()
        rw = d.get("rewards")
        if rw is not None:
            vals = _floats(rw, "rewards", where, n)
            vals = vals[np.isfinite(vals)]
            if vals.size and (vals == vals[0]).all():
                reward = float(vals[0])
            else:  # no reward (null throughout: prepare_sample's NaN) or several: NaN keeps the step's column whole
                reward = float("nan")
                flags = (REWARDS_VARY,) if vals.size else ()
        r = w = None
        if routes is not None:
            f = Path(where.split(" line ")[0])
            rank = int(_RANK.match(f.name).group(1))  # type: ignore[union-attr]
            r, w = routes.rows(step, f, rank, d, tok)
        return Sample(step=step, tokens=tok, response_length=n - P, logp_infer=inf[P:], logp_train=tr[P:],
                      loss_mask=m[P:].astype(np.int8), advantage=adv_arr, routes=r, weights=w, reward=reward,
                      where=where, flags=flags)

    return parse


def iter_samples(files: Sequence[tuple[int, Path]], routes_from: Path | None = None, *,
                 seen: LayoutsSeen | None = None, top_k: int | None = None) -> Iterator[Sample]:
    """Every exported sequence, one line at a time; with ``routes_from`` (the output folder), its engine routes
    (``top_k``: the model's, to split prime-rl #3523's ids and weight bits)."""
    seen = seen if seen is not None else LayoutsSeen(LAYOUTS)
    routes = _Routes(routes_from, seen, top_k) if routes_from is not None else None
    return jsonl_samples(files, _parser(routes, seen), required=REQUIRED,
                         what="a prime-rl token export (token_exports/step_<S>/rank_<R>.jsonl)")


def import_prime_rl(src: str | os.PathLike, out: str | os.PathLike, *,
                    config: str | os.PathLike | None = None) -> Path:
    """Import prime-rl token exports (the output folder, a run folder or ``token_exports/``) into the run ``out``.

    Routes come from ``batches/`` (or ``rollouts/``) ``step_S/rank_R.bin`` beside ``token_exports/`` when the
    first finished step's micro-batches carry them, inline or by payload handle (``config`` then required);
    otherwise the run has no routes and ``config``, if given, is recorded for the doctor.
    """
    files, unfinished = export_files(src)
    _, output = _roots(src)
    steps = sorted({s for s, _ in files})
    probe = _Routes(output, LayoutsSeen(LAYOUTS))
    with_routes = probe.has_any(steps)
    if with_routes and config is None:
        raise ImportFormatError(f"{str(output)!r} holds the engine's routes (batches/ or rollouts/ rank_R.bin); pass "
                                "the model's config.json (--config) so their layer axis can be mapped to global layer "
                                "ids")
    lmap = LayerMap.from_config(config) if config is not None else None
    extra: dict[str, Any] = {"unfinished_steps": unfinished,
                             "note": "prime-rl token exports; r3lab step = the step folder's S (export_step); null "
                                     "log-probs are missing tokens"
                                     + ("; routes from batches|rollouts/step_S/rank_R.bin (payload files by handle)"
                                        if with_routes else "")}
    if unfinished:
        extra["note"] += f"; steps {unfinished} skipped: no STABLE marker (still being written)"
    if lmap is not None and not with_routes:
        extra["model"] = layout_config(lmap)
    bins = sorted(f for s in steps for f in probe.step_bins(s)[1].values()) if with_routes else []
    seen = LayoutsSeen(LAYOUTS)
    samples = iter_samples(files, output if with_routes else None, seen=seen,
                           top_k=lmap.layout.top_k if lmap is not None else None)
    return write_run(samples, out, source_format=FORMAT, files=[f for _, f in files] + bins,
                     layer_map=lmap if with_routes else None, extra=extra, layouts=seen)
