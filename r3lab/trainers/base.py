"""What a trainer does for the experiments, whatever runs it (transformers, Megatron-core on one or many ranks).

The drift experiment and the RL loop talk to a trainer only through :class:`Trainer`:

* ``score`` (:class:`Scorer`, all the drift experiment needs): log-probabilities of every sample's tokens
  after its prompt, with the trainer's own routing, replaying given routes (R2, R3), or recording the routes used;
* ``policy_step``: one clipped policy-gradient step (GRPO/PPO objective of :mod:`r3lab.trainers.loss`) on a
  mini-batch, optionally replaying routes in its forward and backward;
* ``export_weights``: the weights in the checkpoint's names and layout, what the engine's ``update_weights`` loads.

Inputs are plain: a :class:`TokenBatch` (token ids per sample, each sample's prompt length) and
:class:`~r3lab.routes.Routes`; outputs are numpy. Routes in and out follow the trainer's row convention
(``r3lab.metrics.TRAINER_ROWS``: one row per token, ``P + R`` per sample, global layer ids); the engine's
``P + R - 1`` rows become that with :func:`r3lab.rollout.append_last_row`. A multi-rank trainer slices the routes
for its ranks itself (``r3lab.slicing``) and returns the whole batch's values on the driver.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

import numpy as np

from r3lab.errors import BatchError
from r3lab.routes import Routes

__all__ = ["LoadsWeights"]


@dataclass(frozen=True)
class TokenBatch:
    """Samples to score: each sample's token ids (prompt then response) and its prompt length.

    Every token after the prompt is scored (token t from the logits at t - 1), sample by sample. ``width`` is the
    padded width a padded trainer uses (default: the longest sample); :meth:`take` keeps it, so a mini-batch is
    scored in the same shapes as its rows were in the whole batch (same shapes, same rounding).
    """

    sequences: tuple[tuple[int, ...], ...]
    prompt_lens: tuple[int, ...]
    width: int = 0

    def __post_init__(self) -> None:
        if not self.sequences:
            raise BatchError("a TokenBatch needs at least one sample")
        if len(self.prompt_lens) != len(self.sequences):
            raise BatchError(f"{len(self.prompt_lens)} prompt lengths for {len(self.sequences)} samples")
        for i, (q, p) in enumerate(zip(self.sequences, self.prompt_lens, strict=True)):
            if not 1 <= p < len(q):
                raise BatchError(f"sample {i}: prompt length {p} must be in [1, {len(q)}) (its token count)")
        longest = max(len(q) for q in self.sequences)
        if self.width == 0:
            object.__setattr__(self, "width", longest)
        elif self.width < longest:
            raise BatchError(f"width {self.width} is shorter than the longest sample ({longest} tokens)")

    @classmethod
    def from_ids(cls, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], width: int = 0) -> TokenBatch:
        return cls(tuple(tuple(int(t) for t in q) for q in sequences), tuple(int(p) for p in prompt_lens), width)

    @classmethod
    def from_results(cls, results: Sequence[Any]) -> TokenBatch:
        """The engine's samples (:class:`r3lab.rollout.RolloutResult`: ``prompt_ids`` + ``response_ids``)."""
        return cls.from_ids([list(r.prompt_ids) + list(r.response_ids) for r in results],
                            [len(r.prompt_ids) for r in results])

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def response_lengths(self) -> np.ndarray:
        """Scored tokens per sample (int64 ``[B]``)."""
        return np.array([len(q) - p for q, p in zip(self.sequences, self.prompt_lens, strict=True)], dtype=np.int64)

    @property
    def token_sample(self) -> np.ndarray:
        """The sample of every scored token (int64 ``[N]``, sample-major, the order of every token array)."""
        return np.repeat(np.arange(len(self)), self.response_lengths)

    def take(self, idx: Sequence[int]) -> TokenBatch:
        """The samples ``idx`` (in that order), at this batch's padded width."""
        return TokenBatch(tuple(self.sequences[int(i)] for i in idx), tuple(self.prompt_lens[int(i)] for i in idx),
                          self.width)


@dataclass(frozen=True)
class TrainerScores:
    """What :meth:`Trainer.score` returns; token arrays are flat over the scored tokens, sample-major."""

    logprobs: np.ndarray  # float64 log p(token t | tokens < t), computed in the trainer's dtype (fp32 logits)
    routes: Routes | None = None  # record=True: the ids its routers used, one sequence per sample, P + R rows
    entropy: np.ndarray | None = None  # entropy=True: float64 entropy of the distribution that scored each token


