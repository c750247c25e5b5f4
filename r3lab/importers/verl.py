"""verl RolloutSkip dumps (``gen_batch.dp``, pickled ``DataProto``) into r3lab runs, with routes.

Read from verl's source (verl-project/verl, formerly volcengine/verl, commit ``1dda039b`` of 2026-08-22):

* ``verl/utils/skip/rollout_skip.py:95-123`` (``skip.rollout.enable``): ``prepare_data`` writes
  ``{dump_dir}/{experiment_name}_{project_name}/GBS{gbs}_N{n}_in{P}_out{R}/{global_step}/gen_batch.dp`` with
  ``DataProto.save_to_disk`` and ``meta.json`` ``{"global_steps": step}``. The deprecated
  ``verl/utils/rollout_skip.py`` wrote ``genstep_{000001}/gen_batch.dp``: both folder names give the step.
* ``verl/protocol.py:241-259,377-428``: ``save_to_disk`` is ``pickle.dump(DataProto)``; the dataclass pickles as
  ``NEWOBJ(verl.protocol.DataProto)`` + ``BUILD(__getstate__())``, state ``(batch, non_tensor_batch, meta_info)``.
  With ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy`` ``batch`` is ``serialize_tensordict``'s ``(batch_size, device,
  {key: (torch dtype name, torch.Size, uint8 numpy array)})``; the pickle then names ``verl.protocol.DataProto``,
  ``torch.Size`` and numpy's array globals (``_reconstruct``, ``ndarray``, ``dtype``, ``scalar``), which are all
  this importer allows (as r3lab stand-ins; ``non_tensor_batch``'s object arrays may hold plain values only).
  By default ``batch`` is ``torch.save(TensorDict)`` bytes, which ``__setstate__`` reads with
  ``torch.load(weights_only=False)``: their ``data.pkl`` names tensordict's own reducers (pytorch/tensordict
  ``tensordict/_reductions.py`` at 40e8b518: ``_rebuild_tensordict_files``; the consolidated layout differs
  between tensordict versions), so they cannot be rebuilt without running tensordict's code. r3lab refuses those
  files and names the re-export setting.
* ``verl/experimental/agent_loop/agent_loop.py:705-779`` (one sample), ``:1026-1068`` (``_postprocess``):
  ``prompts`` ``[B, P_max]`` left-padded, ``responses`` ``[B, R_max]`` right-padded, ``attention_mask``
  ``[B, P_max + R_max]``, ``response_mask`` 1 on the model's tokens (0 on tool output and padding: multi-turn
  masks), ``rollout_log_probs`` (engine, float32, zero padded), ``rm_scores`` (the reward on the last response
  token, when the agent loop scored it), and ``routed_experts`` int16 ``[B, P_max + R_max, layers, topk]``: the
  engine's rows from the prompt's first real position, zero everywhere else (``as_dict``: "multi-turn loops stop
  recording at the last generation. Trailing rows stay zero"). The dump has no trainer log-probs
  (``old_log_probs`` are computed after it).

Routes: a sample's captured rows end at its last row that is not all zero (exact for top-k >= 2, whose real rows
hold distinct ids); its first ``P + R - 1`` rows are r3lab's routes. A shorter capture keeps tokens and log-probs
and leaves its routes out (recorded for ``r3lab doctor``). ``rollout_data_dir/{step}.jsonl`` holds decoded text
and scores with no token ids or sample ids to join on, so it is not read; rewards come from ``rm_scores``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import ImportFormatError, UnsafeFileError
from r3lab.importers.common import LayerMap, Sample, write_run
from r3lab.importers.unpickle import NUMPY_GLOBALS, Rebuilder, resolve, restricted_load

__all__ = ["import_verl", "step_files", "iter_samples", "load_gen_batch", "detect", "OPTIONS", "FORMAT",
           "SERIALIZATION_SETTING"]

FORMAT = "verl"
OPTIONS: dict[str, str] = {
    "config": "the model's config.json (or its folder): maps the routes' layer axis to global layer ids",
}
GEN_BATCH = "gen_batch.dp"
SERIALIZATION_SETTING = "VERL_DATAPROTO_SERIALIZATION_METHOD=numpy"
_STEP_DIR = re.compile(r"^(?:genstep_)?(\d+)$")
_SHAPE_DIR = re.compile(r"^GBS\d+_N\d+_in\d+_out\d+$")
WRITER = "verl's DataProto.save_to_disk"
_TORCH_DTYPES = {"bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
                 "int64": np.int64, "float16": np.float16, "float32": np.float32, "float64": np.float64}


class DataProtoStandIn:
    """What ``NEWOBJ(verl.protocol.DataProto)`` + ``BUILD`` makes here: the state tuple, kept as plain data."""

    path = ""

    def __init__(self, *args: Any, **kwargs: Any):  # NEWOBJ never calls it; REDUCE on the class would
        raise UnsafeFileError(f"{self.path!r} calls verl.protocol.DataProto directly; DataProto.save_to_disk never "
                              "does that, so r3lab refuses the file")

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 3):
            raise ImportFormatError(f"{self.path!r}: a DataProto state that is not (batch, non_tensor_batch, "
                                    "meta_info)")
        self.state = state


def _allowed(path: str) -> dict[tuple[str, str], Any]:
    cls = type("DataProtoStandIn", (DataProtoStandIn,), {"path": path})

    def size(where: str, args: tuple[Any, ...]) -> tuple[int, ...]:
        if len(args) != 1 or not isinstance(args[0], tuple) or not all(isinstance(n, int) for n in args[0]):
            raise UnsafeFileError(f"{where} called with {args!r}")
        return args[0]

    return {("verl.protocol", "DataProto"): cls, ("torch", "Size"): Rebuilder("torch.Size", path, size),
            **NUMPY_GLOBALS(path)}


def _decode(enc: Any, where: str) -> np.ndarray | None:
    """One ``serialize_single_tensor`` triple as a numpy array (bfloat16 widened to float32)."""
    if not (isinstance(enc, tuple) and len(enc) == 3):
        return None  # a nested tensor (layout, [triples]): not a field r3lab reads
    dtype, shape, data = enc
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or not isinstance(shape, tuple):
        raise ImportFormatError(f"{where}: a serialized tensor without uint8 data and a shape")
    if dtype == "bfloat16":
        u = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    if dtype not in _TORCH_DTYPES:
        raise UnsafeFileError(f"{where}: tensor dtype {dtype!r} is not a plain numeric dtype")
    return np.ascontiguousarray(data).view(_TORCH_DTYPES[dtype]).reshape(shape)


def load_gen_batch(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """``(tensors, non_tensor_batch, meta_info)`` of one ``gen_batch.dp``, loaded without running code."""
    obj = restricted_load(path, _allowed(str(path)), WRITER)
    if not isinstance(obj, DataProtoStandIn) or not hasattr(obj, "state"):
        raise ImportFormatError(f"{str(path)!r} is not a pickled verl DataProto (got {type(obj).__name__})")
    batch, non_tensor, meta = obj.state
    if isinstance(batch, bytes | bytearray):
        raise UnsafeFileError(
            f"{str(path)!r} stores its tensors as torch.save(TensorDict) bytes (verl's default DataProto "
            "serialization), which only an unrestricted torch.load can read, so r3lab refuses it. Re-dump with "
            f"{SERIALIZATION_SETTING} set in the environment of the verl trainer (verl/protocol.py __getstate__)")
    if batch is None:
        raise ImportFormatError(f"{str(path)!r}: a DataProto without a tensor batch")
    batch = resolve(batch)
    if not (isinstance(batch, tuple) and len(batch) == 3 and isinstance(batch[2], dict)):
        raise ImportFormatError(f"{str(path)!r}: a tensor batch that is not serialize_tensordict's triple")
    tensors = {}
    for k, enc in batch[2].items():
        a = _decode(enc, f"{path.parent.name}/{path.name} key {k!r}")
        if a is not None:
            tensors[str(k)] = a
    nt = resolve(non_tensor) if isinstance(non_tensor, dict) else {}
    return tensors, nt, resolve(meta) if isinstance(meta, dict) else {}


def _step_of(f: Path) -> int | None:
    m = _STEP_DIR.match(f.parent.name)
    return int(m.group(1)) if m else None


def step_files(src: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, gen_batch.dp)`` of every step folder under ``src`` (the dump_dir or any folder beneath it)."""
    p = Path(src)
    if p.is_file():
        found = [p]
    elif p.is_dir():
        found = sorted(p.rglob(GEN_BATCH))
    else:
        raise ImportFormatError(f"{str(p)!r} is neither a gen_batch.dp nor a folder")
    out: dict[int, Path] = {}
    for f in found:
        step = _step_of(f)
        if step is None:
            raise ImportFormatError(f"{str(f)!r}: its folder {f.parent.name!r} is not a step number "
                                    "(RolloutSkip writes .../GBS{g}_N{n}_in{P}_out{R}/{step}/gen_batch.dp)")
        if step in out:
            raise ImportFormatError(f"step {step} is dumped twice ({str(out[step])!r} and {str(f)!r}): several runs "
                                    "under one folder; point at one GBS..._N..._in..._out... folder")
        out[step] = f
    if not out:
        raise ImportFormatError(f"no {GEN_BATCH} under {str(p)!r} (verl writes them with skip.rollout.enable=True)")
    return sorted(out.items())


