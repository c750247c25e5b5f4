"""prime-rl token exports (and the engine's routes from its rollout micro-batches) into r3lab runs.

Read from PrimeIntellect-ai/prime-rl at commit ``559b4477`` (also its newest at the time of reading) and its
``deps/verifiers`` submodule, PrimeIntellect-ai/verifiers ``a60a606e``:

* ``src/prime_rl/trainer/rl/token_export.py`` (``trainer.enable_token_export``): one JSON line per packed sequence
  with a loss-masked token, to ``{output_dir}/token_exports/step_{S}/rank_{R}.jsonl`` (``R`` = the world rank; CP
  ranks other than 0 write nothing): ``schema_version`` (1), ``step``, ``rank``, ``micro_step``,
  ``micro_sequence_idx``, ``export_sequence_idx``, ``env_name`` and per-token arrays, **every one as long as
  ``token_ids``** (the pack's padding trimmed): ``position_ids``, ``loss_mask`` (bools), ``advantages``,
  ``inference_logprobs``, ``trainer_logprobs``, ``entropy``, ``mismatch_kl``, ... Non-finite floats are written as
  ``null`` (``_json_float``); so are the optional columns that were not computed. No reward. After every rank
  flushed a step (a barrier), ``STABLE`` is touched in its folder (``mark_stable``): a step folder without it is
  still being written (or its run stopped mid-step) and is skipped, named in the run config (``unfinished_steps``).
* ``src/prime_rl/trainer/rl/train.py`` (l.430-445): ``trainer_logprobs`` are computed against
  ``shift_tensor_left(input_ids)`` and shifted right with ``log(1/vocab)`` at position 0, so position ``t`` is the
  log-prob of token ``t``; ``inference_logprobs`` are aligned the same way. Step ``S`` is the trainer's
  ``progress.step`` (from 1); **r3lab step = S**.

What r3lab reads: the response from the first ``loss_mask`` token ``P`` (``P >= 1``: position 0 is never read);
``logp_infer``/``logp_train``/``advantage`` over ``[P, len)``; ``loss_mask`` over the same span (a multi-turn
sample's context turns stay 0). A ``null`` log-prob is missing for that token: the token is kept, the step's
mismatch metrics are over the loss-masked tokens with both log-probs, and the loss-masked tokens without are
counted (``logp_missing`` per step, ``masked_tokens_without_logp`` in the summary). Ranks are read in rank order.

Routes (filesystem rollout transport only): ``src/prime_rl/transports/rollouts/filesystem.py`` writes
``{output_dir}/rollouts/step_{S}/rank_{D}.bin`` = ``msgspec.msgpack.Encoder().encode(list[MicroBatch])`` for data
rank ``D``, the trainer's step ``S`` reading it (``trainer/rl/data.py``). ``MicroBatch`` and ``RoutedExperts`` are
``array_like`` msgspec structs (``transports/rollouts/types.py``): msgpack arrays of their fields in declaration
order, ``None`` as nil (``input_ids, loss_mask, advantages, inference_logprobs, position_ids,
sequence_lengths, temperatures, env_names, seq_lens, ref_logprobs, routed_experts, ...``; ``routed_experts`` =
``[data: bytes, shape: [tokens, layers, top_k], dtype]``). The row meaning is established by the source:

* rows: ``trainer/batch.py`` packs samples by concatenating them in ``sequence_lengths`` order (routes too) and pads
  the pack's last sequence (zero rows); the trainer enumerates the file's micro-batches as ``micro_step`` and the
  exporter splits each by ``sequence_lengths`` as ``micro_sequence_idx``: so an export line is joined to rows
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

The ZMQ transport writes no files; such a dump imports without routes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import ImportFormatError
from r3lab.importers.common import LayerMap, Sample, jsonl_samples, layout_config, write_run

__all__ = ["import_prime_rl", "export_files", "iter_samples", "read_micro_batches", "detect", "FORMAT", "OPTIONS"]

FORMAT = "prime-rl"
OPTIONS: dict[str, str] = {
    "config": "the model's config.json: maps the rollout micro-batches' layer axis (every decoder layer) to the MoE "
              "layers; needed when the output folder has rollouts/step_S/rank_R.bin"}
_STEP = re.compile(r"^step_(\d+)$")
_RANK = re.compile(r"^rank_(\d+)\.jsonl$")
_BIN = re.compile(r"^rank_(\d+)\.bin$")
REQUIRED = ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")
# MicroBatch's fields in declaration order (transports/rollouts/types.py): positions in the msgpack array
_MB = {"input_ids": 0, "sequence_lengths": 5, "routed_experts": 10}


def _roots(src: str | os.PathLike) -> tuple[Path, Path]:
    """``(token_exports folder, output folder)`` for SRC = the output folder or its ``token_exports``."""
    p = Path(src)
    if not p.is_dir():
        raise ImportFormatError(f"{str(p)!r} is not a folder (pass prime-rl's output folder or its token_exports/)")
    if (p / "token_exports").is_dir():
        return p / "token_exports", p
    if p.name == "token_exports" or any(_STEP.match(d.name) for d in p.iterdir() if d.is_dir()):
        return p, p.parent
    raise ImportFormatError(f"no token_exports/ in {str(p)!r} (enable trainer.enable_token_export)")


def detect(path: Path) -> str | None:
    """Why ``path`` looks like a prime-rl output folder or its ``token_exports/``, else None (names only)."""
    p = Path(path)
    if not p.is_dir():
        return None
    base = p / "token_exports" if (p / "token_exports").is_dir() else p
    hit = next(base.glob("step_*/rank_*.jsonl"), None)
    if hit is None or not _STEP.match(hit.parent.name):
        return None
    bins = (base.parent / "rollouts").is_dir()
    return ("token_exports/step_*/rank_*.jsonl (prime-rl token export" + (", rollouts/ micro-batches" if bins else "")
            + ")")


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
    """One ``rollouts/step_S/rank_R.bin``: its msgpack ``list[MicroBatch]`` as positional field lists (plain data)."""
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


@dataclass
class _Pack:
    input_ids: np.ndarray
    offsets: np.ndarray
    routes: np.ndarray | None


def _pack(mb: list[Any], where: str) -> _Pack:
    ids = np.asarray(mb[_MB["input_ids"]], dtype=np.int64)
    lens = np.asarray(mb[_MB["sequence_lengths"]], dtype=np.int64)
    re_ = mb[_MB["routed_experts"]] if len(mb) > _MB["routed_experts"] else None
    routes = None
    if re_ is not None:
        if not (isinstance(re_, list) and len(re_) == 3 and isinstance(re_[0], bytes)):
            raise ImportFormatError(f"{where}: routed_experts is not [data, shape, dtype]")
        data, shape, dtype = re_
        dt = np.dtype(str(dtype))
        if dt.kind not in "iu":
            raise ImportFormatError(f"{where}: routed_experts dtype {dtype!r} is not an integer type")
        if len(shape) != 3 or int(np.prod(shape)) * dt.itemsize != len(data) or shape[0] != len(ids):
            raise ImportFormatError(f"{where}: routed_experts shape {shape} does not fit {len(data)} bytes of "
                                    f"{dtype} and {len(ids)} input_ids")
        routes = np.frombuffer(data, dtype=dt).reshape(shape)
    return _Pack(ids, np.concatenate([[0], np.cumsum(lens)]), routes)


class _Routes:
    """The engine's route rows of each export line, from its step's rollout micro-batches (checked join)."""

    def __init__(self, output: Path):
        self.dir = output / "rollouts"
        self.step: int | None = None
        self.bins: dict[int, Path] = {}
        self.cache: dict[int, list[_Pack]] = {}
        self.chosen: dict[Path, int] = {}

    def has_any(self, steps: Sequence[int]) -> bool:
        """Whether the rollout micro-batches carry routes: the first step with ``.bin`` files, its smallest file
        (``routed_experts`` is None throughout when the engine ran without ``enable_return_routed_experts``)."""
        for s in steps:
            bins = [f for f in (self.dir / f"step_{s}").glob("rank_*.bin") if _BIN.match(f.name)]
            if bins:
                f = min(bins, key=lambda b: b.stat().st_size)
                return any(len(mb) > _MB["routed_experts"] and mb[_MB["routed_experts"]] is not None
                           for mb in read_micro_batches(f))
        return False

    def _load(self, step: int) -> None:
        if step != self.step:
            self.step, self.cache, self.chosen = step, {}, {}
            d = self.dir / f"step_{step}"
            self.bins = {int(m.group(1)): f for f in d.glob("rank_*.bin") if (m := _BIN.match(f.name))}

    def _packs(self, rank: int) -> list[_Pack]:
        if rank not in self.cache:
            f = self.bins[rank]
            self.cache[rank] = [_pack(mb, f"{f.parent.name}/{f.name} micro-batch {i}")
                                for i, mb in enumerate(read_micro_batches(f))]
        return self.cache[rank]

    def rows(self, step: int, rank_file: Path, rank: int, d: dict[str, Any], tok: np.ndarray) -> np.ndarray | None:
        self._load(step)
        m, j = d.get("micro_step"), d.get("micro_sequence_idx")
        if not isinstance(m, int) or not isinstance(j, int):
            return None
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
            return None if p.routes is None else np.array(p.routes[a:a + len(tok) - 1], dtype=np.int64)
        return None


def _floats(v: Any, key: str, where: str, n: int) -> np.ndarray:
    if not isinstance(v, list) or len(v) != n:
        raise ImportFormatError(f"{where}: {key} has {len(v) if isinstance(v, list) else v!r} values for {n} "
                                "token_ids (prime-rl writes every array as long as token_ids)")
    try:
        return np.asarray([np.nan if x is None else x for x in v], dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ImportFormatError(f"{where}: {key} is not a list of numbers: {e}") from e


def _parser(routes: _Routes | None):
    def parse(d: dict[str, Any], step: int, where: str) -> Sample:
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
        r = None
        if routes is not None:
            f = Path(where.split(" line ")[0])
            rank = int(_RANK.match(f.name).group(1))  # type: ignore[union-attr]
            r = routes.rows(step, f, rank, d, tok)
        return Sample(step=step, tokens=tok, response_length=n - P, logp_infer=inf[P:], logp_train=tr[P:],
                      loss_mask=m[P:].astype(np.int8), advantage=adv_arr, routes=r, where=where)

    return parse


def iter_samples(files: Sequence[tuple[int, Path]], routes_from: Path | None = None) -> Iterator[Sample]:
    """Every exported sequence, one line at a time; with ``routes_from`` (the output folder), its engine routes."""
    routes = _Routes(routes_from) if routes_from is not None else None
    return jsonl_samples(files, _parser(routes), required=REQUIRED,
                         what="a prime-rl token export (token_exports/step_<S>/rank_<R>.jsonl)")


def import_prime_rl(src: str | os.PathLike, out: str | os.PathLike, *,
                    config: str | os.PathLike | None = None) -> Path:
    """Import prime-rl token exports (the output folder or ``token_exports/``) into the run folder ``out``.

    Routes come from ``rollouts/step_S/rank_R.bin`` beside ``token_exports/`` when the first finished step's
    micro-batches carry them (``config`` then required); otherwise the run has no routes and ``config``, if
    given, is recorded for the doctor.
    """
    files, unfinished = export_files(src)
    _, output = _roots(src)
    steps = sorted({s for s, _ in files})
    with_routes = _Routes(output).has_any(steps)
    if with_routes and config is None:
        raise ImportFormatError(f"{str(output / 'rollouts')!r} holds the engine's routes (rank_R.bin); pass the "
                                "model's config.json (--config) so their layer axis can be mapped to global layer ids")
    lmap = LayerMap.from_config(config) if config is not None else None
    extra: dict[str, Any] = {"unfinished_steps": unfinished,
                             "note": "prime-rl token exports; r3lab step = S; null log-probs are missing tokens"
                                     + ("; routes from rollouts/step_S/rank_R.bin" if with_routes else "")}
    if unfinished:
        extra["note"] += f"; steps {unfinished} skipped: no STABLE marker (still being written)"
    if lmap is not None and not with_routes:
        extra["model"] = layout_config(lmap)
    bins = sorted(f for s in steps for f in (output / "rollouts" / f"step_{s}").glob("rank_*.bin")) if with_routes \
        else []
    return write_run(iter_samples(files, output if with_routes else None), out, source_format=FORMAT,
                     files=[f for _, f in files] + bins, layer_map=lmap if with_routes else None, extra=extra)