@dataclass(frozen=True)
class PolicyUpdate:
    """The clipped objective's inputs for one mini-batch, per scored token (sample-major, as ``TokenBatch``)."""

    old_logprobs: np.ndarray  # the old policy's log-probs (the ratio's denominator)
    advantages: np.ndarray  # each token's advantage (its sample's, for GRPO)
    infer_logprobs: np.ndarray  # the engine's log-probs (truncated importance sampling)
    clip_eps: float = 0.2  # the clip range of the ratio the loss clips (per token for grpo, per sample for gspo)
    tis_cap: float | None = None
    max_grad_norm: float = 1.0
    # optional, per scored token (default: every scored token counts with weight 1)
    loss_mask: np.ndarray | None = None  # bool: the tokens the loss averages over (multi-turn: sampled tokens only)
    token_weights: np.ndarray | None = None  # constant weight per token (the decoupled objective's truncated
    # behaviour -> proximal importance weight); multiplies the TIS weight when both are given

    loss: str = "grpo"  # the objective (r3lab.trainers.loss.LOSSES): grpo (token ratios) or gspo (sequence ratios)
    clip_eps_high: float | None = None  # the upper clip range when it differs from clip_eps (GSPO: 4e-4 over 3e-4)
    token_sample: np.ndarray | None = None  # per scored token, its sample in the mini-batch (gspo needs it)

    #: the fields that hold one value per scored token (what a slice of the mini-batch's tokens slices)
    PER_TOKEN: ClassVar[tuple[str, ...]] = ("old_logprobs", "advantages", "infer_logprobs", "loss_mask",
                                            "token_weights", "token_sample")

    def token_slices(self, idx: Any) -> dict[str, Any]:
        """Every per-token field (:data:`PER_TOKEN`, those set) at the tokens ``idx``: the fields of
        ``dataclasses.replace(update, **update.token_slices(idx))``, the update of those tokens only."""
        return {name: np.asarray(getattr(self, name))[idx] for name in self.PER_TOKEN
                if getattr(self, name) is not None}

    def __post_init__(self) -> None:
        n = np.shape(self.old_logprobs)
        for name in ("loss_mask", "token_weights"):
            v = getattr(self, name)
            if v is not None and np.shape(v) != n:
                raise BatchError(f"PolicyUpdate.{name} has shape {np.shape(v)}; the old log-probs have {n}")
        if self.loss_mask is not None and not np.asarray(self.loss_mask, dtype=bool).any():
            raise BatchError("PolicyUpdate.loss_mask masks out every token of the mini-batch")


@dataclass(frozen=True)
class PolicyStepStats:
    """One policy-gradient step: the loss and diagnostics, and the log-probs its forward computed (detached)."""

    loss: float
    clip_frac: float
    approx_kl: float
    grad_norm: float
    entropy: float
    tis_weight_mean: float | None
    logprobs: np.ndarray  # float64, the forward's log-probs before the step (the current policy)


@runtime_checkable
class Scorer(Protocol):
    """What the drift experiment needs of a trainer: scoring with native routing, replay, or recording.

    ``with scorer: ...`` closes it on the way out (also on exceptions); a class that subclasses this protocol
    inherits a ``close`` that does nothing and the context-manager methods.
    """

    name: str  # recorded in runs ("hf", "megatron-bridge", ...)
    batch_forward: bool  # score() runs a multi-sample batch as one forward (the drift experiment's trainer floor)

    def score(self, batch: TokenBatch, *, routes: Routes | None = None, record: bool = False,
              entropy: bool = False, weights: str | None = None) -> TrainerScores:
        """No-grad log-probs of the scored tokens; ``routes`` replays them, ``record`` returns the routes used;
        ``weights`` (``"stop"``/``"straight"``) also replays the routing weights ``routes`` carry (R3W)."""
        ...

    def close(self) -> None:
        """Release what the scorer holds (a multi-process trainer ends its ranks); idempotent. Default: nothing."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@runtime_checkable
class Trainer(Scorer, Protocol):
    """What the RL loop needs: a :class:`Scorer` that also takes policy steps and exports its weights."""

    def policy_step(self, batch: TokenBatch, update: PolicyUpdate, *, routes: Routes | None = None) -> PolicyStepStats:
        """Forward (replaying ``routes`` if given), the clipped loss, backward, gradient clip and optimizer step."""
        ...

    def export_weights(self) -> Mapping[str, Any]:
        """The weights under the checkpoint's names and shapes (detached CPU tensors), for ``update_weights``."""
        ...


@runtime_checkable
class LoadsWeights(Protocol):
    """Optional: a trainer (or scorer) that takes exported weights back, the inverse of ``export_weights``.

    The RL loop's matched-weights scoring (``old_logprobs="behaviour"``) keeps a second scorer of the trainer's kind
    and loads into it the snapshot the engine sampled with (the behaviour weights, verl's fully-async recompute,
    slime's ``--keep-old-actor``). Loading must be exact: ``export_weights`` afterwards gives the same tensors.
    """

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        """Replace this model's weights by ``weights`` (checkpoint names and layout, as ``export_weights`` gives)."""
        ...