def detect(path: Path) -> str | None:
    """Why ``path`` looks like a verl RolloutSkip dump (``gen_batch.dp`` in step folders), else None."""
    p = Path(path)
    if p.is_file():
        return f"{p.name} is a verl DataProto dump" if p.name == GEN_BATCH else None
    if not p.is_dir():
        return None
    if (p / GEN_BATCH).is_file():
        return f"{p.name}/{GEN_BATCH}"
    for d in [p, *(c for c in p.iterdir() if c.is_dir())]:
        for c in d.iterdir() if d.is_dir() else []:
            if (c / GEN_BATCH).is_file():
                return f"{GEN_BATCH} in step folder {c.relative_to(p)}"
            if _SHAPE_DIR.match(c.name):
                return f"RolloutSkip folder {c.relative_to(p)}"
    return None


def _routes(re_i: np.ndarray, start: int, n: int) -> np.ndarray | None:
    rows = re_i[start:start + n]
    nonzero = np.flatnonzero(rows.reshape(len(rows), -1).any(axis=1))
    if not nonzero.size:
        return None
    cap = rows[: int(nonzero[-1]) + 1]
    return cap[: n - 1]  # P + R - 1 rows, or the shorter capture (write_run records it and leaves it out)


def iter_samples(files: Sequence[tuple[int, Path]]) -> Iterator[Sample]:
    """Every sample of the dumps, one file in memory at a time."""
    for step, f in files:
        t, _, _ = load_gen_batch(f)
        for key in ("prompts", "responses", "attention_mask", "response_mask"):
            if key not in t:
                raise ImportFormatError(f"{f}: no {key!r} (keys {sorted(t)}); is this a verl gen_batch?")
        prompts, responses, am, rm = t["prompts"], t["responses"], t["attention_mask"], t["response_mask"]
        Pmax, Rmax = prompts.shape[1], responses.shape[1]
        if am.shape[1] != Pmax + Rmax or rm.shape[1] != Rmax:
            raise ImportFormatError(f"{f}: attention_mask {am.shape} / response_mask {rm.shape} do not match prompts "
                                    f"{prompts.shape} and responses {responses.shape}")
        lp, rw, routes = t.get("rollout_log_probs"), t.get("rm_scores"), t.get("routed_experts")
        for i in range(prompts.shape[0]):
            where = f"{f.parent.name}/{f.name} sample {i}"
            pm = am[i, :Pmax] != 0
            P, R = int(pm.sum()), int((am[i, Pmax:] != 0).sum())
            if P < 1 or R < 1:
                raise ImportFormatError(f"{where}: {P} prompt and {R} response tokens")
            tok = np.concatenate([prompts[i][pm], responses[i][:R]]).astype(np.int64)
            r = None if routes is None else _routes(routes[i], Pmax - P, P + R)
            yield Sample(step=step, tokens=tok, response_length=R,
                         logp_infer=None if lp is None else lp[i, :R].astype(np.float64),
                         loss_mask=(rm[i, :R] != 0).astype(np.int8),
                         reward=None if rw is None else float(rw[i].sum()), routes=r, prefix_capture=True, where=where)
        del t


def import_verl(src: str | os.PathLike, out: str | os.PathLike, *, config: str | os.PathLike | None = None) -> Path:
    """Import verl RolloutSkip ``gen_batch.dp`` dumps (dump_dir, any folder under it, or one file) into ``out``."""
    files = step_files(src)
    lmap = LayerMap.from_config(config) if config is not None else None
    return write_run(iter_samples(files), out, source_format=FORMAT, files=[f for _, f in files], layer_map=lmap,
                     extra={"config_json": None if config is None else str(config)})
