"""verl RolloutSkip dumps (``gen_batch.dp``, pickled ``DataProto``; ``tq_batch.pt``, ``torch.save``) into r3lab runs.

Read from verl's source (verl-project/verl, formerly volcengine/verl, commit ``1dda039b`` of 2026-08-22, the newest
commit of its main branch when read):

* ``verl/utils/skip/rollout_skip.py`` ``RolloutSkip.prepare_data`` (``skip.rollout.enable``): writes
  ``{dump_dir}/{experiment_name}_{project_name}/GBS{gbs}_N{n}_in{P}_out{R}/{global_step}/gen_batch.dp`` with
  ``DataProto.save_to_disk`` and ``meta.json`` ``{"global_steps": step}``. Older verl's ``verl/utils/rollout_skip.py``
  (gone at 1dda039b) wrote ``genstep_{000001}/gen_batch.dp`` with the same ``save_to_disk``: the same bytes, so
  no layout of its own; both folder names give the step.
* Same file, ``AsyncRolloutSkip`` (``skip.async_rollout``, the fully async policy): the same
  ``RolloutSkip.prepare_data`` on the output of ``FullyAsyncAgentLoopManager.generate_sequences_single``
  (``verl/experimental/fully_async_policy/fully_async_rollouter.py``): one prompt's ``rollout.n`` samples per file,
  in a folder named by the *rollouter's feed index* parsed from ``uid_sample_{epoch}_{index}``
  (``parse_async_rollout_sample_step``), not by a trainer step; r3lab keeps the writer's number as the step. The
  uid is in the dump's ``non_tensor_batch["uid"]`` when the agent loop copies the input's non-tensor batch
  (``AgentLoopWorker._postprocess``: only without reward-loop workers); that uid marks the layout. Without it an
  async file is byte for byte a ``gen-batch-numpy`` file and is recorded as one (the import is the same).
* ``verl/protocol.py`` ``DataProto.save_to_disk`` / ``__getstate__``: ``save_to_disk`` is ``pickle.dump(DataProto)``;
  the dataclass pickles as ``NEWOBJ(verl.protocol.DataProto)`` + ``BUILD(__getstate__())``, state
  ``(batch, non_tensor_batch, meta_info)``.
  With ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy`` ``batch`` is ``serialize_tensordict``'s ``(batch_size, device,
  {key: (torch dtype name, torch.Size, uint8 numpy array)})``; the pickle then names ``verl.protocol.DataProto``,
  ``torch.Size`` and numpy's array globals (``_reconstruct``, ``ndarray``, ``dtype``, ``scalar``), which are all
  this importer allows (as r3lab stand-ins; ``non_tensor_batch``'s object arrays may hold plain values only).
  By default ``batch`` is ``torch.save(TensorDict)`` bytes, which ``__setstate__`` reads with
  ``torch.load(weights_only=False)``: their ``data.pkl`` names tensordict's own reducers (pytorch/tensordict
  ``tensordict/_reductions.py`` at 40e8b518: ``_rebuild_tensordict_files``; the consolidated layout differs
  between tensordict versions), so they cannot be rebuilt without running tensordict's code. r3lab refuses those
  files and names the re-export setting.
* ``verl/experimental/agent_loop/agent_loop.py`` ``AgentLoopOutput.as_dict`` (one sample),
  ``AgentLoopWorker._postprocess``:
  ``prompts`` ``[B, P_max]`` left-padded, ``responses`` ``[B, R_max]`` right-padded, ``attention_mask``
  ``[B, P_max + R_max]``, ``response_mask`` 1 on the model's tokens (0 on tool output and padding: multi-turn
  masks), ``rollout_log_probs`` (engine, float32, zero padded), ``rm_scores`` (the reward on the last response
  token, when the agent loop scored it), and ``routed_experts`` int16 ``[B, P_max + R_max, layers, topk]``: the
  engine's rows from the prompt's first real position, zero everywhere else (``as_dict``: "multi-turn loops stop
  recording at the last generation. Trailing rows stay zero"). The dump has no trainer log-probs
  (``old_log_probs`` are computed after it).
* ``RolloutTqSkip`` (same file, ``skip.rollout_tq``, the V1 TransferQueue trainer; ``SkipManager.annotate_tq`` in
  ``verl/utils/skip/skip_manager.py`` wraps ``ReplayBuffer.sample`` in ``verl/trainer/ppo/v1/replay_buffer.py``):
  ``prepare_data`` writes ``{project}/{step}/{inner}/tq_batch.pt`` (``inner`` 0 .. ``parameter_sync_step - 1``, one
  sampled mini-batch each) = ``torch.save({"tensordict": tq.kv_batch_get(...), "tags": [...], "keys": [...],
  "global_steps": step})`` and ``meta.json`` ``{"global_steps", "num_trajectories"}``. The trajectories are what
  ``AgentLoopWorkerTQ._agent_loop_postprocess`` (``verl/trainer/ppo/v1/agent_loop_tq.py``) puts per
  ``{uid}_{session_id}_{index}`` key: ``AgentLoopOutput.as_dict()`` unpadded (``prompts`` [P], ``responses`` [R],
  ``response_mask`` [R], ``rollout_log_probs`` [R] float32, ``routed_experts`` int16 [P + R, layers, topk] zero past
  the captured rows, ``rm_scores`` [R] with the reward on the last token) plus the dataset's keys. TransferQueue
  (Ascend/TransferQueue ``b75d570d``, ``transfer_queue/storage/managers/base.py``
  ``_merge_tensors_to_tensordict``) returns them as a ``TensorDict`` of jagged nested tensors (0-d values
  stacked, anything else a ``NonTensorStack``). Pickled (tensordict 0.10.0, ``_reductions._reduce_td``:
  ``_make_td(cls, __getstate__())``; ``NonTensorStack``/``NonTensorData`` as ``NEWOBJ`` + ``BUILD``), the file
  names ``tensordict._reductions._make_td``, ``tensordict._td.TensorDict``, ``tensordict.tensorclass.NonTensorStack``
  and ``NonTensorData`` beyond torch's own globals. r3lab reads it with ``torch.load(weights_only=True)`` and
  those four names mapped to inert r3lab stand-ins (nested jagged tensors are on torch's own weights-only list);
  any other global is refused by name. The dump has no trainer log-probs.

Routes: a sample's captured rows end at its last row that is not all zero (exact for top-k >= 2, whose real rows
hold distinct ids); its first ``P + R - 1`` rows are r3lab's routes. A shorter capture keeps tokens and log-probs
and leaves its routes out (recorded for ``r3lab doctor``). ``rollout_data_dir/{step}.jsonl`` holds decoded text
and scores with no token ids or sample ids to join on, so it is not read; rewards come from ``rm_scores``.
The layout of every file is told from its bytes (a zip archive is ``torch.save``, a pickle is ``DataProto``; the
state, the batch and the payload keys tell the rest) and recorded in the run (``config.source_layouts``).
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3lab._extras import importing
from r3lab.errors import ImportFormatError, UnsafeFileError
from r3lab.importers.common import LayerMap, Sample, write_run
from r3lab.importers.layouts import Layout, LayoutsSeen, unknown_layout
from r3lab.importers.unpickle import NUMPY_GLOBALS, Rebuilder, resolve, restricted_load

__all__ = ["import_verl", "step_files", "iter_samples", "load_gen_batch", "load_tq_batch", "detect", "OPTIONS",
           "FORMAT", "SERIALIZATION_SETTING", "LAYOUTS"]

FORMAT = "verl"
OPTIONS: dict[str, str] = {
    "config": "the model's config.json (or its folder): maps the routes' layer axis to global layer ids",
}
GEN_BATCH = "gen_batch.dp"
TQ_BATCH = "tq_batch.pt"
SERIALIZATION_SETTING = "VERL_DATAPROTO_SERIALIZATION_METHOD=numpy"
_STEP_DIR = re.compile(r"^(?:genstep_)?(\d+)$")
_INNER_DIR = re.compile(r"^\d+$")
_SHAPE_DIR = re.compile(r"^GBS\d+_N\d+_in\d+_out\d+$")
_ASYNC_UID = re.compile(r"^(?:uid_)?sample_\d+_(\d+)$")
WRITER = "verl's DataProto.save_to_disk"
TQ_WRITER = "verl's RolloutTqSkip.prepare_data"
_TORCH_DTYPES = {"bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
                 "int64": np.int64, "float16": np.float16, "float32": np.float32, "float64": np.float64}
_SRC = "verl-project/verl@1dda039b verl/utils/skip/rollout_skip.py"
_GIVES = "prompts/responses, response (loss) mask, engine log-probs, routes, rewards (rm_scores); no trainer log-probs"
LAYOUTS: tuple[Layout, ...] = (
    Layout("gen-batch-numpy", f"{_SRC} RolloutSkip.prepare_data (skip.rollout; older verl/utils/rollout_skip.py "
           "genstep_ folders: same bytes) + verl/protocol.py DataProto.save_to_disk",
           "pickled verl.protocol.DataProto whose batch is serialize_tensordict's (batch_size, device, "
           "{key: (dtype, shape, uint8 array)}) triple", _GIVES),
    Layout("gen-batch-torch", f"{_SRC} RolloutSkip.prepare_data with verl's default DataProto serialization",
           "pickled verl.protocol.DataProto whose batch is torch.save(TensorDict) bytes",
           f"nothing: refused (loading it runs tensordict's code); re-dump with {SERIALIZATION_SETTING}"),
    Layout("async-gen-batch-numpy", f"{_SRC} AsyncRolloutSkip (skip.async_rollout) + verl/experimental/"
           "fully_async_policy/fully_async_rollouter.py generate_sequences_single",
           "gen-batch-numpy bytes whose non_tensor_batch uid is uid_sample_{epoch}_{feed index} (one prompt's n "
           "samples; the step is the rollouter's feed index)", _GIVES),
    Layout("tq-batch", f"{_SRC} RolloutTqSkip.prepare_data (skip.rollout_tq) + verl/trainer/ppo/v1/agent_loop_tq.py; "
           "Ascend/TransferQueue@b75d570d kv_batch_get; tensordict 0.10.0 _reductions",
           "torch.save zip of {tensordict, tags, keys, global_steps}: a TensorDict of jagged nested tensors per "
           "trajectory", _GIVES),
)


class DataProtoStandIn:
    """What ``NEWOBJ(verl.protocol.DataProto)`` + ``BUILD`` makes here: the state tuple, kept as plain data."""

    path = ""

    def __init__(self, *args: Any, **kwargs: Any):  # NEWOBJ never calls it; REDUCE on the class would
        raise UnsafeFileError(f"{self.path!r} calls verl.protocol.DataProto directly; DataProto.save_to_disk never "
                              "does that, so r3lab refuses the file")

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 3):
            raise unknown_layout(FORMAT, repr(self.path), f"a DataProto state of {type(state).__name__}"
                                 f"{f' with {len(state)} items' if isinstance(state, tuple | list) else ''}, not "
                                 "(batch, non_tensor_batch, meta_info)", LAYOUTS)
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


def _gen_batch_layout(non_tensor: dict[str, Any]) -> str:
    """``async-gen-batch-numpy`` when every uid is AsyncRolloutSkip's ``uid_sample_{epoch}_{index}``."""
    uid = non_tensor.get("uid")
    if isinstance(uid, np.ndarray) and uid.size and all(isinstance(u, str) and _ASYNC_UID.match(u) for u in uid.flat):
        return "async-gen-batch-numpy"
    return "gen-batch-numpy"


