"""prime-rl dumps in the layouts that came after 559b4477, written by code from the writers' source (never bytes).

The micro-batches are encoded by ``msgspec.msgpack`` from stand-in structs declared as the writers declare them
(``array_like=True, omit_defaults=True``: positional arrays, trailing defaults left out):

* ``MicroBatch`` / ``RoutedExperts`` / ``PayloadSegment`` as in PrimeIntellect-ai/prime-rl ``0f59b241``
  ``src/prime_rl/transports/batch/types.py`` and ``transports/payload.py`` (#3354's ``batches/`` folder,
  ``transports/batch/filesystem.py`` at ``6bc6e998``);
* ``RoutedExpertsV1``: #3509's ``RoutedExperts`` with ``weights``, ``valid`` and ``format_version`` in the order of
  ``transports/batch/routing.py``'s constructor calls at ``cec3a005``; its padding as ``pad_routed_experts``
  (spread ids, zero weights, ``valid`` 0), each sample's final row an invalid placeholder with zero weights
  (verifiers #2568: the unforwarded final sampled token);
* #3523's ``int32`` rows of width ``2 * top_k``: ids, then the FP32 bits of their weights (PR description).

The token export lines follow ``token_export.py`` at ``004274ec`` (``export_step``, ``run_id``, ``losses``,
``rewards``; per-run folder ``{out}/{run_id}/token_exports/``). :func:`prime_batches_dump` returns the folder to
import and the truth it wrote: per step, per exported line (rank order), the tokens, the reward, the route rows
``[0, len - 1)`` and their weights, or None where the sample's capture is incomplete.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

LAYERS, E, K = 8, 16, 2  # data/models/tiny-qwen3-moe: 8 decoder layers, all MoE, 16 experts, top-2
VOCAB = 388
_REQUEST = itertools.count()  # request numbers: one payload file per request


class RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]  # [seq_len, layers, topk]
    dtype: str


class RoutedExpertsV1(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]
    dtype: str
    weights: bytes | None = None
    valid: bytes | None = None
    format_version: int = 0


class PayloadSegment(msgspec.Struct, array_like=True, gc=False, frozen=True):
    field: str
    file: str
    offset: int
    pos: int
    rows: int
    dtype: str
    shape: list[int]


class MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: Any = None  # RoutedExperts, RoutedExpertsV1 (#3509) or None
    mm_refs: Any = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    sampling_mask: Any = None
    trace_ids: list[str] | None = None
    branch_indices: list[int] | None = None
    payload: list[PayloadSegment] | None = None


def _sample(rng: np.random.Generator, multi_turn: bool, reward: float | None) -> dict:
    P, R = int(rng.integers(3, 7)), int(rng.integers(5, 10))
    mask = [False] * P + [True] * R
    if multi_turn:  # a tool turn between two completions
        mask = [False] * P + [True] * 3 + [False] * 2 + [True] * (R - 3)
    n = len(mask)
    ids = np.argsort(rng.random((n, LAYERS, E)), axis=2)[:, :, :K].astype(np.uint8)
    w = rng.random((n, LAYERS, K)).astype(np.float32) + np.float32(0.05)
    w = (w / w.sum(axis=2, keepdims=True)).astype(np.float32)
    ids[-1], w[-1] = ids[-2], w[-2]  # verifiers pads the final (unforwarded) row with a copy of the one before
    adv = float(rng.normal())
    return {"ids": rng.integers(1, VOCAB, n).tolist(), "mask": mask, "routes": ids, "weights": w,
            "lp": [(-float(rng.exponential(1.0)) if m else 0.0) for m in mask],
            "adv": [adv if m else 0.0 for m in mask], "reward": reward, "valid": np.ones(n, bool)}


def _encode_routes(samples: list[dict], pad: int, mode: str) -> Any:
    ids = np.concatenate([s["routes"] for s in samples] + [np.zeros((pad, LAYERS, K), np.uint8)])
    w = np.concatenate([s["weights"] for s in samples] + [np.zeros((pad, LAYERS, K), np.float32)])
    shape = list(ids.shape)
    if mode == "inline":
        return RoutedExperts(ids.tobytes(), shape, "uint8")
    if mode == "trr":  # #3523: int32 [ids, fp32 weight bits], width 2 * top_k
        packed = np.concatenate([ids.astype(np.int32), w.view(np.int32)], axis=2)
        return RoutedExperts(packed.tobytes(), list(packed.shape), "int32")
    if mode in ("v1", "v1-bad-version"):
        valid = np.concatenate([s["valid"] for s in samples] + [np.zeros(pad, bool)])
        if pad:  # pad_routed_experts: ids spread over a valid range, zero weights, valid 0
            upper = max(K, int(ids.max()) + 1)
            ids[-pad:] = (np.arange(pad * LAYERS * K) % upper).astype(np.uint8).reshape(pad, LAYERS, K)
        return RoutedExpertsV1(ids.tobytes(), shape, "uint8", weights=w.astype("<f4").tobytes(),
                               valid=valid.astype(np.uint8).tobytes(),
                               format_version=2 if mode == "v1-bad-version" else 1)
    raise ValueError(mode)


def _payload(samples: list[dict], root: Path, gap: bool) -> list[PayloadSegment]:
    """One file per request under ``payload/`` (the inference server's shared root), each holding its rows
    ``[0, n - 1)`` (no row for the final position); segments shifted to micro-batch positions."""
    segs, pos = [], 0
    d = root / "payload"
    d.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(samples):
        n = len(s["ids"])
        rows = s["routes"][: n - 1]
        f = d / f"request-{next(_REQUEST)}.bin"
        head = np.zeros((3, LAYERS, K), np.uint8)  # another request's rows before this one's in the file
        f.write_bytes(head.tobytes() + rows.tobytes())
        keep = (n - 1) // 2 if gap and i == 0 else n - 1  # a capture that stopped early: rows left uncovered
        segs.append(PayloadSegment("routed_experts", str(f.resolve()), head.nbytes, pos, keep, "uint8", [LAYERS, K]))
        pos += n
    return segs


def prime_batches_dump(folder: str | Path, *, steps: int = 2, ranks: int = 2, micro_batches: int = 2,
                       per_pack: int = 2, seed: int = 0, routes: str | None = "inline", run_id: str | None = None,
                       export: str = "runs", trace: bool = True, invalid_row: bool = False,
                       payload_gap: bool = False) -> tuple[Path, dict[int, list[dict]]]:
    """prime-rl's folder after #3354: ``token_exports/step_S/rank_R.jsonl`` + ``STABLE`` and
    ``batches/step_S/rank_D.bin`` (in ``{folder}/{run_id}/`` when ``run_id``), with the routes ``routes`` says:
    ``"inline"`` (uint8 ``RoutedExperts``), ``"payload"`` (by handle: ``routed_experts`` nil, rows in
    ``payload/*.bin``), ``"trr"`` (#3523), ``"v1"`` (#3509; ``"v1-bad-version"``: format_version 2), or None.
    ``export``: ``"runs"`` (004274ec's keys) or ``"v1"`` (559b4477's). ``invalid_row``: with ``"v1"``, one row
    inside sample 0's ``P + R - 1`` rows of each rank's first micro-batch is invalid (valid 0, zero weights).
    ``payload_gap``: with ``"payload"``, the first sample of each micro-batch has only half its rows captured."""
    out = Path(folder) / run_id if run_id else Path(folder)
    rng = np.random.default_rng(seed)
    truth: dict[int, list[dict]] = {}
    for step in range(1, steps + 1):
        ex = out / "token_exports" / f"step_{step}"
        ex.mkdir(parents=True, exist_ok=True)
        bd = out / "batches" / f"step_{step}"
        bd.mkdir(parents=True, exist_ok=True)
        truth[step] = []
        for dp in range(ranks):
            packs = [[_sample(rng, (m + j) % 3 == 1, None if (m, j) == (1, 1) else float((m + j + dp) % 2))
                      for j in range(per_pack)] for m in range(micro_batches)]
            mbs, complete = [], []
            for m, p in enumerate(packs):
                if routes in ("v1", "v1-bad-version"):
                    for s in p:  # the final sampled token was never forwarded: an invalid placeholder row
                        s["valid"][-1] = False
                        s["weights"][-1] = 0.0
                    if invalid_row and m == 0:
                        s0 = p[0]
                        s0["valid"][2] = False
                        s0["weights"][2] = 0.0
                ids = [t for s in p for t in s["ids"]]
                lens = [len(s["ids"]) for s in p]
                pad = (8 - len(ids) % 8) % 8
                mb = MicroBatch(
                    input_ids=ids + [1] * pad, loss_mask=[x for s in p for x in s["mask"]] + [False] * pad,
                    advantages=[a for s in p for a in s["adv"]] + [0.0] * pad,
                    inference_logprobs=[x for s in p for x in s["lp"]] + [0.0] * pad,
                    position_ids=[i for s in p for i in range(len(s["ids"]))] + list(range(pad)),
                    sequence_lengths=lens[:-1] + [lens[-1] + pad], temperatures=[1.0] * (len(ids) + pad),
                    env_names=[e for s in p for e in ["gsm8k"] * len(s["ids"])] + [""] * pad,
                    seq_lens=lens[:-1] + [lens[-1] + pad])
                if routes == "payload":
                    mb.payload = _payload(p, out, payload_gap)
                elif routes is not None:
                    mb.routed_experts = _encode_routes(p, pad, routes)
                if trace:
                    mb.trace_ids = [f"trace-{step}-{dp}-{m}-{j}" for j in range(len(p))]
                    mb.branch_indices = list(range(len(p)))
                mbs.append(mb)
                for j, s in enumerate(p):
                    n = len(s["ids"])
                    ok = routes is not None and bool(s["valid"][: n - 1].all())
                    if routes == "payload" and payload_gap and j == 0:
                        ok = False
                    complete.append(ok)
            dummy = msgspec.structs.replace(mbs[0], loss_mask=[False] * len(mbs[0].loss_mask),
                                            advantages=[0.0] * len(mbs[0].advantages), trace_ids=None,
                                            branch_indices=None)
            mbs.append(dummy)  # the zero-loss dummy micro-batch: nothing exported
            (bd / f"rank_{dp}.bin").write_bytes(msgspec.msgpack.Encoder().encode(mbs))
            lines, k = [], 0
            for m, mb in enumerate(mbs):
                tr = [x + float(rng.normal(0, 0.02)) if on else -float(rng.exponential(2.0))
                      for x, on in zip(mb.inference_logprobs, mb.loss_mask, strict=True)]
                tr[0] = float(np.log(1.0 / VOCAB))
                start = 0
                for j, L in enumerate(mb.sequence_lengths):
                    raw_end = end = start + L
                    while end > start and mb.env_names[end - 1] == "" and not mb.loss_mask[end - 1]:
                        end -= 1
                    if end > start and any(mb.loss_mask[start:end]):
                        s = packs[m][j]
                        lines.append(_line(step, dp, m, j, len(lines), run_id, export, mb, tr, start, end, s))
                        n = end - start
                        truth[step].append({
                            "tokens": s["ids"], "reward": s["reward"], "rank": dp, "complete": complete[k],
                            "routes": s["routes"][: n - 1].astype(np.int64),
                            "weights": s["weights"][: n - 1].astype(np.float32)})
                        k += 1
                    start = raw_end
            with open(ex / f"rank_{dp}.jsonl", "w") as f:
                for rec in lines:
                    f.write(json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n")
        (ex / "STABLE").touch()
    return out, truth


def _line(step: int, rank: int, m: int, j: int, idx: int, run_id: str | None, export: str, mb: MicroBatch,
          tr: list[float], a: int, b: int, s: dict) -> dict:
    n = b - a
    rec: dict[str, Any] = {"schema_version": 1, "step": step + (100 if run_id else 0), "rank": rank, "micro_step": m,
                           "micro_sequence_idx": j, "export_sequence_idx": idx, "env_name": mb.env_names[a],
                           "token_ids": mb.input_ids[a:b], "position_ids": mb.position_ids[a:b],
                           "loss_mask": mb.loss_mask[a:b], "advantages": mb.advantages[a:b],
                           "inference_logprobs": mb.inference_logprobs[a:b], "trainer_logprobs": tr[a:b],
                           "entropy": [1.0] * n, "mismatch_kl": [0.0] * n}
    if export == "runs":  # 004274ec: export_step (the run's step: the folder), run_id, losses, rewards
        rec = {**{k: rec[k] for k in ("schema_version", "step")}, "export_step": step,
               **{k: rec[k] for k in ("rank", "micro_step", "micro_sequence_idx", "export_sequence_idx")},
               "run_id": run_id, **{k: v for k, v in rec.items() if k not in ("schema_version", "step", "rank",
                                                                                 "micro_step", "micro_sequence_idx",
                                                                                 "export_sequence_idx")}}
        rec["losses"] = [{"rl": {"advantage": v, "mask": bool(on)}} for v, on in
                         zip(mb.advantages[a:b], mb.loss_mask[a:b], strict=True)]
        rec["rewards"] = [s["reward"]] * n
    return rec
