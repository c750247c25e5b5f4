"""Megatron-LM's MoE routing trace (``--moe-routing-trace-path``) into an r3lab **expert-load run**.

Read from NVIDIA/Megatron-LM at commit ``d98e8a64ddf34856e74b24714e3bedb2f5a39553`` (its newest at the time of
reading; the trace came with #5220, "MoE routing analysis and metrics capture"):

* ``megatron/core/transformer/moe/router_trace.py``: ``RouterTracer`` writes, per global rank ``R``,
  ``router_trace_rank{R}.jsonl``: one JSON object per router call, built by ``_make_index_record`` in this key order:
  ``step, stage ("pre_dispatch"), block ("decoder" | "mtp"), layer, rank, num_tokens, topk, [mtp_idx], [hs_offset,
  hs_bytes, hs_shape], [logit_offset, logit_bytes, logit_shape], top_indices`` (``_flush_records_to_disk`` adds
  ``top_indices`` last, ``[num_tokens][topk]`` ints). Optional sidecars: ``logits_rank{R}.bin`` (bf16 pre-top-k
  router logits ``[num_tokens, num_experts]`` at ``logit_offset``, ``load_logits_for_record``),
  ``hidden_states_rank{R}.bin`` (not read), and ``router_state_rank{R}.pt`` (``flush``: ``torch.save`` of
  ``{(block, mtp_idx, layer): {"weight", "expert_bias", "score_function", "topk"}}``, read with
  ``weights_only=True``).
* Two writers feed that sink, and the record does not say which (no mode field): r3lab tells them apart from the
  bytes (see :func:`numbering`) and names each file's layout:

  - ``router-trace-hooks-2026-08``: the forward hook on every ``TopKRouter`` (``register_hooks``, ``_record``;
    training: ``megatron/training/training.py`` ``train`` registers it and calls ``advance_step(iteration)``, so
    ``step`` is the training iteration). ``layer`` is ``decoder.layers.<n>`` of the module name
    (``_parse_router_module_name``): the **stage-local, 0-based** index of the layer in its pipeline stage's block;
    MTP routers (``mtp.layers.<head>...``) get ``block "mtp"``, ``mtp_idx`` = the head and ``layer`` = the inner
    layer, so they never collide with decoder layers. The training router returns a boolean routing map, turned into
    ids by ``nonzero``: ids ascend within each row, and a call whose map has other than ``num_tokens * topk`` entries
    (rows with other than top-k experts, e.g. token dropping by capacity) is **silently skipped**. Every microbatch is
    a call, and activation recomputation runs a router again (a duplicate record). Only this path writes the logit
    and hidden-state sidecars.
  - ``router-trace-indices-2026-08``: ``RouterTracer.record_indices``, fed by the inference controller
    (``megatron/core/inference/text_generation_controllers/text_generation_controller.py``, with router replay on)
    with ``layer_ids = [r.layer_number for r in RouterReplay.global_router_replay_instances]``: the router's
    ``layer_number``, **1-based and global** (``TopKRouter.set_layer_number``); every layer is written as
    ``block "decoder"`` with no ``mtp_idx`` (an MTP router's replay instance would share a decoder layer's number),
    ``step`` is the tracer's own decode-step counter, ids are in top-k order (not sorted), no sidecars.

What r3lab reads: every record, one line at a time (a record holds one call's ``num_tokens x topk`` ids; the logits
of that one record are read by offset), into expert counts per ``(step, block, mtp_idx, layer, rank)``: calls, distinct
calls (a record identical to an earlier one of the same key and step, activation recomputation's second forward, is
counted once), router rows, picks per expert, and, where the record has logits, the **routing weights** summed per
expert, computed as Megatron's ``topk_routing_with_score_function`` (``moe_utils.py``) does: ``softmax`` over the
top-k logits (``moe_router_pre_softmax`` off, the default; on: the full softmax at the top-k ids), ``sigmoid`` or
``sqrtsoftplus`` at the top-k ids normalised over them when top-k > 1 (the score function from the router state
file, else the ``score_function`` option, else the config's ``scoring_func``; the config's ``norm_topk_prob`` false
means pre-softmax; the top-k scaling factor is not in the trace and is left out). MTP records keep their block and
head and are never mapped to a decoder layer. Decoder layers are mapped to the model's 0-based global layer: a
``global-1`` file's ``layer - 1``; a ``stage-local`` file's layer plus its pipeline stage's first layer when
``pipeline_parallel`` is given (Megatron's default rank order puts the pipeline rank outermost: stage =
``rank // (ranks / pipeline_parallel)``, layers split evenly; without the option, inferred when every rank traced
the same ``n`` stage-local layers ``0..n-1`` with ``n`` below the model's ``L`` and ``P = L / n`` dividing the ranks,
and recorded as inferred), else the layer as written.

What the trace cannot give, and the run says so (``config.trace``): **no token ids and no sample boundaries**, so
per-sample replay comparison (engine vs trainer routes per token, log-prob drift) needs samples the trace does not
have; and **padding rows are included and cannot be told apart** (the record carries no padding mask: the router
sees padded positions like any other), so the expert-load counts include them.

The run (kind ``imported``, all or nothing): ``expert_load.npz`` (:data:`r3lab.doctor.TRACE_LOAD_FILE`, read by
:func:`r3lab.doctor.trace_load`), one ``steps.jsonl`` record per step (``trace/records``, ``trace/router_rows``,
``trace/max_vio``, ...), no token tables and no routes. Notebook 02's expert-load figures and ``r3lab doctor`` read it.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.doctor import TRACE_BLOCKS, TRACE_LOAD_FILE, TRACE_NOTE
from r3lab.errors import ImportFormatError
from r3lab.importers.common import LayerMap, file_hashes, layout_config, read_jsonl, safe_torch_load
from r3lab.importers.layouts import Layout, LayoutsSeen, unknown_layout
from r3lab.runs import IMPORT_KIND, RunWriter

__all__ = ["import_megatron_trace", "detect", "trace_files", "numbering", "routing_weights", "FORMAT", "OPTIONS",
           "LAYOUTS", "HOOKS", "INDICES"]

FORMAT = "megatron-trace"
_SRC = "NVIDIA/Megatron-LM@d98e8a64 megatron/core/transformer/moe/router_trace.py (#5220)"
HOOKS, INDICES = "router-trace-hooks-2026-08", "router-trace-indices-2026-08"
LAYOUTS: tuple[Layout, ...] = (
    Layout(HOOKS, f"{_SRC}: RouterTracer._record (forward hook on TopKRouter; training.py train)",
           "router_trace_rank{R}.jsonl records, stage-local 0-based decoder layers, MTP as block \"mtp\" + mtp_idx; "
           "optional logits_rank{R}.bin offsets",
           "expert load per step, layer and rank (routing weights from the logits file when present); "
           "no token ids or samples"),
    Layout(INDICES, f"{_SRC}: RouterTracer.record_indices (text_generation_controller.py, router replay on)",
           "router_trace_rank{R}.jsonl records with 1-based global layer numbers (RouterReplay layer_number), "
           "no sidecar offsets",
           "expert load per decode step, layer and rank; no routing weights, token ids or samples"),
)
OPTIONS: dict[str, str] = {
    "config": "the model's config.json: maps layers, checks expert ids, names MoE layers, experts and top-k for the "
              "doctor (the trace carries none of them)",
    "pipeline_parallel": "pipeline-parallel size of the traced run: maps stage-local layer numbers to global ones "
                         "(needs --config and every rank's trace); default: inferred where every rank traced the "
                         "same n < L stage-local layers (P = L / n), else layers as written",
    "score_function": "softmax, softmax-pre (moe_router_pre_softmax), sigmoid or sqrtsoftplus: turns logits into "
                      "routing weights when router_state_rank{R}.pt does not say (default: from --config, else "
                      "softmax)",
    "layer_numbering": "stage-local or global-1: how the trace numbers decoder layers (default: told from the bytes)",
}
_FILE = re.compile(r"^router_trace_rank(\d+)\.jsonl$")
_GLOB = "router_trace_rank*.jsonl"
_HEAD = re.compile(rb'^\{"step": -?\d+, "stage": "[^"]*", "block": "')
REQUIRED = ("step", "stage", "block", "layer", "rank", "num_tokens", "topk", "top_indices")
SIDECAR = ("hs_offset", "hs_bytes", "hs_shape", "logit_offset", "logit_bytes", "logit_shape")
KNOWN = frozenset((*REQUIRED, "mtp_idx", *SIDECAR))
STAGES = ("pre_dispatch",)
SCORE_FUNCTIONS = ("softmax", "softmax-pre", "sigmoid", "sqrtsoftplus")
NUMBERINGS = ("stage-local", "global-1")
MAX_EXPERTS = 1 << 16  # an id this large is no expert id (and would size the counts)


def detect(path: Path) -> str | None:
    """Why ``path`` looks like a Megatron routing trace (a folder of ``router_trace_rank{R}.jsonl`` or one of them,
    whose first line starts as ``RouterTracer`` writes it), else None."""
    p = Path(path)
    hits = [p] if p.is_file() else sorted(p.glob(_GLOB)) if p.is_dir() else []
    for f in hits[:1]:
        if not _FILE.match(f.name):
            return None
        try:
            with open(f, "rb") as fh:
                head = fh.read(256)
        except OSError:
            return None
        if _HEAD.match(head):
            return f"{f.name} (Megatron-LM RouterTracer, --moe-routing-trace-path)"
    return None


def trace_files(src: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(rank, file)`` of each ``router_trace_rank{R}.jsonl`` in the folder ``src`` (or the one file), by rank."""
    p = Path(src)
    if p.is_file():
        found = [p]
    elif p.is_dir():
        found = sorted(p.glob(_GLOB))
    else:
        raise ImportFormatError(f"{str(p)!r} does not exist (give the --moe-routing-trace-path folder)")
    out = []
    for f in found:
        m = _FILE.match(f.name)
        if not m:
            raise ImportFormatError(f"{f.name} is not a router_trace_rank<R>.jsonl file (Megatron's routing trace)")
        out.append((int(m.group(1)), f))
    if not out:
        raise ImportFormatError(f"no router_trace_rank<R>.jsonl in {str(p)!r}: is it the --moe-routing-trace-path "
                                "folder?")
    return sorted(out)