def load_gen_batch(path: Path, seen: LayoutsSeen | None = None
                   ) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """``(tensors, non_tensor_batch, meta_info)`` of one ``gen_batch.dp``, loaded without running code."""
    obj = restricted_load(path, _allowed(str(path)), WRITER)
    if not isinstance(obj, DataProtoStandIn) or not hasattr(obj, "state"):
        raise ImportFormatError(f"{str(path)!r} is not a pickled verl DataProto (got {type(obj).__name__})")
    batch, non_tensor, meta = obj.state
    if isinstance(batch, bytes | bytearray):
        raise UnsafeFileError(
            f"{str(path)!r} stores its tensors as torch.save(TensorDict) bytes (verl's default DataProto "
            "serialization, layout gen-batch-torch), which only an unrestricted torch.load can read, so r3lab refuses "
            f"it. Re-dump with {SERIALIZATION_SETTING} set in the environment of the verl trainer (verl/protocol.py "
            "__getstate__)")
    if batch is None:
        raise ImportFormatError(f"{str(path)!r}: a DataProto without a tensor batch")
    batch = resolve(batch)
    if not (isinstance(batch, tuple) and len(batch) == 3 and isinstance(batch[2], dict)):
        raise unknown_layout(FORMAT, repr(str(path)), f"a DataProto tensor batch of {type(batch).__name__}"
                             f"{f' with {len(batch)} items' if isinstance(batch, tuple | list) else ''}, not "
                             "serialize_tensordict's (batch_size, device, tensors) triple", LAYOUTS)
    tensors = {}
    for k, enc in batch[2].items():
        a = _decode(enc, f"{path.parent.name}/{path.name} key {k!r}")
        if a is not None:
            tensors[str(k)] = a
    nt = resolve(non_tensor) if isinstance(non_tensor, dict) else {}
    if seen is not None:
        seen.add(_gen_batch_layout(nt))
    return tensors, nt, resolve(meta) if isinstance(meta, dict) else {}


