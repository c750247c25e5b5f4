"""The clipped policy-gradient objectives, shared by every trainer: token-level GRPO/PPO and sequence-level GSPO.

``grpo`` (the default): ``ratio = exp(logp - old)`` per token; the loss is ``-min(ratio * A, clip(ratio, 1 - eps,
1 + eps) * A)``, averaged over the mini-batch's tokens.

``gspo`` (GSPO, arXiv 2507.18071): one ratio per sample, ``s_i = exp(mean_t(logp - old))`` (the geometric mean of
its token ratios), clipped as a whole with a small range (the paper: 3e-4 below, 4e-4 above) and multiplied by the
sample's advantage. It is written in the GSPO-token form verl uses: every token of sample i carries a term whose
value is ``s_i`` and whose gradient is ``s_i * grad logp_t`` (``exp(logp - sg(logp) + sg(log s_i))``), and the terms
are averaged per sample and then over samples. That equals GSPO's sequence objective in value and gradient, and
lets truncated importance sampling stay what it is for GRPO: a weight per token.

Either way each token's term is weighted by ``min(pi_old / pi_engine, cap)`` with truncated importance sampling (as
verl and slime apply it).

Optional per-token inputs of :class:`~r3lab.trainers.base.PolicyUpdate`: ``loss_mask`` keeps only the masked tokens
(multi-turn: the sampled ones, never an observation), before anything else is computed; ``token_weights`` multiplies
each token's term by a constant (the decoupled objective's behaviour weight).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from r3lab.config import LOSSES  # token-level ratio and clipping; sequence-level ratio and clipping
from r3lab.errors import BatchError, ConfigError
from r3lab.trainers.base import PolicyUpdate

__all__ = ["ClippedLoss", "clipped_policy_loss", "sequence_ratios"]


@dataclass
class ClippedLoss:
    """The loss (with its graph) and what its diagnostics need."""

    loss: torch.Tensor
    ratio: torch.Tensor  # per token, with its graph
    tis_weight: torch.Tensor | None  # per token, when truncated importance sampling is on
    clip_low: float | None = None  # the clip range the loss used (None: ask stats for it)
    clip_high: float | None = None
    seq_ratio: torch.Tensor | None = None  # gspo: per sample, the ratio that was clipped

    def stats(self, clip_eps: float | None = None) -> dict[str, float | None]:
        """Loss, clip fraction, approximate KL and the mean TIS weight, as floats.

        The clip fraction is the share of tokens (grpo) or of samples (gspo) whose ratio left the clip range;
        ``clip_eps`` (symmetric) overrides the range the loss used, which is the default.
        """
        lo = clip_eps if clip_eps is not None else self.clip_low
        hi = clip_eps if clip_eps is not None else self.clip_high
        if lo is None or hi is None:
            raise ConfigError("ClippedLoss.stats needs clip_eps: this loss did not record its clip range")
        with torch.no_grad():
            log_ratio = torch.log(self.ratio)
            clipped = self.ratio if self.seq_ratio is None else self.seq_ratio
            if lo == hi:
                frac = ((clipped - 1).abs() > lo).float().mean()
            else:
                frac = ((clipped < 1 - lo) | (clipped > 1 + hi)).float().mean()
            return {"loss": float(self.loss),
                    "clip_frac": float(frac),
                    "approx_kl": float(((self.ratio - 1) - log_ratio).mean()),
                    "tis_weight_mean": None if self.tis_weight is None else float(self.tis_weight.mean())}


def _token_sample(update: PolicyUpdate, n: int, dev: torch.device) -> tuple[torch.Tensor, int]:
    if update.token_sample is None:
        raise BatchError("the gspo loss needs PolicyUpdate.token_sample (each scored token's sample in the "
                          "mini-batch, as TokenBatch.token_sample)")
    idx = torch.as_tensor(update.token_sample, dtype=torch.long).to(dev)
    if idx.shape != (n,):
        raise BatchError(f"PolicyUpdate.token_sample has shape {tuple(idx.shape)}, the mini-batch scores {n} tokens")
    if n == 0 or int(idx.min()) < 0:
        raise BatchError("PolicyUpdate.token_sample must hold sample ids >= 0 for at least one token")
    samples = int(idx.max()) + 1
    if (torch.bincount(idx, minlength=samples) == 0).any():
        raise BatchError("PolicyUpdate.token_sample skips a sample id: every sample needs a scored token")
    return idx, samples


def sequence_ratios(logprobs: torch.Tensor, old_logprobs: torch.Tensor, token_sample: torch.Tensor,
                    samples: int) -> torch.Tensor:
    """GSPO's per-sample ratio ``exp(mean over the sample's tokens of (logp - old))`` (with ``logprobs``' graph)."""
    counts = torch.bincount(token_sample, minlength=samples).to(logprobs.dtype)
    mean_log = torch.zeros(samples, dtype=logprobs.dtype, device=logprobs.device).index_add(
        0, token_sample, logprobs - old_logprobs) / counts
    return torch.exp(mean_log)


def _gspo(logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, update: PolicyUpdate,
          lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token GSPO-token terms (value: the sample's clipped term), the per-sample ratio and each token's sample."""
    idx, samples = _token_sample(update, logprobs.numel(), logprobs.device)
    seq = sequence_ratios(logprobs, old, idx, samples)
    seq_adv = torch.zeros(samples, dtype=adv.dtype, device=adv.device).index_copy(0, idx, adv)
    if not torch.equal(seq_adv[idx], adv):
        raise BatchError("the gspo loss takes one advantage per sample: PolicyUpdate.advantages differ inside a "
                          "sample")
    # value s_i, gradient s_i * grad logp_t: GSPO-token (equal to GSPO when advantages are per sample)
    tok_ratio = torch.exp(logprobs - logprobs.detach() + torch.log(seq.detach())[idx])
    unclipped = tok_ratio * adv
    clipped = torch.clamp(tok_ratio, 1 - lo, 1 + hi) * adv
    return -torch.minimum(unclipped, clipped), seq, idx


def clipped_policy_loss(logprobs: torch.Tensor, update: PolicyUpdate) -> ClippedLoss:
    """The clipped objective ``update.loss`` over the tokens of ``logprobs`` (float32, on their device, with a graph).

    grpo: the mean over tokens; gspo: the mean over samples of each sample's mean over its tokens.
    """
    if update.loss not in LOSSES:
        raise ConfigError(f"PolicyUpdate.loss must be one of {LOSSES}, got {update.loss!r}")
    dev = logprobs.device
    keep = None if update.loss_mask is None else np.asarray(update.loss_mask, dtype=bool)
    if keep is not None:  # the loss sees the kept tokens only (the others may hold no engine log-prob at all)
        logprobs = logprobs[torch.as_tensor(keep).to(dev)]

    def tokens(a: np.ndarray) -> torch.Tensor:
        a = np.asarray(a)
        return torch.as_tensor(a if keep is None else a[keep], dtype=torch.float32).to(dev)

    if keep is not None and update.token_sample is not None:
        update = dataclasses.replace(update, token_sample=np.asarray(update.token_sample)[keep])
    old = tokens(update.old_logprobs)
    adv = tokens(update.advantages)
    lo = update.clip_eps
    hi = update.clip_eps if update.clip_eps_high is None else update.clip_eps_high
    ratio = torch.exp(logprobs - old)
    seq = None
    if update.loss == "grpo":
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1 - lo, 1 + hi) * adv
        per_token = -torch.minimum(unclipped, clipped)
    else:
        per_token, seq, idx = _gspo(logprobs, old, adv, update, lo, hi)
    w = None
    if update.tis_cap is not None:
        infer = tokens(update.infer_logprobs)
        w = torch.clamp(torch.exp(old - infer), max=update.tis_cap)
        per_token = per_token * w
    if update.token_weights is not None:
        tw = tokens(update.token_weights)
        w = tw if w is None else w * tw
        per_token = per_token * tw
    if seq is None:
        loss = per_token.mean()
    else:
        counts = torch.bincount(idx, minlength=seq.numel()).to(per_token.dtype)
        loss = (torch.zeros_like(seq).index_add(0, idx, per_token) / counts).mean()
    return ClippedLoss(loss, ratio, w, lo, hi, seq)