def _bf16(raw: bytes, shape: list[int], where: str) -> np.ndarray:
    """bf16 bytes (written as int16 by ``RouterTracer``) as float32 of ``shape``."""
    if len(raw) % 2:
        raise ImportFormatError(f"{where}: {len(raw)} logit bytes, not a whole number of bf16 values")
    u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    a = u.view(np.float32)
    if a.size != math.prod(shape):
        raise ImportFormatError(f"{where}: {a.size} logits for logit_shape {shape}")
    return a.reshape(shape)


def routing_weights(logits: np.ndarray, ids: np.ndarray, score_function: str) -> np.ndarray:
    """``[rows, topk]`` routing weights at ``ids`` from ``[rows, E]`` logits, as Megatron's
    ``topk_routing_with_score_function`` computes them (no scaling factor)."""
    lg = logits.astype(np.float64)
    at = np.take_along_axis(lg, ids, axis=1)
    if score_function == "softmax":
        z = np.exp(at - at.max(axis=1, keepdims=True))
        return z / z.sum(axis=1, keepdims=True)
    if score_function == "softmax-pre":
        z = np.exp(lg - lg.max(axis=1, keepdims=True))
        return np.take_along_axis(z / z.sum(axis=1, keepdims=True), ids, axis=1)
    if score_function in ("sigmoid", "sqrtsoftplus"):
        s = 1.0 / (1.0 + np.exp(-at)) if score_function == "sigmoid" else np.sqrt(np.logaddexp(0.0, at))
        return s / (s.sum(axis=1, keepdims=True) + 1e-20) if ids.shape[1] > 1 else s
    raise ImportFormatError(f"unknown score function {score_function!r} (one of {list(SCORE_FUNCTIONS)})")


