"""slime's and Miles' ``--save-debug-train-data`` dumps: the trainer's log-probs and advantages of each rollout sample.

Three layouts, each read in its writer's source:

* **slime v2** (THUDM/slime ``681b3adca`` #2266, 2026-08-12, read at ``624b824a``):
  ``slime/observability/train_data_utils.py`` ``save_debug_train_data``. One file per rollout, written by the DP source
  rank of TP 0 on the last PP stage:
  ``{"format_version": 2, "rollout_id", "rank", "samples": [...], "dp_shards": [...], "raw_reward"}``. Each sample dict
  holds that sample's columns (``log_probs``, ``advantages``, ``tokens``, ``response_lengths``, ...), ``sample_index``
  (``Sample.index``) and ``rollout_position`` (its place in the rollout dump's ``samples``: the DP ``partition``). CP
  fields are already gathered to the full response (``restore_context_parallel_fields_to_cpu`` with
  ``all_gather_with_cp``). Joined on ``rollout_position``.
* **slime v1** (before #2266; read at ``d38dc29c9``, the parent of ``681b3adca``): ``slime/utils/train_dump_utils.py``:
  every global rank writes ``{"rollout_id", "rank", "rollout_data"}`` (default
  ``{dump_details}/train_data/{rollout_id}_{rank}.pt``), ``rollout_data`` being that rank's DP shard as the trainer
  holds it: ``partition`` popped (``slime/utils/data.py:process_rollout_data``), ``sample_indices`` = the global
  ``Sample.index`` (``slime/rollout/data_source.py`` ``RolloutDataSource.get_samples`` numbers samples across the whole
  run), TP ranks duplicate, only the last PP stage has ``log_probs``, and CP fields are each CP rank's zigzag slice. The
  file does not name its CP rank: it is inferred (see :func:`infer_cp_ranks`).
* **Miles** (radixark/miles ``31f1ca96``): ``miles/utils/train_dump_utils.py`` writes slime v1's dict plus
  ``cp_rank``, ``cp_size`` and ``qkv_format`` (``train_data/{rollout_id}_{rank}.pt``); Miles' own reader
  ``miles/dashboard/dump_reader.py`` joins on ``sample_indices`` (``Sample.index``) and reassembles CP slices with
  ``assemble_log_prob_from_cp`` (``miles/backends/training_utils/cp_utils.py``).

* **slime v2 with sampler heads** (THUDM/slime ``d92cb5de``, ``slime/observability/train_data_utils.py``): the same
  payload (``format_version`` still 2); each sample may also hold ``rollout_topk_token_ids`` and
  ``rollout_topk_log_probs`` (``_SAMPLER_HEAD_FIELDS``: the sampler's top-k candidates per response token,
  ``[response_length, k]``, CP-gathered by ``_gather_sampler_heads_with_cp``). They are token candidates, not
  routes; r3lab has no column for them and reads past them by name (:data:`IGNORED`). Layout ``train-v2-topk``.

Each file's layout is named from its bytes (:func:`train_layout`: ``train-v1``, ``train-v2``, ``train-v2-topk``,
``train-cp``) and checked against the layouts the importing kind reads; a dict that is none of them (a
``format_version`` other than 2, unknown keys) is refused as a layout this r3lab does not read
(:func:`r3lab.importers.layouts.unknown_layout`).

CP layout (both frameworks, ``get_logits_and_tokens_offset_with_cp``): a sequence of length ``L`` is cut into
``2 * cp_size`` chunks of ``ceil(L / (2 * cp_size))`` tokens; CP rank ``r`` holds chunks ``r`` and
``2 * cp_size - 1 - r`` (zigzag) and stores the log-probs of the response tokens those chunks predict, chunk
``r``'s first. ``L`` is the sample's total length under ``qkv_format="thd"`` and its padded ``max_seq_lens`` entry
under ``"bshd"``; Miles' allgather-CP path re-slices into the same zigzag layout before the dump
(``allgather_cp_redistribute``). TP duplicates must be bit-identical; differing copies are refused.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from r3lab._extras import importing
from r3lab.errors import ImportFormatError
from r3lab.importers.common import safe_torch_load
from r3lab.importers.layouts import Layout, unknown_layout

__all__ = ["TrainRow", "TrainRollout", "TrainDumps", "cp_response_spans", "assemble_cp", "infer_cp_ranks",
           "FIELDS", "IGNORED", "load_dump", "to_numpy", "train_layout"]

FIELDS = {"log_probs": "logp_train", "advantages": "advantage"}  # train-dump column -> what r3lab keeps
IGNORED = ("rollout_topk_token_ids", "rollout_topk_log_probs", "rollout_topk_valid_mask")
"""Per-sample train-dump keys read past by name: the sampler's top-k heads (not routes; r3lab has no column)."""
_V1_KEYS = frozenset({"rollout_id", "rank", "rollout_data"})
_CP_KEYS = _V1_KEYS | {"cp_rank", "cp_size", "qkv_format"}
_NAME = re.compile(r"(\d+)(?:_(\d+))?$")  # {rollout_id}.pt or {rollout_id}_{rank}.pt


