"""SkyRL and verl dumps written as their writers write them, by code (never hand-edited bytes).

The pickles carry the globals the real writers record, from stand-in classes registered under the writers' module
names while pickling (nothing of skyrl or verl is imported):

* SkyRL (``skyrl/backends/skyrl_train/training_batch.py`` at a9564572): ``TrainingInputBatch.__reduce__`` =
  ``(_rebuild_tensor_batch, (TrainingInputBatch, state))``, tensors as ``_serialize_tensor``'s numpy dicts, the
  device a real ``torch.device``; layout of ``skyrl/train/dataset/preprocess.py`` (left-padded sequences,
  right-aligned response tensors, routes from the first real position, ``router_padding_mask`` and ``[0..k-1]``
  rows after the captured prefix), ``pad_training_input_batch``'s DP pad rows at the end.
* SkyRL's packed layout (#2235/#2236/#2238, merged 2026-09-18; read at the heads of #2080 c1e71a0b, #2081 0caad2f2
  and #2083 ec57e6f4, which they reopen unchanged): every ``"format"`` a ``TensorFormat`` StrEnum member (a real
  ``StrEnum`` registered under SkyRL's module name, so it pickles as ``REDUCE(TensorFormat, (value,))``);
  ``rollout_expert_indices`` (and ``rollout_sample_support``) a ``packed_tensor`` with ``numpy_view`` values (the
  array itself, in-band: protocol 4 or 5) and int32 ``cu_seqlens``; one segment of ``P_i + R_i`` rows per sample
  (captured rows, then ``[0..K-1]``), one dummy segment as long as segment 0 per DP pad row.
* verl (``verl/protocol.py`` at 1dda039b): ``pickle.dump(DataProto)`` = ``NEWOBJ`` + ``BUILD(__getstate__())`` with
  ``serialize_tensordict``'s triples (``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``) or torch.save bytes (default);
  layout of ``verl/experimental/agent_loop/agent_loop.py`` (left-padded prompts, right-padded responses, zero-filled
  int16 ``routed_experts``), in RolloutSkip's ``.../GBS{g}_N{n}_in{P}_out{R}/{step}/gen_batch.dp``.

Model: data/models/tiny-qwen3-moe (8 decoder layers, all MoE, 16 experts, top-2).
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import sys
import types
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "data" / "models" / "tiny-qwen3-moe" / "config.json"
E, K, LAYERS = 16, 2, 8
SKYRL_MODULE = "skyrl.backends.skyrl_train.training_batch"


@contextlib.contextmanager
def _fake_modules(dotted: str, **attrs):
    """Register ``dotted`` (and its parents) in sys.modules with ``attrs``, so pickle names them; removed after."""
    parts = dotted.split(".")
    names = [".".join(parts[:i + 1]) for i in range(len(parts))]
    added = [n for n in names if n not in sys.modules]
    for n in added:
        sys.modules[n] = types.ModuleType(n)
    for k, v in attrs.items():
        v.__module__ = dotted
        v.__qualname__ = k
        setattr(sys.modules[dotted], k, v)
    try:
        yield
    finally:
        for n in added:
            del sys.modules[n]


def routes(rng: np.random.Generator, rows: int) -> np.ndarray:
    """``[rows, LAYERS, K]`` distinct expert ids per row."""
    return np.argsort(rng.random((rows, LAYERS, E)), axis=2)[:, :, :K].astype(np.int64)


def _shape(rng: np.random.Generator, n: int, pmax: int = 6, rmax: int = 6, least: int = 2) -> list[tuple[int, int]]:
    """Prompt and response lengths; sample 1 (the multi-turn one) gets a response of at least 5 tokens."""
    out = [(int(rng.integers(least, pmax + 1)), int(rng.integers(least, rmax + 1))) for _ in range(n)]
    if n > 1:
        out[1] = (out[1][0], max(out[1][1], 5))
    return out


# ---- SkyRL ---------------------------------------------------------------------------------------------------------
def _serialize(arr: np.ndarray) -> dict:
    arr = np.ascontiguousarray(arr)
    return {"format": "numpy", "data": arr.tobytes(), "shape": arr.shape, "dtype": str(arr.dtype)}


def skyrl_batch(rng: np.random.Generator, samples: int, *, pad: int = 0, route_dtype=np.uint8, case: str = "clean",
                multi_turn: bool = True, least: int = 2) -> tuple[dict, list[dict]]:
    """One step's TrainingInputBatch state (as ``__getstate__`` returns it) and each real sample's truth."""
    import torch

    shapes = _shape(rng, samples, least=least)
    truth = []
    S, Rmax = max(p + r for p, r in shapes), max(r for _, r in shapes)
    B = samples + pad
    seq = np.zeros((B, S), np.int64)
    am = np.zeros((B, S), np.int64)
    rm = np.zeros((B, Rmax), np.int64)
    lm = np.zeros((B, Rmax), np.float32)
    lp_inf, lp_tr, adv = (np.zeros((B, Rmax), np.float32) for _ in range(3))
    rt = np.empty((B, S, LAYERS, K), route_dtype)
    rt[...] = np.arange(K, dtype=route_dtype)  # make_replay_padding_indices_np
    for i, (P, R) in enumerate(shapes):
        tok = rng.integers(4, 388, P + R)
        left = S - P - R
        seq[i, left:] = tok
        am[i, left:] = 1
        rm[i, Rmax - R:] = 1
        mask = np.ones(R, np.float32)
        if multi_turn and i % 3 == 1 and R >= 4:
            mask[1:3] = 0  # an environment observation inside the response
        lm[i, Rmax - R:] = mask
        li = -rng.random(R).astype(np.float32)
        lt = (li + 1e-3 * rng.standard_normal(R)).astype(np.float32)
        lp_inf[i, Rmax - R:], lp_tr[i, Rmax - R:] = li, lt
        a = rng.standard_normal(R).astype(np.float32)
        adv[i, Rmax - R:] = a
        captured = P + R - 1 - (1 if case == "short_capture" and i == 2 else 0)
        r = routes(rng, captured)
        rt[i, left:left + captured] = r.astype(route_dtype)
        truth.append({"tokens": tok, "P": P, "R": R, "loss_mask": mask, "logp_infer": li, "logp_train": lt,
                      "advantage": a, "routes": r, "captured": captured})
    cap_len = np.array([t["captured"] for t in truth] + [0] * pad)
    start = S - am.sum(axis=1)
    pos = np.arange(S)[None, :]
    rpm = ~((pos >= start[:, None]) & (pos < (start + cap_len)[:, None]))  # make_router_padding_mask
    for j in range(samples, B):  # pad_training_input_batch: copies of row 0, loss_mask 0, dummy routes, mask True
        for arr in (seq, am, rm, lp_inf, lp_tr, adv):
            arr[j] = arr[0]
        rpm[j] = True
    if case == "pre1908":  # before SkyRL #1908: zero-filled routes, no router_padding_mask
        rt[rpm] = 0
    fields = {"sequences": seq, "attention_mask": am, "response_mask": rm, "loss_mask": lm,
              "action_log_probs": lp_tr, "base_action_log_probs": lp_tr.copy(), "values": None, "returns": adv.copy(),
              "advantages": adv, "kl": np.zeros_like(adv), "rollout_logprobs": lp_inf, "rollout_expert_indices": rt,
              "router_padding_mask": None if case == "pre1908" else rpm, "pixel_values": None, "image_grid_thw": None}
    state = {"batch_dict": {k: None if v is None else _serialize(v) for k, v in fields.items()}, "batch_size": B,
             "device": torch.device("cpu"),
             "metadata": {"policy_mini_batch_boundaries": [(0, samples)], "policy_prompt_boundaries": [(0, samples)],
                          "response_length": Rmax, "avg_response_length": float(np.mean([r for _, r in shapes])),
                          "metrics": {"avg_final_rewards": 0.5, "avg_response_length": 4.0}, "pad_size": pad}}
    return state, truth


def _rebuild_tensor_batch(cls, state):  # never called: it only gives pickle a name to record
    raise RuntimeError("a generator stand-in")


class TrainingInputBatch:
    """Pickles as SkyRL's TrainingInputBatch does: ``(_rebuild_tensor_batch, (TrainingInputBatch, state))``."""

    def __init__(self, state: dict):
        self.state = state

    def __reduce__(self):
        return (_rebuild_tensor_batch, (TrainingInputBatch, self.state))