def _config_score(config: str | os.PathLike | None) -> str | None:
    if config is None:
        return None
    import json

    p = Path(config)
    p = p / "config.json" if p.is_dir() else p
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), Mapping) else cfg
    fn = cfg.get("scoring_func")
    if fn in ("sigmoid", "sqrtsoftplus"):
        return str(fn)
    return "softmax-pre" if cfg.get("norm_topk_prob") is False else "softmax"


def _router_states(folder: Path, ranks: list[int]) -> dict[tuple[int, str, int, int], str]:
    """``(rank, block, mtp_idx or -1, layer) -> score function`` from the ``router_state_rank{R}.pt`` files there."""
    out: dict[tuple[int, str, int, int], str] = {}
    for r in ranks:
        f = folder / f"router_state_rank{r}.pt"
        if not f.is_file():
            continue
        state = safe_torch_load(f)
        if not isinstance(state, Mapping):
            raise ImportFormatError(f"{f.name}: a {type(state).__name__}, not RouterTracer's {{(block, mtp_idx, "
                                    "layer): {...}} router state")
        for key, v in state.items():
            if not (isinstance(key, tuple) and len(key) == 3 and isinstance(v, Mapping)):
                raise ImportFormatError(f"{f.name}: key {key!r} is not RouterTracer's (block, mtp_idx, layer)")
            fn = v.get("score_function")
            if isinstance(fn, str):
                out[(r, str(key[0]), -1 if key[1] is None else int(key[1]), int(key[2]))] = fn
    return out


