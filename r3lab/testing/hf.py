"""transformers helpers for tests, benchmarks and the model build script: tiny MoE configs, expert relabelling."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import R3LabError
from r3lab.moe_layout import MoELayout

__all__ = ["MOE_FAMILIES", "tiny_moe_config", "permuted_experts"]

#: transformers ``model_type`` of every MoE family r3lab's replay hooks support.
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe")

_SIGMOID = ("deepseek_v3", "glm4_moe")  # DeepSeek-V3 routing: one leading dense layer, grouped sigmoid routers


def tiny_moe_config(
    family: str,
    *,
    num_experts: int = 8,
    top_k: int = 2,
    moe_layers: int = 2,
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    head_dim: int = 16,
    max_position_embeddings: int = 64,
    intermediate_size: int = 64,
    moe_intermediate_size: int = 32,
    **overrides: Any,
) -> Any:
    """A tiny transformers config of one MoE ``family`` (a ``model_type`` in :data:`MOE_FAMILIES`).

    ``moe_layers`` MoE decoder layers; DeepSeek-V3 and GLM-4-MoE get one leading dense layer more
    (``first_k_dense_replace=1``), grouped routing (``n_group=2, topk_group=1``), a shared expert,
    ``routed_scaling_factor=2.5`` and ``norm_topk_prob=True``. Expert FFNs are ``moe_intermediate_size``
    wide; dense FFNs ``intermediate_size``. Qwen3-MoE normalizes its top-k (``norm_topk_prob=True``),
    Qwen2-MoE does not and has a shared expert; GPT-OSS alternates sliding (window 8) and full attention;
    DeepSeek-V3 uses MLA (ranks 16, rope/nope head dims 8, two KV heads). ``overrides`` go to the config
    class last, so any field can be set.
    """
    import transformers as tf

    if family not in MOE_FAMILIES:
        raise R3LabError(f"unknown MoE family {family!r}; choose one of {list(MOE_FAMILIES)}")
    base = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
    )
    gqa = dict(base, num_key_value_heads=num_key_value_heads, head_dim=head_dim)
    sigmoid = dict(
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_hidden_layers=moe_layers + 1,
        intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
    )
    routed = dict(num_hidden_layers=moe_layers, num_experts_per_tok=top_k)
    ffns = dict(intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size)
    alternating = ["sliding_attention", "full_attention"] * (moe_layers // 2) + ["sliding_attention"] * (moe_layers % 2)
    mla = dict(
        num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16
    )
    kv = dict(base, num_key_value_heads=num_key_value_heads)  # families whose head_dim is hidden / heads
    cls, kw = {
        "qwen3_moe": (tf.Qwen3MoeConfig, dict(gqa, **routed, **ffns, num_experts=num_experts, norm_topk_prob=True)),
        "qwen2_moe": (
            tf.Qwen2MoeConfig,
            dict(
                kv,
                **routed,
                **ffns,
                shared_expert_intermediate_size=moe_intermediate_size,
                num_experts=num_experts,
                norm_topk_prob=False,
            ),
        ),  # fmt: skip
        "olmoe": (tf.OlmoeConfig, dict(kv, **routed, intermediate_size=moe_intermediate_size, num_experts=num_experts)),
        "mixtral": (
            tf.MixtralConfig,
            dict(gqa, **routed, intermediate_size=moe_intermediate_size, num_local_experts=num_experts),
        ),
        "gpt_oss": (
            tf.GptOssConfig,
            dict(
                gqa,
                **routed,
                intermediate_size=moe_intermediate_size,
                num_local_experts=num_experts,
                layer_types=alternating,
                sliding_window=8,
            ),
        ),  # fmt: skip
        "deepseek_v3": (tf.DeepseekV3Config, dict(base, **mla, **sigmoid)),
        "glm4_moe": (tf.Glm4MoeConfig, dict(gqa, **sigmoid)),
    }[family]
    kw.update(overrides)
    return cls(**kw)


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