# ---- tq_batch.pt (skip.rollout_tq) --------------------------------------------------------------------------------
_TD_NAMES = {"_make_td": "tensordict._reductions._make_td", "TensorDict": "tensordict._td.TensorDict",
             "NonTensorStack": "tensordict.tensorclass.NonTensorStack",
             "NonTensorData": "tensordict.tensorclass.NonTensorData"}
_PAYLOAD_KEYS = {"tensordict", "tags", "keys", "global_steps"}


class _TensorDictMarker:
    """``tensordict._td.TensorDict`` as the pickle names it: only ``_make_td``'s first argument, never built."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise UnsafeFileError("a tq_batch.pt builds a TensorDict other than through tensordict's _make_td; "
                              "RolloutTqSkip's torch.save never does that")


class TensorDictStandIn:
    """What ``_make_td(TensorDict, state)`` gives here: the state's fields (``_tensordict``) and batch size."""

    def __init__(self, state: dict[str, Any]):
        fields, bs = state.get("_tensordict"), state.get("_batch_size")
        if not isinstance(fields, dict) or not isinstance(bs, tuple):
            raise ImportFormatError(f"a TensorDict state without _tensordict / _batch_size (keys {sorted(state)})")
        self.fields, self.batch_size = fields, tuple(int(n) for n in bs)


