"""Megatron-LM routing-trace dumps written as ``RouterTracer`` writes them (NVIDIA/Megatron-LM@d98e8a64,
``megatron/core/transformer/moe/router_trace.py``), with the ground truth each import must give back.

:class:`Tracer` restates the writer: ``_make_index_record`` (key order ``step, stage, block, layer, rank,
num_tokens, topk, [mtp_idx]``), the logit sidecar (``logits_rank{R}.bin``, bf16 as int16 bytes, ``logit_offset``,
``logit_bytes``, ``logit_shape`` appended in that order), ``_flush_records_to_disk`` (``top_indices`` last,
``json.dumps`` per line) and ``flush`` (``torch.save`` of ``{(block, mtp_idx, layer): {...}}`` as
``router_state_rank{R}.pt``). The hook path's ids come from a boolean routing map through ``nonzero`` (ascending per
row); ``record_indices`` writes the ids as given (top-k order) with 1-based ``layer_number`` layer ids.

The truth (:class:`Truth`) is what the generator put in: picks per ``(step, block, mtp_idx, global layer)`` pooled over
ranks with activation recomputation's duplicate calls counted once, routing weight sums where logits were written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

E, K, L = 16, 2, 8  # data/models/tiny-qwen3-moe: 16 experts, top-2, 8 layers (all MoE)


def _bf16_bytes(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """float32 -> bf16 (round to nearest even) as the int16 bytes torch writes; and the bf16 values as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r.astype("<u2").tobytes(), (r.astype(np.uint32) << 16).view(np.float32)


@dataclass
class Truth:
    counts: dict[tuple[int, str, int, int], np.ndarray] = field(default_factory=dict)  # E + 1 wide (shifted ids)
    weights: dict[tuple[int, str, int, int], np.ndarray] = field(default_factory=dict)
    rows: int = 0
    steps: set[int] = field(default_factory=set)

    def add(self, step: int, block: str, mtp: int, layer: int, ids: np.ndarray, w: np.ndarray | None) -> None:
        key = (step, block, mtp, layer)
        self.counts[key] = self.counts.get(key, np.zeros(E + 1, np.int64)) + np.bincount(ids.ravel(), minlength=E + 1)
        if w is not None:
            self.weights[key] = self.weights.get(key, np.zeros(E)) + np.bincount(ids.ravel(), w.ravel(), minlength=E)
        self.rows += ids.shape[0]
        self.steps.add(step)


class Tracer:
    """One rank's ``RouterTracer`` output."""

    def __init__(self, out: Path, rank: int, *, logits: bool = False):
        self.out, self.rank = out, rank
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"router_trace_rank{rank}.jsonl"
        self.path.write_text("")
        self.logits_path = out / f"logits_rank{rank}.bin"
        self.offset = 0
        if logits:
            self.logits_path.write_bytes(b"")
        self.state: dict = {}

    def record(self, step: int, block: str, layer: int, ids: np.ndarray, *, mtp_idx: int | None = None,
               logits: np.ndarray | None = None) -> None:
        rec: dict = {"step": int(step), "stage": "pre_dispatch", "block": block, "layer": int(layer),
                     "rank": self.rank, "num_tokens": int(ids.shape[0]), "topk": int(ids.shape[1])}
        if mtp_idx is not None:
            rec["mtp_idx"] = int(mtp_idx)
        if logits is not None:
            raw, _ = _bf16_bytes(logits)
            with open(self.logits_path, "ab") as f:
                f.write(raw)
            rec["logit_offset"] = self.offset
            rec["logit_bytes"] = len(raw)
            rec["logit_shape"] = list(logits.shape)
            self.offset += len(raw)
        rec["top_indices"] = ids.astype(np.int32).tolist()
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def router_state(self, block: str, mtp_idx: int | None, layer: int, score_function: str) -> None:
        import torch

        self.state[(block, mtp_idx, layer)] = {"weight": torch.zeros(E, 4), "expert_bias": None,
                                               "score_function": score_function, "topk": K}

    def flush(self) -> None:
        if self.state:
            import torch

            torch.save(self.state, self.out / f"router_state_rank{self.rank}.pt")


def _hook_ids(rng: np.random.Generator, n: int, logits: np.ndarray | None = None) -> np.ndarray:
    """Top-k ids as the hook path writes them: a boolean routing map's ``nonzero`` columns, ascending per row."""
    scores = logits if logits is not None else rng.standard_normal((n, E))
    top = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    routing_map = np.zeros((n, E), bool)
    np.put_along_axis(routing_map, top, True, axis=1)
    _, cols = routing_map.nonzero()
    return cols.reshape(n, K)