def _numpy_scalar() -> Any:
    try:
        from numpy._core.multiarray import scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import scalar  # type: ignore[no-redef]
    return scalar


def load_dump(path: str | Path, *, numpy_arrays: bool = True) -> Any:
    """:func:`~r3lab.importers.common.safe_torch_load`, numpy scalars allowed too when numpy arrays are.

    A reward function returning ``np.float64`` puts a numpy scalar in ``Sample.reward``; numpy's ``scalar``
    rebuilds one from a dtype and its bytes (nothing else runs), so it joins the numpy allowlist here.
    """
    with importing("torch", for_=f"reading the torch file {str(path)!r}"):
        import torch

    if not numpy_arrays:
        return safe_torch_load(path)
    with torch.serialization.safe_globals([_numpy_scalar()]):
        return safe_torch_load(path, numpy_arrays=True)


def train_layout(obj: Any) -> str | None:
    """The train-dump layout of a loaded file, from its keys (None: not one r3lab reads)."""
    if not isinstance(obj, dict):
        return None
    keys = frozenset(obj)
    if "samples" in keys and "rollout_id" in keys and obj.get("format_version") == 2:
        samples = obj["samples"]
        heads = isinstance(samples, list) and any(isinstance(x, dict) and any(k in x for k in IGNORED)
                                                  for x in samples)
        return "train-v2-topk" if heads else "train-v2"
    if keys == _CP_KEYS:
        return "train-cp"
    if keys == _V1_KEYS:
        return "train-v1"
    return None


def to_numpy(v: Any) -> np.ndarray:
    """A tensor (bf16 too), numpy array or list as a numpy array."""
    if hasattr(v, "detach"):
        v = v.detach().cpu()
        if str(v.dtype) == "torch.bfloat16":
            v = v.float()
        return v.numpy()
    return np.asarray(v)


@dataclass
class TrainRow:
    """What the train dump says about one rollout sample, every per-token array over the full response."""

    logp_train: np.ndarray | None = None
    advantage: np.ndarray | None = None
    tokens: np.ndarray | None = None
    response_length: int | None = None


@dataclass
class TrainRollout:
    """One rollout's train rows, keyed by rollout position (slime v2) or by ``Sample.index`` (v1, Miles)."""

    rollout_id: int
    layout: str
    by_position: dict[int, TrainRow] = field(default_factory=dict)
    by_index: dict[int, TrainRow] = field(default_factory=dict)
    cp_size: int = 1
    tp_copies: int = 1
    layout_name: str = ""  # the named layout (train_layout) of its files
    has_logprobs: bool = False  # whether any row has the trainer's log-probs

    def row(self, position: int, index: int | None, where: str) -> TrainRow:
        if self.layout == "slime v2":
            if position not in self.by_position:
                raise ImportFormatError(f"{where}: the train dump of rollout {self.rollout_id} has no sample at "
                                        f"rollout_position {position}")
            return self.by_position[position]
        if index is None:
            raise ImportFormatError(f"{where}: the sample has no 'index', so it cannot be joined to the {self.layout} "
                                    "train dump (joined on Sample.index)")
        if index not in self.by_index:
            raise ImportFormatError(f"{where}: the train dump of rollout {self.rollout_id} has no row with "
                                    f"sample_indices == {index} (Sample.index)")
        return self.by_index[index]

    def __len__(self) -> int:
        return len(self.by_position) if self.layout == "slime v2" else len(self.by_index)