class _Acc:
    """One ``(step, block, mtp_idx, layer, rank)``'s counts."""

    __slots__ = ("calls", "distinct", "rows", "counts", "wsum", "wrows", "seen")

    def __init__(self) -> None:
        self.calls = self.distinct = self.rows = self.wrows = 0
        self.counts = np.zeros(0, np.int64)
        self.wsum = np.zeros(0, np.float64)
        self.seen: set[bytes] = set()

    def add(self, ids: np.ndarray, weights: np.ndarray | None) -> None:
        self.calls += 1
        digest = hashlib.blake2b(ids.tobytes() + repr(ids.shape).encode(), digest_size=16).digest()
        if digest in self.seen:  # activation recomputation's second forward of the same call
            return
        self.seen.add(digest)
        self.distinct += 1
        self.rows += ids.shape[0]
        if ids.size:
            c = np.bincount(ids.ravel(), minlength=len(self.counts))
            if len(c) > len(self.counts):
                self.counts = np.concatenate([self.counts, np.zeros(len(c) - len(self.counts), np.int64)])
            self.counts += c
        if weights is not None and ids.size:
            w = np.bincount(ids.ravel(), weights=weights.ravel(), minlength=len(self.wsum))
            if len(w) > len(self.wsum):
                self.wsum = np.concatenate([self.wsum, np.zeros(len(w) - len(self.wsum))])
            self.wsum += w
            self.wrows += ids.shape[0]


def _int(d: Mapping[str, Any], key: str, where: str, lo: int = 0) -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ImportFormatError(f"{where}: {key} is {v!r}, not an integer >= {lo}")
    return v