def softmax_topk_weights(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    at = np.take_along_axis(logits.astype(np.float64), ids, axis=1)
    z = np.exp(at - at.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def training_trace(out: Path, *, seed: int = 0, steps: tuple[int, ...] = (3, 4), micro: int = 2, rows: int = 48,
                   drop: tuple[int, int, int, int] | None = None, dead: tuple[int, int] | None = None,
                   hot: int | None = None, shift: int | None = None) -> Truth:
    """The training hook path: PP 2 x DP 2 (ranks 0, 1 stage 0 with global layers 0-3; ranks 2, 3 stage 1 with 4-7,
    stage-local numbers 0-3), ``micro`` microbatches per iteration, ``step`` = the training iteration; the last
    stage's MTP head 0 (``block "mtp"``, ``mtp_idx`` 0, layer 0); layer 0 of each stage recomputed (a duplicate
    record); rank 0 with logits and a router state (softmax). Broken variants: ``drop`` = (step, rank, local layer,
    microbatch) whose record the top-k filter skipped; ``dead`` = (global layer, expert) never picked; ``hot`` = a
    global layer routing every row to expert 0; ``shift`` = a global layer whose ids are written one too high."""
    rng = np.random.default_rng(seed)
    truth = Truth()
    tracers = {r: Tracer(out, r, logits=r == 0) for r in range(4)}
    for s in steps:
        for r, tr in tracers.items():
            stage = r // 2
            for mb in range(micro):
                for local in range(4):
                    g = stage * 4 + local
                    lg = rng.standard_normal((rows, E)).astype(np.float32) if r == 0 else None
                    if lg is not None:
                        _, lg = _bf16_bytes(lg)  # what the file holds: the ids follow the bf16 logits
                    scores = lg if lg is not None else rng.standard_normal((rows, E)).astype(np.float32)
                    if dead is not None and g == dead[0]:
                        scores[:, dead[1]] = -1e4  # (on rank 0 the logits written say so too)
                    ids = _hook_ids(rng, rows, scores)
                    if hot is not None and g == hot:
                        ids = np.stack([np.zeros(rows, np.int64), rng.integers(1, E, rows)], axis=1)
                    if shift is not None and g == shift:
                        ids = ids + 1
                    if drop is not None and (s, r, local, mb) == drop:
                        continue  # RouterTracer._record returns: the call is not written
                    tr.record(s, "decoder", local, ids, logits=lg)
                    if local == 0:  # activation recomputation runs this router again: the same record twice
                        tr.record(s, "decoder", local, ids, logits=lg)
                    truth.add(s, "decoder", -1, g, ids, softmax_topk_weights(lg, ids) if lg is not None else None)
                if stage == 1:
                    ids = _hook_ids(rng, rows)
                    tr.record(s, "mtp", 0, ids, mtp_idx=0)
                    truth.add(s, "mtp", 0, 0, ids, None)
    for local in range(4):
        tracers[0].router_state("decoder", None, local, "softmax")
    for tr in tracers.values():
        tr.flush()
    return truth


def inference_trace(out: Path, *, seed: int = 1, steps: int = 5, tokens: int = 40,
                    mtp_collision: bool = False) -> Truth:
    """The inference recorder: one rank, ``record_indices(indices [T, layers, K], layer_ids=[layer_number...])``
    per decode step (``advance_step()``: steps 0, 1, ...), 1-based global layer numbers, ids in top-k order.
    ``mtp_collision``: an MTP router's replay instance among them with layer_number 1 (decoder layer 1's)."""
    rng = np.random.default_rng(seed)
    truth = Truth()
    tr = Tracer(out, 0)
    layer_ids = list(range(1, L + 1)) + ([1] if mtp_collision else [])
    for s in range(steps):
        idx = np.stack([rng.permutation(E)[:K] for _ in range(tokens * len(layer_ids))]).reshape(
            tokens, len(layer_ids), K)
        for i, lid in enumerate(layer_ids):  # record_indices: per_layer = indices[:, i, :]
            tr.record(s, "decoder", lid, idx[:, i, :])
            truth.add(s, "decoder", -1, lid - 1, idx[:, i, :], None)
    return truth