def skyrl_pickle(state: dict) -> bytes:
    with _fake_modules(SKYRL_MODULE, _rebuild_tensor_batch=_rebuild_tensor_batch,
                       TrainingInputBatch=TrainingInputBatch):
        return pickle.dumps(TrainingInputBatch(state))  # TensorBatch.save: pickle.dump(self, f), default protocol


def skyrl_dump(folder: str | Path, *, steps: int = 3, samples: int = 6, pad: int = 2, seed: int = 0,
               case: str = "clean") -> tuple[Path, dict[int, list[dict]]]:
    """``{folder}/dumped_data/global_step_N_training_input.pkl`` for N = 1..steps (uint8, int16, int32 routes)."""
    rng = np.random.default_rng(seed)
    d = Path(folder) / "dumped_data"
    d.mkdir(parents=True, exist_ok=True)
    truth = {}
    for n in range(1, steps + 1):
        dt = (np.uint8, np.int16, np.int32)[(n - 1) % 3]
        state, truth[n] = skyrl_batch(rng, samples, pad=pad if n != 2 else 0, route_dtype=dt, case=case)
        (d / f"global_step_{n}_training_input.pkl").write_bytes(skyrl_pickle(state))
    return Path(folder), truth


# ---- SkyRL packed (#2235/#2236/#2238, merged 2026-09-18) -----------------------------------------------------------
# training_batch.py at #2081's head 0caad2f2 (= #2236) and #2083's ec57e6f4 (= #2238): every "format" is a
# TensorFormat member; a PackedTensor field is {"format": PACKED_TENSOR, "values": _serialize_tensor(values,
# zero_copy), "cu_seqlens": _serialize_tensor(cu_seqlens)}; ZERO_COPY_KEYS fields serialize as {"format":
# NUMPY_VIEW, "data": the array}. preprocess.py _collate_rollout_expert_indices: segment i = P_i + R_i rows, the
# captured rows then replay_padding_row ([0..K-1]); make_router_padding_mask from the captured lengths;
# pad_training_input_batch: one dummy segment per pad row, as long as segment 0.
class TensorFormat(StrEnum):
    """SkyRL's ``TensorFormat`` (pickled as ``REDUCE(TensorFormat, (value,))`` under its module's name)."""

    NUMPY = "numpy"
    NUMPY_VIEW = "numpy_view"
    TORCH = "torch"
    TENSOR_LIST = "tensor_list"
    PACKED_TENSOR = "packed_tensor"


