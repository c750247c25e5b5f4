"""The clipped policy-gradient objective (PPO/GRPO) per scored token, shared by every trainer.

``ratio = exp(logp - old)``; the loss is ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``, each token weighted
by ``min(pi_old / pi_engine, cap)`` with truncated importance sampling (as verl and slime apply it), averaged over
the mini-batch's tokens. Optional per-token inputs of :class:`~r3lab.trainers.base.PolicyUpdate`: ``loss_mask`` keeps
only the masked tokens (multi-turn: the sampled ones, never an observation), before anything else is computed;
``token_weights`` multiplies each token's loss by a constant (the decoupled objective's behaviour weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from r3lab.trainers.base import PolicyUpdate

__all__ = ["ClippedLoss", "clipped_policy_loss"]


@dataclass
class ClippedLoss:
    """The loss (with its graph) and what its diagnostics need."""

    loss: torch.Tensor
    ratio: torch.Tensor  # per token, with its graph
    tis_weight: torch.Tensor | None  # per token, when truncated importance sampling is on

    def stats(self, clip_eps: float) -> dict[str, float | None]:
        """Loss, clip fraction, approximate KL and the mean TIS weight, as floats."""
        with torch.no_grad():
            log_ratio = torch.log(self.ratio)
            return {"loss": float(self.loss),
                    "clip_frac": float(((self.ratio - 1).abs() > clip_eps).float().mean()),
                    "approx_kl": float(((self.ratio - 1) - log_ratio).mean()),
                    "tis_weight_mean": None if self.tis_weight is None else float(self.tis_weight.mean())}


def clipped_policy_loss(logprobs: torch.Tensor, update: PolicyUpdate) -> ClippedLoss:
    """The mean clipped objective over the tokens of ``logprobs`` (float32, on their device, with a graph)."""
    dev = logprobs.device
    keep = None if update.loss_mask is None else np.asarray(update.loss_mask, dtype=bool)
    if keep is not None:  # the loss sees the kept tokens only (the others may hold no engine log-prob at all)
        logprobs = logprobs[torch.as_tensor(keep).to(dev)]

    def tokens(a: np.ndarray) -> torch.Tensor:
        a = np.asarray(a)
        return torch.as_tensor(a if keep is None else a[keep], dtype=torch.float32).to(dev)

    old = tokens(update.old_logprobs)
    adv = tokens(update.advantages)
    ratio = torch.exp(logprobs - old)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - update.clip_eps, 1 + update.clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    w = None
    if update.tis_cap is not None:
        infer = tokens(update.infer_logprobs)
        w = torch.clamp(torch.exp(old - infer), max=update.tis_cap)
        per_token = per_token * w
    if update.token_weights is not None:
        tw = tokens(update.token_weights)
        w = tw if w is None else w * tw
        per_token = per_token * tw
    return ClippedLoss(per_token.mean(), ratio, w)