def cp_response_spans(total: int, response: int, cp_rank: int, cp_size: int,
                      seq_len: int | None = None) -> list[tuple[int, int]]:
    """``[start, stop)`` response positions whose log-probs CP rank ``cp_rank`` holds, in its storage order.

    Megatron's zigzag split as slime/Miles compute it (``get_logits_and_tokens_offset_with_cp``): logits row ``t``
    predicts token ``t + 1``, so response position ``j`` is logits row ``P - 1 + j``.
    """
    prompt = total - response
    length = total if seq_len is None else seq_len
    chunk = (length + 2 * cp_size - 1) // (2 * cp_size)
    spans = []
    for lo, hi in ((cp_rank * chunk, (cp_rank + 1) * chunk),
                   ((2 * cp_size - cp_rank - 1) * chunk, (2 * cp_size - cp_rank) * chunk)):
        lo, hi = max(lo, prompt - 1), min(hi, total - 1)
        if lo < hi:
            spans.append((lo - (prompt - 1), hi - (prompt - 1)))
    return spans


def assemble_cp(chunks: Mapping[int, np.ndarray], total: int, response: int, cp_size: int,
                seq_len: int | None, where: str) -> np.ndarray:
    """The full-response array from every CP rank's slice (the inverse of the trainer's split)."""
    missing = sorted(set(range(cp_size)) - set(chunks))
    if missing:
        raise ImportFormatError(f"{where}: CP ranks {missing} of {cp_size} are missing; a response cannot be "
                                "reassembled from part of its CP group (copy every train_data file of the rollout)")
    first = next(iter(chunks.values()))
    out = np.zeros(response, dtype=first.dtype)
    for r, chunk in chunks.items():
        spans = cp_response_spans(total, response, r, cp_size, seq_len)
        width = sum(b - a for a, b in spans)
        if len(chunk) != width:
            raise ImportFormatError(f"{where}: CP rank {r} of {cp_size} holds {len(chunk)} values; the zigzag split "
                                    f"of a {total}-token sample ({response} response) gives it {width}")
        taken = 0
        for a, b in spans:
            out[a:b] = chunk[taken:taken + b - a]
            taken += b - a
    return out