def _serialize_tf(arr: np.ndarray, zero_copy: bool = False, tf: Any = TensorFormat) -> dict:
    """``_serialize_tensor`` since #2235/#2236."""
    arr = np.ascontiguousarray(arr)
    if zero_copy:
        return {"format": tf.NUMPY_VIEW, "data": arr}
    return {"format": tf.NUMPY, "data": arr.tobytes(), "shape": arr.shape, "dtype": str(arr.dtype)}


def _cu_seqlens(lengths: list[int]) -> np.ndarray:
    cu = np.zeros(len(lengths) + 1, np.int32)  # cu_seqlens_from_lengths: int32
    cu[1:] = np.cumsum(lengths)
    return cu


def skyrl_packed_batch(rng: np.random.Generator, samples: int, *, pad: int = 0, route_dtype=np.uint8,
                       case: str = "clean", with_routes: bool = True, sample_support: bool = False,
                       pmax: int = 6, least: int = 2, zero_copy: bool = True) -> tuple[dict, list[dict]]:
    """One step's packed-layout TrainingInputBatch state and each real sample's truth.

    ``case``: ``clean`` (the batched generator: vLLM's P + R - 1 rows, the mask marks them), ``agent_loop``
    (RoutedExpertTrace.finalize pads the trace to P + R rows with dummy rows and the mask marks all of them
    captured; sample 2 ends in a 2-token observation the engine never evaluated), ``short_capture`` (sample 2 has
    P + R - 2 rows, the mask marks them)."""
    shapes = _shape(rng, samples, pmax=pmax, least=least)
    S, Rmax = max(p + r for p, r in shapes), max(r for _, r in shapes)
    B = samples + pad
    seq = np.zeros((B, S), np.int64)
    am = np.zeros((B, S), np.int64)
    rm = np.zeros((B, Rmax), np.int64)
    lm = np.zeros((B, Rmax), np.float32)
    lp_inf, lp_tr, adv = (np.zeros((B, Rmax), np.float32) for _ in range(3))
    dummy = np.arange(K, dtype=route_dtype)  # replay_padding_row
    segs, support, truth, mask_len = [], [], [], []
    for i, (P, R) in enumerate(shapes):
        tok = rng.integers(4, 388, P + R)
        left = S - P - R
        seq[i, left:] = tok
        am[i, left:] = 1
        rm[i, Rmax - R:] = 1
        mask = np.ones(R, np.float32)
        if i % 3 == 1 and R >= 4:
            mask[1:3] = 0
        if case == "agent_loop" and i == 2:
            mask[-2:] = 0  # the trailing observation: loss-masked, never evaluated by the engine
        lm[i, Rmax - R:] = mask
        li = -rng.random(R).astype(np.float32)
        lt = (li + 1e-3 * rng.standard_normal(R)).astype(np.float32)
        lp_inf[i, Rmax - R:], lp_tr[i, Rmax - R:] = li, lt
        a = rng.standard_normal(R).astype(np.float32)
        adv[i, Rmax - R:] = a
        captured = P + R - 1
        if case in ("short_capture", "agent_loop") and i == 2:
            captured = P + R - 1 - (1 if case == "short_capture" else 2)
        r = routes(rng, captured)
        seg = np.empty((P + R, LAYERS, K), route_dtype)
        seg[:] = dummy
        seg[:captured] = r.astype(route_dtype)
        segs.append(seg)
        mask_len.append(P + R if case == "agent_loop" else captured)  # what make_router_padding_mask is given
        sup = np.full((R, 4), -1, np.int32)
        for j in range(R):
            n = int(rng.integers(1, 5))
            sup[j, :n] = rng.choice(388, n, replace=False)
        support.append(sup)
        truth.append({"tokens": tok, "P": P, "R": R, "loss_mask": mask, "logp_infer": li, "logp_train": lt,
                      "advantage": a, "routes": r, "captured": captured})
    for j in range(samples, B):  # pad_training_input_batch
        for arr in (seq, am, rm, lp_inf, lp_tr, adv):
            arr[j] = arr[0]
        segs.append(np.broadcast_to(dummy, (len(segs[0]), LAYERS, K)).copy())
        support.append(np.full((len(support[0]), 4), -1, np.int32))
    start = S - am.sum(axis=1)
    cap_len = np.array(mask_len + [0] * pad)
    pos = np.arange(S)[None, :]
    rpm = ~((pos >= start[:, None]) & (pos < (start + cap_len)[:, None]))
    rpm[samples:] = True
    fields: dict[str, Any] = {"sequences": seq, "attention_mask": am, "response_mask": rm, "loss_mask": lm,
                              "rollout_logprobs": lp_inf, "rollout_expert_indices": None, "router_padding_mask": None}
    if with_routes:
        fields["rollout_expert_indices"] = ("packed", np.concatenate(segs), _cu_seqlens([len(s) for s in segs]))
        fields["router_padding_mask"] = rpm
    if sample_support:
        fields["rollout_sample_support"] = ("packed", np.concatenate(support),
                                            _cu_seqlens([len(s) for s in support]))
    fields.update({"pixel_values": None, "image_grid_thw": None, "action_log_probs": lp_tr,
                   "base_action_log_probs": lp_tr.copy(), "values": None, "returns": adv.copy(), "advantages": adv,
                   "kl": np.zeros_like(adv)})
    zc = {"rollout_expert_indices", "rollout_sample_support"} if zero_copy else set()  # ZERO_COPY_KEYS
    bd: dict[str, Any] = {}
    for k, v in fields.items():
        if v is None:
            bd[k] = None
        elif isinstance(v, tuple):
            bd[k] = {"format": TensorFormat.PACKED_TENSOR, "values": _serialize_tf(v[1], k in zc),
                     "cu_seqlens": _serialize_tf(v[2])}
        else:
            bd[k] = _serialize_tf(v, k in zc)
    import torch

    state = {"batch_dict": bd, "batch_size": B, "device": torch.device("cpu"),
             "metadata": {"uids": [f"p{i // 2}" for i in range(samples)] + [f"pad{i}" for i in range(pad)],
                          "policy_mini_batch_boundaries": [(0, samples)], "response_length": Rmax,
                          "avg_response_length": float(np.mean([r for _, r in shapes])), "pad_size": pad}}
    return state, truth