def _read_file(rank: int, f: Path, accs: dict[tuple[int, str, int, int, int], _Acc], scores: Mapping[Any, str],
               default_score: str, E: int | None) -> dict[str, Any]:
    """Every record of one rank's trace into ``accs``; what the file showed (for its layout and numbering)."""
    shown: dict[str, Any] = {"sidecar": False, "unsorted": False, "decoder_layers": set(), "records": 0,
                             "max_id": -1, "weights": 0}
    logits_fh = None
    try:
        for lineno, d in read_jsonl(f):
            where = f"{f.name} line {lineno}"
            missing = [k for k in REQUIRED if k not in d]
            extra = sorted(set(d) - KNOWN)
            if missing or extra:
                raise unknown_layout(FORMAT, where, f"a record with keys {list(d)}" + (
                    f" (no {missing})" if missing else "") + (f" (new keys {extra})" if extra else ""), LAYOUTS)
            if d["stage"] not in STAGES or d["block"] not in TRACE_BLOCKS:
                raise unknown_layout(FORMAT, where, f"stage {d['stage']!r}, block {d['block']!r}", LAYOUTS)
            step, layer, n, k = (_int(d, "step", where), _int(d, "layer", where), _int(d, "num_tokens", where),
                                 _int(d, "topk", where, 1))
            if _int(d, "rank", where) != rank:
                raise ImportFormatError(f"{where}: rank {d['rank']} in the file of rank {rank}")
            block = d["block"]
            if (block == "mtp") != ("mtp_idx" in d):
                raise ImportFormatError(f"{where}: block {block!r} " + (
                    "without mtp_idx (RouterTracer writes the MTP head on every MTP record)" if block == "mtp" else
                    "with an mtp_idx (only MTP records carry one)"))
            mtp = _int(d, "mtp_idx", where) if block == "mtp" else -1
            try:
                ids = np.asarray(d["top_indices"], dtype=np.int64)
            except (ValueError, TypeError, OverflowError) as e:
                raise ImportFormatError(f"{where}: top_indices is not a [num_tokens][topk] list of ids: {e}") from e
            if n == 0 and ids.size == 0:
                ids = ids.reshape(0, k)
            if ids.shape != (n, k):
                raise ImportFormatError(f"{where}: top_indices has shape {list(ids.shape)}, not [num_tokens {n}, "
                                        f"topk {k}]")
            if ids.size and ids.min() < 0:
                raise ImportFormatError(f"{where}: negative expert id {int(ids.min())}")
            if ids.size and (np.diff(np.sort(ids, axis=1), axis=1) == 0).any():
                raise ImportFormatError(f"{where}: a row names one expert twice (top-k ids are distinct)")
            if k > 1 and ids.size and not (np.diff(ids, axis=1) > 0).all():
                shown["unsorted"] = True
            if any(key in d for key in SIDECAR):
                shown["sidecar"] = True
            if ids.size:
                shown["max_id"] = max(shown["max_id"], int(ids.max()))
            if ids.size and int(ids.max()) >= MAX_EXPERTS:
                raise ImportFormatError(f"{where}: expert id {int(ids.max())}: not an expert id (no MoE model "
                                        f"has {MAX_EXPERTS} experts)")
            weights = None
            if "logit_offset" in d:
                for key in ("logit_bytes", "logit_shape"):
                    if key not in d:
                        raise ImportFormatError(f"{where}: logit_offset without {key}")
                shape = d["logit_shape"]
                if not (isinstance(shape, list) and len(shape) == 2 and shape[0] == n
                        and all(isinstance(x, int) and x > 0 for x in shape)):
                    raise ImportFormatError(f"{where}: logit_shape {shape!r} is not [num_tokens {n}, experts]")
                if ids.size and int(ids.max()) >= shape[1]:
                    raise ImportFormatError(f"{where}: expert id {int(ids.max())} beyond the {shape[1]} logits")
                if logits_fh is None:
                    lf = f.parent / f"logits_rank{rank}.bin"
                    if not lf.is_file():
                        raise ImportFormatError(f"{where}: the record has logits but {lf.name} is missing")
                    logits_fh = open(lf, "rb")  # noqa: SIM115 - closed below
                logits_fh.seek(_int(d, "logit_offset", where))
                nbytes = _int(d, "logit_bytes", where)
                raw = logits_fh.read(nbytes)
                if len(raw) != nbytes:
                    raise ImportFormatError(f"{where}: logits_rank{rank}.bin ends before offset {d['logit_offset']} "
                                            f"+ {nbytes} bytes (truncated)")
                if n:
                    fn = scores.get((rank, block, mtp, layer), default_score)
                    if fn == "softmax" and default_score == "softmax-pre":
                        fn = "softmax-pre"
                    if fn not in SCORE_FUNCTIONS:
                        raise ImportFormatError(f"{where}: router score function {fn!r} (r3lab reads "
                                                f"{list(SCORE_FUNCTIONS)})")
                    weights = routing_weights(_bf16(raw, shape, where), ids, fn)
                    shown["weights"] += 1
            if block == "decoder":
                shown["decoder_layers"].add(layer)
            shown["records"] += 1
            accs.setdefault((step, block, mtp, layer, rank), _Acc()).add(ids, weights)
    finally:
        if logits_fh is not None:
            logits_fh.close()
    return shown


def numbering(shown: Mapping[str, Any], layer_map: LayerMap | None) -> str:
    """How one file numbers decoder layers, from its bytes: ``"stage-local"`` (the hook path: 0-based in the stage)
    or ``"global-1"`` (``record_indices``: Megatron's 1-based ``layer_number``).

    Sidecar offsets are written by the hook path only; a layer number equal to the model's layer count exists only
    1-based; a layer 0 only 0-based; ids ascending in every row are the hook's boolean routing map (training), ids
    in top-k order with no layer 0 are the inference recorder's."""
    layers = shown["decoder_layers"]
    if shown["sidecar"] or not layers:
        return NUMBERINGS[0]
    if layer_map is not None:
        L = layer_map.layout.num_hidden_layers
        if max(layers) >= L:
            return NUMBERINGS[1]
        moe = set(layer_map.layout.moe_layer_ids)
        if not {g - 1 for g in layers} <= moe:
            return NUMBERINGS[0]
        if not layers <= moe:
            return NUMBERINGS[1]
    if 0 in layers:
        return NUMBERINGS[0]
    return NUMBERINGS[1] if shown["unsorted"] else NUMBERINGS[0]