def infer_cp_ranks(n: int, lengths: Sequence[int], total: int, response: int) -> list[int]:
    """CP size candidates for ``n`` copies (sorted by global rank) of one sample's field that carry no ``cp_rank``.

    Megatron orders ranks tp fastest, then cp (``tp-cp-ep-dp-pp``), so in one DP group's last PP stage copy ``k``
    has CP rank ``k // tp``. A CP size ``c`` fits when every copy's length is its rank's zigzag width.
    """
    fits = []
    for c in range(1, n + 1):
        if n % c:
            continue
        tp = n // c
        want = [response] if c == 1 else [sum(b - a for a, b in cp_response_spans(total, response, r, c))
                                          for r in range(c)]
        if all(lengths[k] == want[k // tp] for k in range(n)):
            fits.append(c)
    return fits


def _per_sample(column: Any, n: int) -> bool:
    return column is not None and hasattr(column, "__len__") and len(column) == n and n > 0


class TrainDumps:
    """The train-dump files of a run, indexed by rollout id from their names; one rollout is loaded at a time."""

    def __init__(self, src: str | os.PathLike, *, numpy_arrays: bool = True, kind: str = "slime",
                 layouts: Sequence[Layout] | None = None):
        p = Path(src)
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = sorted(f for f in p.iterdir() if f.suffix == ".pt")
            if not files:
                raise ImportFormatError(f"no .pt train dumps in {str(p)!r} (--train)")
        else:
            raise ImportFormatError(f"train dump path {str(p)!r} does not exist (--train)")
        self.numpy_arrays = numpy_arrays
        self.kind, self.layouts = kind, layouts
        self.files = files
        self.by_rollout: dict[int, list[Path]] = {}
        for f in files:
            m = _NAME.search(f.stem)
            if m is not None:
                rid = int(m.group(1))
            else:  # a template without the id in the name: read it from the file
                rid = int(self._load(f).get("rollout_id", -1))
            self.by_rollout.setdefault(rid, []).append(f)

    def _load(self, f: Path) -> dict[str, Any]:
        obj = load_dump(f, numpy_arrays=self.numpy_arrays)
        if not isinstance(obj, dict) or "rollout_id" not in obj or not ("samples" in obj or "rollout_data" in obj):
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ImportFormatError(f"{str(f)!r} is not a slime/Miles train dump: expected {{'rollout_id', "
                                    f"'samples'}} (slime v2) or {{'rollout_id', 'rank', 'rollout_data'}}, got {keys}")
        if self.layouts is not None:
            name = train_layout(obj)
            if name is None or name not in {lay.name for lay in self.layouts}:
                fv = f", format_version {obj['format_version']!r}" if "format_version" in obj else ""
                named = f" (the {name} layout)" if name else ""
                raise unknown_layout(self.kind, str(f), f"a train dump holding the keys {sorted(obj)}{fv}{named}",
                                     self.layouts)
        return obj

    def __contains__(self, rid: int) -> bool:
        return rid in self.by_rollout

    def rollout(self, rid: int, lengths: Mapping[int, tuple[int, int]]) -> TrainRollout:
        """Rollout ``rid``'s rows; ``lengths`` maps ``Sample.index`` to ``(total, response)`` from the rollout dump."""
        objs = [(f, self._load(f)) for f in self.by_rollout[rid]]
        for f, o in objs:
            if int(o["rollout_id"]) != rid:
                raise ImportFormatError(f"{str(f)!r} says rollout_id {o['rollout_id']}, its name says {rid}")
        v2 = [(f, o) for f, o in objs if "samples" in o]
        if v2:
            if len(objs) != 1:
                raise ImportFormatError(f"rollout {rid} has {len(objs)} train dumps ({[f.name for f, _ in objs]}); "
                                        "slime v2 writes one file per rollout holding every DP shard")
            out = _read_v2(rid, *v2[0])
            out.layout_name = train_layout(v2[0][1]) or "train-v2"
        else:
            out = _read_sharded(rid, objs, lengths)
            names = {train_layout(o) for _, o in objs}
            if len(names) != 1:
                raise ImportFormatError(f"rollout {rid}'s train dumps mix layouts {sorted(map(str, names))} "
                                        f"({[f.name for f, _ in objs]}): files of two writers")
            out.layout_name = names.pop() or "train-v1"
        out.has_logprobs = any(r.logp_train is not None for r in (*out.by_position.values(), *out.by_index.values()))
        return out


def _read_v2(rid: int, f: Path, obj: dict[str, Any]) -> TrainRollout:
    if int(obj.get("format_version", 2)) != 2:
        raise ImportFormatError(f"{str(f)!r}: train dump format_version {obj['format_version']}; r3lab reads 2")
    out = TrainRollout(rid, "slime v2")
    samples = obj["samples"]
    for i, s in enumerate(samples):
        where = f"{f.name} sample {i}"
        if not isinstance(s, dict):
            raise ImportFormatError(f"{where}: expected a dict, got {type(s).__name__}")
        if s.get("rollout_position") is None:
            raise ImportFormatError(f"{where}: no rollout_position (the DP partition); r3lab joins slime v2 train "
                                    "dumps to the rollout dump on it")
        row = TrainRow(tokens=None if s.get("tokens") is None else to_numpy(s["tokens"]),
                       response_length=None if s.get("response_lengths") is None else int(s["response_lengths"]))
        for col, attr in FIELDS.items():
            if s.get(col) is not None:
                setattr(row, attr, to_numpy(s[col]))
        pos = int(s["rollout_position"])
        if pos in out.by_position:
            raise ImportFormatError(f"{where}: rollout_position {pos} appears twice")
        out.by_position[pos] = row
    return out


def _read_sharded(rid: int, objs: list[tuple[Path, dict[str, Any]]],
                  lengths: Mapping[int, tuple[int, int]]) -> TrainRollout:
    """slime v1 and Miles: one file per rank; rows joined on sample_indices, CP reassembled, TP copies dropped."""
    miles = any("cp_size" in o for _, o in objs)
    out = TrainRollout(rid, "miles" if miles else "slime v1")
    objs = sorted(objs, key=lambda x: int(x[1].get("rank", 0)))
    where_of = {id(o): f.name for f, o in objs}
    # sample index -> [(file obj, row)] over every rank that holds the sample
    locations: dict[int, list[tuple[dict[str, Any], int]]] = {}
    for f, o in objs:
        data = o["rollout_data"]
        if not isinstance(data, dict) or data.get("sample_indices") is None:
            raise ImportFormatError(f"{str(f)!r}: rollout_data has no sample_indices (keys "
                                    f"{sorted(data) if isinstance(data, dict) else type(data).__name__})")
        for k, si in enumerate(to_numpy(data["sample_indices"]).tolist()):
            if si is None:
                raise ImportFormatError(f"{str(f)!r} row {k}: sample_indices is None; Sample.index is the join key")
            locations.setdefault(int(si), []).append((o, k))
    for si, locs in locations.items():
        if si not in lengths:
            raise ImportFormatError(f"{where_of[id(locs[0][0])]}: sample_indices {si} is not the index of any sample "
                                    f"in rollout {rid}'s rollout dump")
        total, response = lengths[si]
        first, r0 = locs[0]
        d0 = first["rollout_data"]
        row = TrainRow(tokens=to_numpy(d0["tokens"][r0]) if _per_sample(d0.get("tokens"), len(d0["sample_indices"]))
                       else None)
        for o, r in locs:
            d = o["rollout_data"]
            n = len(d["sample_indices"])
            for col, want in (("response_lengths", response), ("total_lengths", total)):
                if _per_sample(d.get(col), n) and int(d[col][r]) != want:
                    raise ImportFormatError(f"{where_of[id(o)]}: sample {si} has {col} {int(d[col][r])}, the rollout "
                                            f"dump says {want}")
        for col, attr in FIELDS.items():
            holders = [(o, r) for o, r in locs if _per_sample(o["rollout_data"].get(col),
                                                              len(o["rollout_data"]["sample_indices"]))]
            if not holders:
                continue  # pipeline parallelism: only the last stage computes log-probs; or the run did not dump it
            where = f"rollout {rid} sample_indices {si} {col}"
            values = [to_numpy(o["rollout_data"][col][r]) for o, r in holders]
            if miles:
                ranks = [int(o.get("cp_rank", 0)) for o, _ in holders]
                sizes = {int(o.get("cp_size", 1)) for o, _ in holders}
                if len(sizes) != 1:
                    raise ImportFormatError(f"{where}: the rank files disagree on cp_size ({sorted(sizes)})")
                cp = sizes.pop()
                fmt = {str(o.get("qkv_format", "thd")) for o, _ in holders}
                qkv = fmt.pop() if len(fmt) == 1 else "mixed"
            else:
                cp, ranks = _infer_layout(values, total, response, where)
                qkv = "thd"
            seq_len = None
            if qkv == "bshd":
                msl = first["rollout_data"].get("max_seq_lens")
                if msl is None:
                    raise ImportFormatError(f"{where}: qkv_format 'bshd' needs rollout_data['max_seq_lens'] to "
                                            "place the CP chunks, and the dump has none")
                seq_len = int(msl[r0])
            elif qkv != "thd":
                raise ImportFormatError(f"{where}: qkv_format {qkv!r}; r3lab reassembles CP slices of 'thd' and "
                                        "'bshd'")
            setattr(row, attr, _combine(values, ranks, cp, total, response, seq_len, where))
            out.cp_size = max(out.cp_size, cp)
            out.tp_copies = max(out.tp_copies, len(values) // cp)
        out.by_index[si] = row
    return out


def _infer_layout(values: list[np.ndarray], total: int, response: int, where: str) -> tuple[int, list[int]]:
    """(cp_size, CP rank of each copy) for slime v1 copies, which carry no cp_rank: Megatron's tp-fastest rank
    order first (:func:`infer_cp_ranks`), else TP peers found by value; refused when none or several disagree."""
    n = len(values)
    options: list[tuple[int, list[int], bytes]] = []
    error: ImportFormatError | None = None
    candidates = [(c, [k // (n // c) for k in range(n)]) for c in infer_cp_ranks(n, [len(v) for v in values], total,
                                                                                 response)]
    if (by_value := _by_value(values, total, response)) is not None:
        candidates.append((max(by_value) + 1, by_value))
    for c, ranks in candidates:
        try:
            options.append((c, ranks, _combine(values, ranks, c, total, response, None, where).tobytes()))
        except ImportFormatError as e:  # e.g. TP copies that differ under this reading
            error = error or e
    if not options:
        raise error or ImportFormatError(
            f"{where}: {n} rank copies of lengths {[len(v) for v in values]} fit no CP size (response {response}, "
            f"total {total}): not the zigzag CP split of slime's trainer")
    if len({o[2] for o in options}) > 1:
        raise ImportFormatError(f"{where}: the rank copies fit CP sizes {sorted({o[0] for o in options})} with "
                                "different results; the dump does not say which (slime v1 records no cp_rank)")
    return options[0][0], options[0][1]


def _by_value(values: list[np.ndarray], total: int, response: int) -> list[int] | None:
    """CP rank of each copy when identical copies are TP peers and CP ranks appear in rank order, else None."""
    groups: list[bytes] = []
    ranks = []
    for v in values:
        key = v.tobytes() + str(v.shape).encode()
        if key not in groups:
            groups.append(key)
        ranks.append(groups.index(key))
    c = len(groups)
    if c < 2 or any(ranks.count(g) != len(values) // c for g in range(c)):
        return None
    want = [sum(b - a for a, b in cp_response_spans(total, response, r, c)) for r in range(c)]
    return ranks if all(len(v) == want[r] for v, r in zip(values, ranks, strict=True)) else None


def _combine(values: list[np.ndarray], ranks: list[int], cp: int, total: int, response: int, seq_len: int | None,
             where: str) -> np.ndarray:
    """One copy per CP rank (TP copies must be identical), reassembled when CP > 1."""
    chunks: dict[int, np.ndarray] = {}
    for v, r in zip(values, ranks, strict=True):
        if r in chunks:
            if chunks[r].shape != v.shape or chunks[r].tobytes() != v.tobytes():
                raise ImportFormatError(f"{where}: two TP copies of CP rank {r} differ; tensor-parallel ranks must "
                                        "hold the same values (the dump mixes runs, or a rank is corrupt)")
        else:
            chunks[r] = v
    if cp == 1:
        full = chunks[0]
        if len(full) != response:
            raise ImportFormatError(f"{where}: {len(full)} values for {response} response tokens")
        return full
    if qkv_missing := sorted(set(range(cp)) - set(chunks)):
        raise ImportFormatError(f"{where}: CP ranks {qkv_missing} of {cp} missing")
    return assemble_cp(chunks, total, response, cp, seq_len, where)
