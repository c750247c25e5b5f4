"""transformers helpers for tests, benchmarks and the model build script: tiny MoE configs, expert relabelling."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import R3LabError
from r3lab.families import TinyShape, family_of, tiny_families
from r3lab.moe_layout import MoELayout

#: transformers ``model_type`` of every MoE family with a tiny config (r3lab.families: replay supports each).
MOE_FAMILIES = tiny_families()


def tiny_moe_config(family: str, *, num_experts: int = 8, top_k: int = 2, moe_layers: int = 2, vocab_size: int = 64,
                    hidden_size: int = 32, num_attention_heads: int = 2, num_key_value_heads: int = 1,
                    head_dim: int = 16, max_position_embeddings: int = 64, intermediate_size: int = 64,
                    moe_intermediate_size: int = 32, **overrides: Any) -> Any:
    """A tiny transformers config of one MoE ``family`` (a ``model_type`` in :data:`MOE_FAMILIES`).

    The family's entry in :mod:`r3lab.families` (``config_class``, ``tiny_config``) says what each family adds to
    the shared sizes: ``moe_layers`` MoE decoder layers; DeepSeek-V3 and GLM-4-MoE get one leading dense layer more
    (``first_k_dense_replace=1``), grouped routing (``n_group=2, topk_group=1``), a shared expert,
    ``routed_scaling_factor=2.5`` and ``norm_topk_prob=True``. Expert FFNs are ``moe_intermediate_size``
    wide; dense FFNs ``intermediate_size``. ``overrides`` go to the config class last, so any field can be set.
    """
    import transformers as tf

    spec = family_of(family)
    if spec is None or spec.tiny_config is None or spec.config_class is None:
        raise R3LabError(f"unknown MoE family {family!r}; choose one of {list(MOE_FAMILIES)}")
    shape = TinyShape(num_experts=num_experts, top_k=top_k, moe_layers=moe_layers, vocab_size=vocab_size,
                      hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                      num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                      max_position_embeddings=max_position_embeddings, intermediate_size=intermediate_size,
                      moe_intermediate_size=moe_intermediate_size)
    kw = spec.tiny_config(shape)
    kw.update(overrides)
    return getattr(tf, spec.config_class)(**kw)


def permuted_experts(model_dir: str | Path, layers: Sequence[int]) -> tuple[dict[str, Any], dict[str, Any], np.ndarray]:
    """A weight update that relabels the experts of ``layers`` and leaves the function unchanged.

    New expert e holds old expert ``perm[e]`` (router row, expert-score bias, expert MLP). For
    group-limited routers (``n_group > 1``) whole groups move, so group membership is preserved.
    Returns ``(update, original, perm)``: ``original`` holds the same keys with the checkpoint's
    values, to undo the update. Routes after the update are ``argsort(perm)[routes before]``.
    """
    import torch
    from safetensors.torch import load_file

    layout = MoELayout.from_model_dir(model_dir)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    E = layout.num_experts
    groups = int(cfg.get("n_group", 1) or 1)
    perm = np.roll(np.arange(E), E // groups if groups > 1 else 3)
    sd: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    p = torch.as_tensor(perm)
    new: dict[str, Any] = {}
    for g in layers:
        if g not in layout.moe_layer_ids:
            raise R3LabError(f"layer {g} is not an MoE layer ({list(layout.moe_layer_ids)})")
        pre = f"model.layers.{g}.mlp."
        new[pre + "gate.weight"] = sd[pre + "gate.weight"][p]
        if pre + "gate.e_score_correction_bias" in sd:
            new[pre + "gate.e_score_correction_bias"] = sd[pre + "gate.e_score_correction_bias"][p]
        for e in range(E):
            for w in ("gate_proj", "up_proj", "down_proj"):
                new[f"{pre}experts.{e}.{w}.weight"] = sd[f"{pre}experts.{int(perm[e])}.{w}.weight"]
    return new, {k: sd[k] for k in new}, perm