def skyrl_packed_pickle(state: dict, protocol: int = 4, tensor_format: Any = TensorFormat) -> bytes:
    """``TensorBatch.save`` of a packed-layout batch: protocol 4 (Python 3.11-3.13's default) or 5 (3.14's)."""
    with _fake_modules(SKYRL_MODULE, _rebuild_tensor_batch=_rebuild_tensor_batch,
                       TrainingInputBatch=TrainingInputBatch, TensorFormat=tensor_format):
        return pickle.dumps(TrainingInputBatch(state), protocol=protocol)


def skyrl_packed_dump(folder: str | Path, *, steps: int = 3, samples: int = 6, pad: int = 2, seed: int = 0,
                      protocol: int = 4, **kw) -> tuple[Path, dict[int, list[dict]]]:
    """``{folder}/dumped_data/global_step_N_training_input.pkl`` in the packed layout (uint8, int16, int32 routes);
    step 2 has no DP pad rows."""
    rng = np.random.default_rng(seed)
    d = Path(folder) / "dumped_data"
    d.mkdir(parents=True, exist_ok=True)
    truth = {}
    for n in range(1, steps + 1):
        dt = (np.uint8, np.int16, np.int32)[(n - 1) % 3]
        state, truth[n] = skyrl_packed_batch(rng, samples, pad=pad if n != 2 else 0, route_dtype=dt, **kw)
        (d / f"global_step_{n}_training_input.pkl").write_bytes(skyrl_packed_pickle(state, protocol))
    return Path(folder), truth


