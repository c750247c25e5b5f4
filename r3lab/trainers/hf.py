"""The transformers trainer: one model, AdamW, routing replay through :mod:`r3lab.replay` (its hooks).

Scoring is :func:`r3lab.replay.score_batch` over a right-padded batch (:func:`padded_batch`); a one-sample batch
runs the plain causal forward, as :func:`r3lab.replay.hf_token_logprobs` does. Weights go back to the engine in the
checkpoint's names (``revert_weight_conversion``: transformers 5 fuses each MoE block's experts on load).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from r3lab.errors import ConfigError
from r3lab.replay import load_hf_model, remove_router_casts, score_batch
from r3lab.routes import Routes
from r3lab.trainer_registry import TrainerOptions
from r3lab.trainers.base import PolicyStepStats, PolicyUpdate, TokenBatch, Trainer, TrainerScores
from r3lab.trainers.loss import clipped_policy_loss

__all__ = ["HFTrainer", "padded_batch"]


def padded_batch(batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch right-padded to ``batch.width``: ``ids [B, S]``, ``attention_mask``, and ``response`` (True where
    position t holds a scored token, scored from the logits at t - 1)."""
    ids = torch.zeros((len(batch), batch.width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    response = torch.zeros_like(ids, dtype=torch.bool)
    for b, (q, p) in enumerate(zip(batch.sequences, batch.prompt_lens, strict=True)):
        ids[b, : len(q)] = torch.tensor(q)
        mask[b, : len(q)] = 1
        response[b, p : len(q)] = True
    return ids, mask, response


def _numpy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().double().cpu().numpy()


class HFTrainer(Trainer):
    """A transformers causal LM as a :class:`~r3lab.trainers.base.Trainer` (``lr`` given: with AdamW, in train mode)."""

    name = "hf"
    batch_forward = True  # score() runs a multi-sample batch as one padded forward
    records_weights = True  # score(record=True, record_weights=True): the routers' own top-k weights too

    def __init__(self, model: torch.nn.Module, *, lr: float | None = None):
        self.model = model
        self.optimizer = None
        if lr is not None:
            model.train()
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    @classmethod
    def load(cls, path: str | os.PathLike, dtype: str = "float32", *, router_dtype: str = "float32",
             lr: float | None = None) -> HFTrainer:
        """The checkpoint in ``dtype``; a bf16 model keeps fp32 routers unless ``router_dtype="bfloat16"``."""
        model = load_hf_model(path, dtype)
        if router_dtype == "bfloat16":
            remove_router_casts(model)  # routers back in the checkpoint's own dtype (GLM keeps its fp32 bias)
        return cls(model, lr=lr)

    def score(self, batch: TokenBatch, *, routes: Routes | None = None, record: bool = False,
              entropy: bool = False, weights: str | None = None, record_weights: bool = False) -> TrainerScores:
        """:meth:`Scorer.score <r3lab.trainers.base.Scorer.score>`; ``record_weights`` (with ``record``, native
        routing): the recorded routes carry the routers' own top-k weights (the RL loop's router drift)."""
        s = score_batch(self.model, *padded_batch(batch), routes=routes, record=record, entropy=entropy,
                        weights=weights, record_weights=record_weights)
        return TrainerScores(_numpy(s.logprobs), s.routes, _numpy(s.entropy))

    def policy_step(self, batch: TokenBatch, update: PolicyUpdate, *, routes: Routes | None = None,
                    weights: str | None = None) -> PolicyStepStats:
        if self.optimizer is None:
            raise ConfigError("this HFTrainer has no optimizer: build it with lr=... to take policy steps")
        cur = score_batch(self.model, *padded_batch(batch), routes=routes, grad=True, entropy=True, weights=weights)
        loss = clipped_policy_loss(cur.logprobs, update)
        self.optimizer.zero_grad(set_to_none=True)
        loss.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), update.max_grad_norm)
        self.optimizer.step()
        stats = loss.stats()  # the clip range the loss used (per sample for gspo)
        with torch.no_grad():
            entropy = float(cur.entropy.mean())
        return PolicyStepStats(loss=stats["loss"], clip_frac=stats["clip_frac"], approx_kl=stats["approx_kl"],
                               grad_norm=float(grad_norm), entropy=entropy,
                               tis_weight_mean=stats["tis_weight_mean"], logprobs=_numpy(cur.logprobs))

    def export_weights(self) -> Mapping[str, Any]:
        """Detached CPU copies in the checkpoint's layout and names (per-expert ``gate_proj``/``up_proj``/...)."""
        from transformers.core_model_loading import revert_weight_conversion

        state = {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}
        return revert_weight_conversion(self.model, state)

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        """The inverse of :meth:`export_weights` (:class:`~r3lab.trainers.base.LoadsWeights`): checkpoint names and
        layout converted as ``from_pretrained`` converts them, copied into the parameters in their own dtypes (a bf16
        model's fp32 routers stay fp32). Exact: exporting again gives the same tensors."""
        state = _to_model_layout(self.model, weights)
        with torch.no_grad():
            result = self.model.load_state_dict(state, strict=True)
        if result.missing_keys or result.unexpected_keys:  # strict=True raises first; kept for older torch
            raise ConfigError(f"load_weights: missing {result.missing_keys}, unexpected {result.unexpected_keys}")


def _to_model_layout(model: torch.nn.Module, weights: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors in the model's own names and layout (transformers 5's load-time conversions, e.g.
    per-expert ``gate_proj``/``up_proj`` fused into ``experts.gate_up_proj``): what ``revert_weight_conversion``
    undoes, applied forward."""
    from copy import deepcopy

    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key

    def apply_renamings(key: str, renamings: list[Any]) -> str:  # every renaming in turn (as from_pretrained)
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
        return key

    def apply_converters(key: str, converters: list[Any]) -> tuple[str, str | None]:  # at most one converter
        for converter in converters:
            target, pattern = converter.rename_source_key(key)
            if pattern is not None:
                return target, pattern
        return key, None

    # transformers 5.25 names these two loops (core_model_loading.apply_renamings/apply_converters); 5.12.1 inlines
    # them in rename_source_key: the objects' own rename_source_key is in both
    conversions = getattr(model, "_weight_conversions", None) or []
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {k: c for c in converters for k in c.source_patterns}
    pending: dict[str, Any] = {}
    for key, tensor in sorted(weights.items(), key=lambda kv: dot_natural_key(kv[0])):
        target, pattern = apply_converters(key, converters)
        if pattern is not None:
            conv = pending.setdefault(target, deepcopy(by_pattern[pattern]))
        else:
            target, pattern = apply_renamings(key, renamings), key
            conv = pending.setdefault(target, WeightRenaming(key, target))
        conv.add_tensor(target, key, pattern, tensor)
    out: dict[str, torch.Tensor] = {}
    for first, conv in pending.items():
        for name, value in conv.convert(first, model=model, config=model.config).items():
            value = value[0] if isinstance(value, list) else value
            out[apply_renamings(name, renamings) if isinstance(conv, WeightConverter) else name] = value
    return out


def load(path: str | os.PathLike, options: TrainerOptions) -> HFTrainer:
    """The registry's loader (``trainer="hf"``, :mod:`r3lab.trainer_registry`): :meth:`HFTrainer.load`."""
    kw: dict[str, Any] = {"lr": options.lr}
    if options.router_dtype is not None:
        kw["router_dtype"] = options.router_dtype
    return HFTrainer.load(path, options.dtype, **kw)
