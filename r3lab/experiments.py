"""Experiments: join capture (rollout) and replay (trainer) to measure what R3 changes.

``replay_drift`` scores a transformers trainer against the engine on the engine's own samples,
without replay and with the engine's routes replayed (R3), per token, so the drift can be split
into tokens whose routing flipped between engine and trainer and tokens where it agreed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from r3lab import metrics
from r3lab.replay import hf_replay
from r3lab.rollout import RolloutResult, append_last_row

__all__ = ["DriftSample", "trainer_logprobs", "replay_drift", "drift_summary"]


@dataclass(frozen=True)
class DriftSample:
    """Per response token of one sample: engine and trainer log-probabilities and whether routing flipped."""

    logp_infer: np.ndarray
    logp_none: np.ndarray  # trainer, its own routing
    logp_r3: np.ndarray  # trainer, replaying the engine's routes
    flipped: np.ndarray  # the token's input position was routed differently in some layer


def trainer_logprobs(model, token_ids: Sequence[int], prompt_len: int, routes=None, *, record: bool = False):
    """Log-probabilities a transformers model gives the response tokens, optionally replaying ``routes``.

    With ``record=True`` also returns the trainer's own routes (``Routes``) of that forward.
    """
    import torch

    ids = torch.tensor([list(token_ids)])
    mode = "record" if record else "replay"
    with torch.no_grad(), hf_replay(model, routes if not record else None, mode=mode) as ctx:
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    targets = ids[0, prompt_len:]
    out = lp[prompt_len - 1 : ids.shape[1] - 1].gather(1, targets[:, None])[:, 0].numpy().astype(np.float64)
    return (out, ctx.to_routes()) if record else out


def replay_drift(model, results: Sequence[RolloutResult]) -> list[DriftSample]:
    """Score every sample without replay and with R3; flips are set-based, on the token's input position."""
    samples = []
    for r in results:
        ids = list(r.prompt_ids) + list(r.response_ids)
        P = len(r.prompt_ids)
        engine_routes = append_last_row(r.routes)  # the last sampled token has no engine row
        logp_none, own = trainer_logprobs(model, ids, P, record=True)
        logp_r3 = trainer_logprobs(model, ids, P, engine_routes)
        flips = metrics.token_route_flips(engine_routes.values, own.select_layers(engine_routes.layer_ids).values)
        samples.append(DriftSample(np.asarray(r.logprobs, dtype=np.float64), logp_none, logp_r3, flips[P - 1 : len(ids) - 1]))
    return samples


def drift_summary(samples: Sequence[DriftSample]) -> dict[str, float]:
    """k3 KL without replay and with R3, overall and split by routed-flipped vs agreeing tokens."""
    inf = np.concatenate([s.logp_infer for s in samples])
    none = np.concatenate([s.logp_none for s in samples])
    r3 = np.concatenate([s.logp_r3 for s in samples])
    flip = np.concatenate([s.flipped for s in samples])
    out = {"tokens": int(inf.size), "flipped_share": float(flip.mean()),
           "k3_none": metrics.k3_kl(none, inf), "k3_r3": metrics.k3_kl(r3, inf)}
    for name, m in (("flipped", flip), ("agreeing", ~flip)):
        if m.any():
            out[f"k3_{name}_none"] = metrics.k3_kl(none[m], inf[m])
            out[f"k3_{name}_r3"] = metrics.k3_kl(r3[m], inf[m])
    return out