def _make_td(cls: Any, state: Any) -> TensorDictStandIn:
    if cls is not _TensorDictMarker or not isinstance(state, dict):
        raise UnsafeFileError(f"tensordict's _make_td called on {getattr(cls, '__name__', type(cls).__name__)}; "
                              "RolloutTqSkip's dumps call it on TensorDict with a state dict only")
    return TensorDictStandIn(state)


class NonTensorStackStandIn:
    """``NEWOBJ(NonTensorStack)`` + ``BUILD(state)``: the stacked ``NonTensorData`` items' values."""

    def __setstate__(self, state: Any) -> None:
        items = state.get("tensordicts") if isinstance(state, dict) else None
        if not isinstance(items, list):
            raise ImportFormatError("a NonTensorStack state without its tensordicts list")
        self.data = [x.data if isinstance(x, NonTensorDataStandIn) else x for x in items]


class NonTensorDataStandIn:
    """``NEWOBJ(NonTensorData)`` + ``BUILD({"tensordict", "non_tensordict": {"data": value}})``: the value."""

    def __setstate__(self, state: Any) -> None:
        nt = state.get("non_tensordict") if isinstance(state, dict) else None
        if not isinstance(nt, dict) or "data" not in nt:
            raise ImportFormatError("a NonTensorData state without non_tensordict['data']")
        self.data = nt["data"]


