"""What an engine does for the experiments, wherever it runs: :class:`Engine`.

The drift experiment, the RL loop and capture talk to an engine only through this protocol, whichever class it is:
:class:`~r3lab.rollout.RolloutEngine` (vLLM in this process), :class:`~r3lab.rollout.RolloutServer` (vLLM's server,
launched by r3lab on loopback), :class:`~r3lab.rollout.AttachedServer` (a server the user started) or
:class:`~r3lab.cluster.RayEngine` (a ``RolloutEngine`` in a Ray actor). Where the engine lives is decided once, by
:func:`r3lab.cluster.place`; code holding an ``Engine`` never asks which class it has.

* ``generate`` and ``score``: samples with their log-probs and validated routes, and the engine's prefill scores
  of given tokens (its noise floor);
* ``update_weights``: the trainer's weights loaded in place. An engine with no weight-update path r3lab drives says
  why in ``weights_refusal`` (None where it loads them), so a caller can refuse before any work; its
  ``update_weights`` raises :class:`~r3lab.errors.AttachError` with that reason;
* ``prefix_cache`` and ``facts``: what it can say about its prefix cache, and what a run records about it;
* ``close`` and the context manager: ``with engine: ...`` ends what it started (a server r3lab did not start is
  left running).

Every class is checked against this protocol by mypy (``r3lab/cluster/placement.py``; ``tests/test_typing.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, Self

import numpy as np

from r3lab.rollout.types import RolloutResult, SamplingConfig


class Engine(Protocol):
    """A rollout engine: sampling with routes, prefill scoring, weight updates (or a refusal that says why), close."""

    @property
    def model_dir(self) -> Path:
        """The local checkpoint whose MoE layout the routes match (the trainer's copy of the weights)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (text prompts are encoded with it, without special tokens)."""
        ...

    @property
    def engine_quant(self) -> str:
        """The simulated weight quantization r3lab applies (``"none"`` where it applies none)."""
        ...

    @property
    def captures_weights(self) -> bool:
        """Whether results' routes carry the routers' top-k weights beside the ids (R3W needs them)."""
        ...

    @property
    def weight_version(self) -> int:
        """The version of the weights it samples with (0: the checkpoint it started from)."""
        ...

    @property
    def weights_refusal(self) -> str | None:
        """None when ``update_weights`` loads weights; else which engine refuses and why, in words."""
        ...

    def generate(self, prompts: Sequence[str | Sequence[int]], sampling: SamplingConfig | None = None, *,
                 routes_prompt_start: int = 0) -> list[RolloutResult]:
        """``sampling.n`` samples per prompt, in prompt order then sample order; ``routes_prompt_start`` skips
        prompt rows already held from an earlier turn."""
        ...

    def score(self, sequences: Sequence[Sequence[int]], *, start: int | Sequence[int] = 1) -> list[np.ndarray]:
        """Per sequence, float32 ``log p(token t | tokens < t)`` for ``t`` in ``[start, len)`` (prefill)."""
        ...

    def update_weights(self, state_dict: Mapping[str, Any], *, version: int | None = None) -> int:
        """Load ``state_dict`` (checkpoint names and layout) in place; returns the new weight version."""
        ...

    def prefix_cache(self) -> dict[str, Any]:
        """``{"enabled": bool | None, "block_size": int | None}`` (None: the engine cannot say)."""
        ...

    def facts(self) -> dict[str, Any]:
        """Which engine this is, as a run's config records it (never a secret such as an API key)."""
        ...

    def close(self) -> None:
        """End what the engine started; idempotent."""
        ...

    def __enter__(self) -> Self:
        ...

    def __exit__(self, *exc: Any) -> None:
        ...