def _infer_pp(accs: Mapping[tuple[int, str, int, int, int], Any], per_file: Mapping[int, str], ranks: list[int],
              num_layers: int) -> int | None:
    """The pipeline-parallel size a stage-local trace shows, when unambiguous: every rank (0..N-1) traced the same
    stage-local decoder layers ``0..n-1`` with ``n`` below the model's ``L`` layers, ``L = P * n`` and ``P`` dividing
    ``N`` (an even split in Megatron's default rank order); else None (layers kept as written)."""
    if ranks != list(range(len(ranks))) or any(v != NUMBERINGS[0] for v in per_file.values()):
        return None
    sets = {r: {k[3] for k in accs if k[4] == r and k[1] == "decoder"} for r in ranks}
    first = sets[ranks[0]]
    n = len(first)
    if not n or n >= num_layers or num_layers % n or any(v != first for v in sets.values()) \
            or first != set(range(n)):
        return None
    pp = num_layers // n
    return pp if len(ranks) % pp == 0 else None


def import_megatron_trace(src: str | os.PathLike, out: str | os.PathLike, *,  # noqa: C901 - one pass, then write
                          config: str | os.PathLike | None = None, pipeline_parallel: int | str | None = None,
                          score_function: str | None = None, layer_numbering: str | None = None) -> Path:
    """Import a Megatron routing trace folder (``--moe-routing-trace-path``) as the expert-load run ``out``."""
    files = trace_files(src)
    lmap = LayerMap.from_config(config) if config is not None else None
    E = lmap.layout.num_experts if lmap is not None else None
    if score_function is not None and score_function not in SCORE_FUNCTIONS:
        raise ImportFormatError(f"score_function {score_function!r}: one of {list(SCORE_FUNCTIONS)}")
    if layer_numbering is not None and layer_numbering not in NUMBERINGS:
        raise ImportFormatError(f"layer_numbering {layer_numbering!r}: one of {list(NUMBERINGS)}")
    pp = None
    if pipeline_parallel is not None:
        try:
            pp = int(pipeline_parallel)
        except ValueError as e:
            raise ImportFormatError(f"pipeline_parallel {pipeline_parallel!r} is not an integer") from e
        ranks = [r for r, _ in files]
        if pp < 1 or lmap is None:
            raise ImportFormatError("pipeline_parallel needs a size >= 1 and --config (the model's layer count)")
        if ranks != list(range(len(ranks))) or len(ranks) % pp or lmap.layout.num_hidden_layers % pp:
            raise ImportFormatError(f"pipeline_parallel {pp}: needs every rank's trace (ranks 0..N-1 with N a multiple "
                                    f"of {pp}; found ranks {ranks}) and {lmap.layout.num_hidden_layers} layers "
                                    f"divisible by {pp}")
    default_score = score_function or _config_score(config) or "softmax"
    scores = _router_states(files[0][1].parent, [r for r, _ in files])
    accs: dict[tuple[int, str, int, int, int], _Acc] = {}
    seen = LayoutsSeen(LAYOUTS)
    per_file: dict[int, str] = {}
    weighted = 0
    for rank, f in files:
        shown = _read_file(rank, f, accs, scores, default_score, E)
        num = layer_numbering or numbering(shown, lmap)
        if num == NUMBERINGS[1] and shown["sidecar"]:
            raise ImportFormatError(f"{f.name}: layer_numbering global-1, but its records carry sidecar offsets, "
                                    "which only the stage-local hook path writes")
        per_file[rank] = num
        weighted += shown["weights"]
        seen.add(HOOKS if num == NUMBERINGS[0] else INDICES)
    if not accs:
        raise ImportFormatError(f"no router records in {[f.name for _, f in files]}")
    inferred = False
    if pp is None and lmap is not None:
        pp = _infer_pp(accs, per_file, [r for r, _ in files], lmap.layout.num_hidden_layers)
        inferred = pp is not None
    width = max([E or 0, *(len(a.counts) for a in accs.values()), *(len(a.wsum) for a in accs.values())])
    keys = sorted(accs)
    n = len(keys)
    cols: dict[str, np.ndarray] = {
        "step": np.array([k[0] for k in keys], np.int64),
        "block": np.array([TRACE_BLOCKS.index(k[1]) for k in keys], np.int8),
        "mtp_idx": np.array([k[2] for k in keys], np.int64),
        "layer": np.array([k[3] for k in keys], np.int64),
        "rank": np.array([k[4] for k in keys], np.int64),
        "calls": np.array([accs[k].calls for k in keys], np.int64),
        "distinct_calls": np.array([accs[k].distinct for k in keys], np.int64),
        "rows": np.array([accs[k].rows for k in keys], np.int64),
        "weighted_rows": np.array([accs[k].wrows for k in keys], np.int64),
        "counts": np.zeros((n, width), np.int64),
        "weight_sums": np.full((n, width), np.nan),
    }
    glob = np.full(n, -1, np.int64)
    world = len(files)
    for i, k in enumerate(keys):
        a = accs[k]
        cols["counts"][i, :len(a.counts)] = a.counts
        if a.wrows:
            cols["weight_sums"][i] = 0.0
            cols["weight_sums"][i, :len(a.wsum)] = a.wsum
        if k[1] != "decoder":
            continue
        if per_file[k[4]] == NUMBERINGS[1]:
            glob[i] = k[3] - 1
        elif pp is not None and lmap is not None:
            glob[i] = (k[4] // (world // pp)) * (lmap.layout.num_hidden_layers // pp) + k[3]
        else:
            glob[i] = k[3]
    cols["global_layer"] = glob
    steps = sorted({k[0] for k in keys})
    trace_cfg = {"note": TRACE_NOTE, "samples": None, "padding_rows": "included, not told apart (the record has no "
                 "padding mask)", "numbering": {str(r): v for r, v in per_file.items()},
                 "pipeline_parallel": pp, "pipeline_parallel_inferred": inferred,
                 "score_function": default_score if weighted else None,
                 "weighted_records": weighted, "file": TRACE_LOAD_FILE, "num_experts_seen": width}
    extra_files = [p for r, _ in files for p in (files[0][1].parent / f"logits_rank{r}.bin",
                                                 files[0][1].parent / f"router_state_rank{r}.pt") if p.is_file()]
    src_files = [f for _, f in files] + extra_files
    config_out: dict[str, Any] = {"source": {"format": FORMAT, "files": file_hashes(src_files),
                                             "paths": [str(f) for f in src_files]},
                                  "trace": trace_cfg}
    if lmap is not None:
        config_out["model"] = layout_config(lmap)
        if lmap.mtp_layers:
            config_out["model"]["mtp_layers"] = lmap.mtp_layers
    outp = Path(out)
    writer = RunWriter(outp.parent, outp.name, IMPORT_KIND, config_out, atomic=True)
    K = lmap.layout.top_k if lmap is not None else None
    with writer:
        with open(writer.path / TRACE_LOAD_FILE, "wb") as fh:
            np.savez(fh, **cols)  # type: ignore[arg-type]  # numpy's stub types **kwds by its allow_pickle
        for s in steps:
            m = cols["step"] == s
            dec = m & (cols["block"] == 0)
            rec: dict[str, Any] = {"step": s, "trace/records": int(cols["calls"][m].sum()),
                                   "trace/distinct_records": int(cols["distinct_calls"][m].sum()),
                                   "trace/router_rows": int(cols["rows"][dec].sum()),
                                   "trace/mtp_rows": int(cols["rows"][m & (cols["block"] == 1)].sum()),
                                   "trace/ranks": len(set(cols["rank"][m].tolist())),
                                   "trace/decoder_layers": len(set(glob[dec].tolist()))}
            per_layer: dict[int, np.ndarray] = {}
            for i in np.flatnonzero(dec):
                g = int(glob[i])
                per_layer[g] = per_layer.get(g, 0) + cols["counts"][i]
            loads = np.stack([c / max(1, c.sum()) for c in per_layer.values() if c.sum()]) if per_layer else None
            if loads is not None and len(loads):
                rec["trace/max_vio"] = float(metrics.max_violation(loads).max())
            writer.log_step(rec)
        writer.add_config({"source_layouts": list(seen)})
        writer.finish({"steps": len(steps), "samples": 0, "tokens": 0, "records": int(cols["calls"].sum()),
                       "router_rows": int(cols["rows"].sum()), "ranks": world, "top_k": K,
                       "source_format": FORMAT, "source_layouts": list(seen)})
    return writer.path