_TQ_GLOBALS = ((_make_td, _TD_NAMES["_make_td"]), (_TensorDictMarker, _TD_NAMES["TensorDict"]),
               (NonTensorStackStandIn, _TD_NAMES["NonTensorStack"]),
               (NonTensorDataStandIn, _TD_NAMES["NonTensorData"]))


def _torch_load_tq(path: Path) -> Any:
    """``torch.load(weights_only=True)`` with tensordict's four names mapped to the stand-ins above (only for this
    call: a same-named global registered elsewhere, tensordict's own, is set aside and put back)."""
    with importing("torch", for_=f"reading verl's {path.name}"):
        import torch
        import torch.serialization as ts

    try:  # newer torch pickles a dynamo marker in a nested tensor's metadata cache; its own safe list needs it loaded
        import torch._dynamo.decorators  # noqa: F401
    except ImportError:  # pragma: no cover - older torch
        pass
    names = {n for _, n in _TQ_GLOBALS}
    before = ts.get_safe_globals()
    kept = [g for g in before if not (isinstance(g, tuple) and g[1] in names)
            and f"{getattr(g, '__module__', '')}.{getattr(g, '__qualname__', '')}" not in names]
    ts.clear_safe_globals()
    ts.add_safe_globals([*kept, *_TQ_GLOBALS])
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        msg = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:300]
        m = re.search(r"GLOBAL ([\w.]+)", msg)
        if m and m.group(1).split(".")[0] in ("tensordict", "torch", "transfer_queue"):
            raise unknown_layout(FORMAT, repr(str(path)), f"a tq_batch.pt that names {m.group(1)} ({msg})",
                                 LAYOUTS) from None
        raise UnsafeFileError(f"{str(path)!r} needs more than tensors, plain containers and tensordict's "
                              f"TensorDict/NonTensorStack to load ({msg}); {TQ_WRITER} never writes that, and "
                              "loading it fully could run code, so r3lab refuses the file") from None
    except (UnsafeFileError, ImportFormatError):
        raise
    except (RuntimeError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise ImportFormatError(f"{str(path)!r} is not a readable torch.save archive: {type(e).__name__}: "
                                f"{str(e)[:300]}") from e
    finally:
        ts.clear_safe_globals()
        ts.add_safe_globals(before)


def _per_sample(value: Any, n: int, key: str, where: str) -> list[np.ndarray] | list[Any]:
    """One field of the TensorDict as ``n`` per-trajectory values (numpy arrays for tensors)."""
    with importing("torch", for_=f"{where}: reading verl's tensors"):
        import torch

    if isinstance(value, NonTensorStackStandIn):
        if len(value.data) != n:
            raise ImportFormatError(f"{where}: field {key!r} holds {len(value.data)} items for {n} trajectories")
        return value.data
    if not isinstance(value, torch.Tensor):
        raise unknown_layout(FORMAT, where, f"field {key!r} is a {type(value).__name__}", LAYOUTS)
    if value.is_nested:
        if value.layout != torch.jagged or getattr(value, "_ragged_idx", 1) != 1:
            raise unknown_layout(FORMAT, where, f"field {key!r} is a nested tensor of layout {value.layout} "
                                 f"ragged on dim {getattr(value, '_ragged_idx', '?')} (r3lab reads jagged tensors "
                                 "ragged on dim 1, TransferQueue's)", LAYOUTS)
        vals = value.values()
        vals = (vals.float() if vals.dtype == torch.bfloat16 else vals).numpy()
        offs = value.offsets().numpy().astype(np.int64)
        lengths = value.lengths()
        lens = np.diff(offs) if lengths is None else lengths.numpy().astype(np.int64)
        if len(offs) != n + 1 or len(lens) != n:
            raise ImportFormatError(f"{where}: field {key!r} has {len(offs) - 1} trajectories, the batch {n}")
        if (lens < 0).any() or (offs[:-1] + lens > len(vals)).any():
            raise ImportFormatError(f"{where}: field {key!r} has offsets past its {len(vals)} values")
        return [vals[int(o):int(o) + int(m)] for o, m in zip(offs[:-1], lens, strict=True)]
    if value.dim() < 1 or value.shape[0] != n:
        raise ImportFormatError(f"{where}: field {key!r} of shape {tuple(value.shape)} for {n} trajectories")
    arr = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    return list(arr)


def load_tq_batch(path: Path, seen: LayoutsSeen | None = None) -> tuple[int, list[str], dict[str, list[Any]]]:
    """``(global_steps, keys, {field: per-trajectory values})`` of one ``tq_batch.pt``, loaded without running code."""
    p = Path(path)
    if not p.is_file():
        raise ImportFormatError(f"{str(p)!r} does not exist")
    obj = _torch_load_tq(p)
    where = repr(str(p))
    if not isinstance(obj, dict):
        raise unknown_layout(FORMAT, where, f"a torch.save of {type(obj).__name__}, not RolloutTqSkip's payload dict",
                             LAYOUTS)
    if set(obj) != _PAYLOAD_KEYS:
        missing, extra = sorted(_PAYLOAD_KEYS - set(obj)), sorted(map(str, set(obj) - _PAYLOAD_KEYS))
        raise unknown_layout(FORMAT, where, "a payload with keys " + str(sorted(map(str, obj)))
                             + (f" (no {missing})" if missing else "") + (f" (new keys {extra})" if extra else ""),
                             LAYOUTS)
    td, keys, tags, step = obj["tensordict"], obj["keys"], obj["tags"], obj["global_steps"]
    if not isinstance(td, TensorDictStandIn):
        raise unknown_layout(FORMAT, where, f"'tensordict' is a {type(td).__name__}, not a TensorDict", LAYOUTS)
    if not (isinstance(step, int) and not isinstance(step, bool)):
        raise ImportFormatError(f"{where}: global_steps is {step!r}, not a step number")
    if len(td.batch_size) != 1:
        raise ImportFormatError(f"{where}: a TensorDict of batch size {td.batch_size}, not [trajectories]")
    n = td.batch_size[0]
    if not (isinstance(keys, list) and len(keys) == n and isinstance(tags, list) and len(tags) == n):
        raise ImportFormatError(f"{where}: {len(keys) if isinstance(keys, list) else keys!r} keys and "
                                f"{len(tags) if isinstance(tags, list) else tags!r} tags for {n} trajectories")
    fields = {str(k): _per_sample(v, n, str(k), where) for k, v in td.fields.items()}
    if seen is not None:
        seen.add("tq-batch")
    return step, [str(k) for k in keys], fields


# ---- files, detect, samples -----------------------------------------------------------------------------------------
def _step_of(f: Path) -> int | None:
    d = f.parent.parent if f.name == TQ_BATCH else f.parent
    m = _STEP_DIR.match(d.name)
    if f.name == TQ_BATCH and (m is None or not _INNER_DIR.match(f.parent.name) or d.name.startswith("genstep_")):
        return None
    return int(m.group(1)) if m else None


def _inner_of(f: Path) -> int:
    return int(f.parent.name) if f.name == TQ_BATCH and _INNER_DIR.match(f.parent.name) else 0


def step_files(src: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, file)`` of every dumped step under ``src`` (the dump_dir, any folder beneath it, or one file):
    ``{step}/gen_batch.dp`` (one per step) or ``{step}/{inner}/tq_batch.pt`` (one per mini-batch, inner order)."""
    p = Path(src)
    if p.is_file():
        found = [p]
    elif p.is_dir():
        found = sorted([*p.rglob(GEN_BATCH), *p.rglob(TQ_BATCH)])
    else:
        raise ImportFormatError(f"{str(p)!r} is neither a {GEN_BATCH} / {TQ_BATCH} nor a folder")
    out: dict[int, list[Path]] = {}
    for f in found:
        step = _step_of(f)
        if step is None:
            if f.name == TQ_BATCH:
                raise ImportFormatError(f"{str(f)!r}: its folders {f.parent.parent.name}/{f.parent.name} are not "
                                        "a step and a mini-batch number (RolloutTqSkip writes .../{step}/{inner}/"
                                        "tq_batch.pt)")
            raise ImportFormatError(f"{str(f)!r}: its folder {f.parent.name!r} is not a step number "
                                    "(RolloutSkip writes .../GBS{g}_N{n}_in{P}_out{R}/{step}/gen_batch.dp)")
        have = out.setdefault(step, [])
        if have and (f.name == GEN_BATCH or have[0].name == GEN_BATCH or _inner_of(f) in map(_inner_of, have)):
            raise ImportFormatError(f"step {step} is dumped twice ({str(have[0])!r} and {str(f)!r}): several runs "
                                    "under one folder; point at one GBS..._N..._in..._out... folder")
        have.append(f)
    if not out:
        raise ImportFormatError(f"no {GEN_BATCH} or {TQ_BATCH} under {str(p)!r} (verl writes them with "
                                "skip.rollout / skip.async_rollout / skip.rollout_tq enable=True)")
    return [(s, f) for s in sorted(out) for f in sorted(out[s], key=_inner_of)]


def detect(path: Path) -> str | None:
    """Why ``path`` looks like a verl RolloutSkip dump (``gen_batch.dp`` / ``tq_batch.pt`` in step folders), else
    None (names only: both file names are verl's own)."""
    p = Path(path)
    if p.is_file():
        if p.name == GEN_BATCH:
            return f"{p.name} is a verl DataProto dump"
        return f"{p.name} is a verl RolloutTqSkip dump" if p.name == TQ_BATCH and zipfile.is_zipfile(p) else None
    if not p.is_dir():
        return None
    for name in (GEN_BATCH, TQ_BATCH):
        if (p / name).is_file():
            return f"{p.name}/{name}"
    for d in [p, *(c for c in p.iterdir() if c.is_dir())]:
        for c in d.iterdir() if d.is_dir() else []:
            if (c / GEN_BATCH).is_file():
                return f"{GEN_BATCH} in step folder {c.relative_to(p)}"
            if (c / TQ_BATCH).is_file() and _INNER_DIR.match(c.name) and _STEP_DIR.match(c.parent.name):
                return f"{TQ_BATCH} in step/mini-batch folder {c.relative_to(p)}"
            if _SHAPE_DIR.match(c.name):
                return f"RolloutSkip folder {c.relative_to(p)}"
            if c.is_dir() and _STEP_DIR.match(c.name) and any((i / TQ_BATCH).is_file() for i in c.iterdir()
                                                               if i.is_dir() and _INNER_DIR.match(i.name)):
                return f"{TQ_BATCH} in step folder {c.relative_to(p)}"
    return None


def _routes(re_i: np.ndarray, start: int, n: int) -> np.ndarray | None:
    rows = re_i[start:start + n]
    nonzero = np.flatnonzero(rows.reshape(len(rows), -1).any(axis=1))
    if not nonzero.size:
        return None
    cap = rows[: int(nonzero[-1]) + 1]
    return cap[: n - 1]  # P + R - 1 rows, or the shorter capture (write_run records it and leaves it out)


def _gen_batch_samples(step: int, f: Path, seen: LayoutsSeen | None) -> Iterator[Sample]:
    t, _, _ = load_gen_batch(f, seen)
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


def _field(t: dict[str, list[Any]], key: str, i: int, rows: int, where: str) -> np.ndarray | None:
    """Trajectory ``i``'s ``key`` (None when the dump has no such field), checked to have ``rows`` rows."""
    if key not in t:
        return None
    a = np.asarray(t[key][i])
    if a.ndim < 1 or len(a) != rows:
        raise ImportFormatError(f"{where}: {key!r} has shape {a.shape}, expected {rows} rows"
                                + (" (prompt + response tokens)" if key == "routed_experts" else " (response tokens)"))
    return a


def _tq_samples(step: int, f: Path, seen: LayoutsSeen | None) -> Iterator[Sample]:
    got, keys, t = load_tq_batch(f, seen)
    name = f"{f.parent.parent.name}/{f.parent.name}/{f.name}"
    if got != step:
        raise ImportFormatError(f"{str(f)!r}: global_steps {got} in the file, step {step} in its folder name; "
                                "RolloutTqSkip writes both from the same step")
    for key in ("prompts", "responses"):
        if key not in t:
            raise ImportFormatError(f"{name}: no {key!r} (fields {sorted(t)}); is this a verl tq_batch?")
    for i, k in enumerate(keys):
        where = f"{name} trajectory {i} ({k})"
        pr, rs = np.asarray(t["prompts"][i]), np.asarray(t["responses"][i])
        P, R = len(pr), len(rs)
        if pr.ndim != 1 or rs.ndim != 1 or P < 1 or R < 1:
            raise ImportFormatError(f"{where}: prompts {pr.shape} / responses {rs.shape}, not P, R >= 1 token ids")

        rm, lp, rw = (_field(t, key, i, R, where) for key in ("response_mask", "rollout_log_probs", "rm_scores"))
        rex = _field(t, "routed_experts", i, P + R, where)
        if rex is not None and rex.ndim != 3:
            raise ImportFormatError(f"{where}: 'routed_experts' has shape {rex.shape}, not [P + R, layers, top_k]")
        yield Sample(step=step, tokens=np.concatenate([pr, rs]).astype(np.int64), response_length=R,
                     logp_infer=None if lp is None else lp.astype(np.float64),
                     loss_mask=None if rm is None else (rm != 0).astype(np.int8),
                     reward=None if rw is None else float(rw.sum()),
                     routes=None if rex is None else _routes(rex.astype(np.int64), 0, P + R), prefix_capture=True,
                     where=where)


def _is_zip(f: Path) -> bool:
    with open(f, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"


def iter_samples(files: Sequence[tuple[int, Path]], seen: LayoutsSeen | None = None) -> Iterator[Sample]:
    """Every sample of the dumps, one file in memory at a time (the layout told by each file's bytes)."""
    for step, f in files:
        if not f.is_file():
            raise ImportFormatError(f"{str(f)!r} does not exist")
        yield from (_tq_samples if _is_zip(f) else _gen_batch_samples)(step, f, seen)


def import_verl(src: str | os.PathLike, out: str | os.PathLike, *, config: str | os.PathLike | None = None) -> Path:
    """Import verl RolloutSkip dumps (``gen_batch.dp``, ``tq_batch.pt``: dump_dir, any folder under it, or one file)
    into ``out``."""
    files = step_files(src)
    lmap = LayerMap.from_config(config) if config is not None else None
    seen = LayoutsSeen(LAYOUTS)
    return write_run(iter_samples(files, seen), out, source_format=FORMAT, files=[f for _, f in files],
                     layer_map=lmap, extra={"config_json": None if config is None else str(config)}, layouts=seen)