class TensorBatchPre1379(dict):
    """SkyRL's TensorBatch before #1379: a dict subclass pickled by default (NEWOBJ, torch tensors as items)."""


def skyrl_pre1379_pickle(rng: np.random.Generator, samples: int = 3) -> bytes:
    import torch

    state, _ = skyrl_batch(rng, samples)
    items = {k: torch.from_numpy(np.frombuffer(v["data"], v["dtype"]).reshape(v["shape"]).copy())
             for k, v in state["batch_dict"].items() if v is not None}
    with _fake_modules(SKYRL_MODULE, TrainingInputBatch=TensorBatchPre1379):
        return pickle.dumps(TensorBatchPre1379(items))


# ---- verl ----------------------------------------------------------------------------------------------------------
class DataProto:
    """Pickles as verl's DataProto dataclass does: ``NEWOBJ(DataProto)`` + ``BUILD(__getstate__())``."""

    def __init__(self, state: tuple):
        self._state = state

    def __getstate__(self):
        return self._state


def _serialize_single(arr: np.ndarray, torch_dtype: str):
    import torch

    a = np.ascontiguousarray(arr)
    return (torch_dtype, torch.Size(a.shape), a.reshape(-1).view(np.uint8))  # serialize_single_tensor


def verl_batch(rng: np.random.Generator, samples: int, Pmax: int = 8, Rmax: int = 8, *,
               numpy_serialization: bool = True, case: str = "clean", least: int = 2) -> tuple[tuple, list[dict]]:
    """One gen_batch DataProto state ``(batch, non_tensor_batch, meta_info)`` and each sample's truth."""
    import torch

    shapes = _shape(rng, samples, Pmax, Rmax, least)
    prompts = np.zeros((samples, Pmax), np.int64)
    responses = np.zeros((samples, Rmax), np.int64)
    am = np.zeros((samples, Pmax + Rmax), np.int64)
    rmask = np.zeros((samples, Rmax), np.int64)
    lp = np.zeros((samples, Rmax), np.float32)
    score = np.zeros((samples, Rmax), np.float32)
    rex = np.zeros((samples, Pmax + Rmax, LAYERS, K), np.int16)
    truth = []
    for i, (P, R) in enumerate(shapes):
        pt, rt_ = rng.integers(4, 388, P), rng.integers(4, 388, R)
        prompts[i, Pmax - P:] = pt
        responses[i, :R] = rt_
        am[i, Pmax - P:Pmax] = 1
        am[i, Pmax:Pmax + R] = 1
        m = np.ones(R, np.int64)
        if i % 3 == 1 and R >= 4:
            m[1:3] = 0  # a tool response inside the response (response_mask 0)
        rmask[i, :R] = m
        li = -rng.random(R).astype(np.float32)
        lp[i, :R] = li
        reward = float(i % 2)
        score[i, R - 1] = reward
        captured = P + R - 1 - (1 if case == "short_capture" and i == 2 else 0)
        r = routes(rng, captured)
        rex[i, Pmax - P:Pmax - P + captured] = r
        truth.append({"tokens": np.concatenate([pt, rt_]), "P": P, "R": R, "loss_mask": m, "logp_infer": li,
                      "reward": reward, "routes": r, "captured": captured})
    input_ids = np.concatenate([prompts, responses], axis=1)
    fields = {"prompts": (prompts, "int64"), "responses": (responses, "int64"), "response_mask": (rmask, "int64"),
              "input_ids": (input_ids, "int64"), "attention_mask": (am, "int64"),
              "position_ids": (np.clip(np.cumsum(am, axis=1) - 1, 0, None), "int64"),
              "rollout_log_probs": (lp, "float32"), "routed_experts": (rex, "int16"), "rm_scores": (score, "float32")}
    if numpy_serialization:
        batch = ((samples,), None, {k: _serialize_single(a, dt) for k, (a, dt) in fields.items()})
    else:  # the default: torch.save(TensorDict) bytes (here a dict of tensors; r3lab refuses the bytes either way)
        buf = io.BytesIO()
        torch.save({k: torch.from_numpy(np.ascontiguousarray(a)) for k, (a, _) in fields.items()}, buf)
        batch = buf.getvalue()
    uid = np.empty(samples, dtype=object)
    uid[:] = [f"uid-{i // 2}" for i in range(samples)]
    extras = np.empty(samples, dtype=object)
    extras[:] = [{"turns": 1 + i % 2} for i in range(samples)]
    non_tensor = {"__num_turns__": np.array([1 + i % 2 for i in range(samples)], dtype=np.int32), "uid": uid,
                  "extras": extras, "acc": np.array([float(i % 2) for i in range(samples)])}
    meta = {"metrics": [{"generate_sequences": 0.1, "num_preempted": -1}] * samples, "reward_extra_keys": ["acc"]}
    return (batch, non_tensor, meta), truth


def verl_pickle(state: tuple) -> bytes:
    with _fake_modules("verl.protocol", DataProto=DataProto):
        return pickle.dumps(DataProto(state))  # DataProto.save_to_disk: pickle.dump(self, f)


def verl_dump(folder: str | Path, *, steps: int = 3, samples: int = 6, seed: int = 0, numpy_serialization: bool = True,
              case: str = "clean") -> tuple[Path, dict[int, list[dict]]]:
    """``{folder}/exp_proj/GBS{s/2}_N2_in8_out8/{step}/gen_batch.dp`` + ``meta.json`` for steps 1..steps."""
    rng = np.random.default_rng(seed)
    run = Path(folder) / "exp_proj" / f"GBS{samples // 2}_N2_in8_out8"
    truth = {}
    for n in range(1, steps + 1):
        state, truth[n] = verl_batch(rng, samples, numpy_serialization=numpy_serialization, case=case)
        d = run / str(n)
        d.mkdir(parents=True, exist_ok=True)
        (d / "gen_batch.dp").write_bytes(verl_pickle(state))
        (d / "meta.json").write_text(json.dumps({"global_steps": n}))
    return Path(folder), truth


def large(kind: str, folder: str | Path, *, samples: int, steps: int = 8, seed: int = 0) -> Path:
    """A big dump (``samples`` over ``steps`` files) for the memory test, written one step at a time.

    Sequences of at least 8 tokens: on 2 + 2 tokens (3 route rows) random routes are constant on some layer in
    about 1 sample in 2000, which the import rightly leaves without routes."""
    rng = np.random.default_rng(seed)
    per = samples // steps
    for n in range(1, steps + 1):
        if kind in ("skyrl", "skyrl-packed"):
            d = Path(folder) / "dumped_data"
            d.mkdir(parents=True, exist_ok=True)
            if kind == "skyrl":
                state, _ = skyrl_batch(rng, per, pad=0, least=4)
                data = skyrl_pickle(state)
            else:
                state, _ = skyrl_packed_batch(rng, per, pad=0, least=4)
                data = skyrl_packed_pickle(state)
            (d / f"global_step_{n}_training_input.pkl").write_bytes(data)
        else:
            state, _ = verl_batch(rng, per, least=4)
            d = Path(folder) / "exp_proj" / "GBS1_N1_in8_out8" / str(n)
            d.mkdir(parents=True, exist_ok=True)
            (d / "gen_batch.dp").write_bytes(verl_pickle(state))
    return Path(folder)


class RunsCode:
    """A ``__reduce__`` payload: loading it with pickle.load calls ``builtins.open(marker, "w")``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "dumps")
    skyrl_dump(out / "skyrl")
    verl_dump(out / "verl")
    print(out)


def check_imported(run_path: Path, truth: dict[int, list[dict]], *, logp_train: bool, reward: bool,
                   advantage: bool) -> None:
    """An imported run holds what the generator wrote (``truth``: per step, each real sample's fields): steps, samples
    per step (DP pad rows dropped), tokens, engine log-probs, loss masks, and as asked trainer log-probs, rewards and
    advantages; routes where the capture covers ``P + R - 1`` rows, none where it is short."""
    from r3lab import runs
    from r3lab.importers import sample_tokens

    run = runs.load(run_path)
    assert run.finished and run.token_steps() == sorted(truth)
    for step, samples in truth.items():
        toks, full = run.tokens([step]), sample_tokens(run.path, step)
        assert len(full) == len(samples)  # DP pad rows dropped
        r = run.routes(step, "engine") if step in run.route_steps("engine") else None
        for i, s in enumerate(samples):
            t = toks[toks["sample"] == i]
            assert full[i].tolist() == s["tokens"].tolist()
            assert t["prompt_length"].iloc[0] == s["P"] and len(t) == s["R"]
            assert t["logp_infer"].to_numpy().tobytes() == s["logp_infer"].astype(np.float64).tobytes()
            assert t["loss_mask"].tolist() == s["loss_mask"].astype(int).tolist()
            if logp_train:
                assert t["logp_train"].to_numpy().tobytes() == s["logp_train"].astype(np.float64).tobytes()
            else:
                assert "logp_train" not in t
            if advantage:
                assert t["advantage"].to_numpy().tobytes() == s["advantage"].astype(np.float64).tobytes()
            if reward:
                assert t["reward"].iloc[0] == s["reward"]
            want = s["P"] + s["R"] - 1
            if s["captured"] >= want:
                assert r is not None and r.sequence(i).astype(np.int64).tolist() == s["routes"][:want].tolist()
            else:
                assert r is None or r.lengths[i] == 0  # a short capture: routes left out, never padded rows
