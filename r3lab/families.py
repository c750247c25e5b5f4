"""What r3lab knows about each MoE model family, in one table: one :class:`ModelFamily` per ``model_type``.

Torch-free (a contract in pyproject.toml), so config readers, the layout rules and the build script share it.
A family entry holds:

* **config keys**: where the expert count lives (``experts_keys``, first key present wins), the top-k key, the MoE
  layer rule (``moe_layers``: which global layers have a routed block; dense layers are the rest);
* **router**: the transformers router class names and the gate-weight rule replay recomputes at replayed ids
  (``router_rule``, a name in :data:`ROUTER_RULE_NAMES`; :mod:`r3lab.replay.hf` holds the torch code per name);
* **group routing**: whether the family routes by expert groups (``n_group``/``topk_group``), with
  :func:`group_routing_mismatch` (a pure function of a config) and the one note text (:func:`group_routing_note`);
* **Megatron**: the TransformerConfig corrections mbridge's mapping needs for the family (``megatron_overrides``,
  merged by :func:`megatron_overrides`), or, for a family mbridge does not map, r3lab's own mapping
  (``mbridge_bridge``, a ``"module:Class"`` path under :mod:`r3lab.trainers.megatron.mbridge_bridges`);
* **tiny config**: the transformers config class and the keyword arguments of a tiny test model
  (``tiny_config``; :func:`r3lab.testing.tiny_moe_config` builds it).

How to add a family: ``docs/adding-a-model-family.md``. Another distribution adds one without editing r3lab by
entry point, in group ``r3lab.families``: the entry point's name is the ``model_type`` and its object the
:class:`ModelFamily` (:mod:`r3lab._plugins`); the group is read into :data:`FAMILIES` on its first lookup.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r3lab._plugins import PluginRegistry
from r3lab.errors import ConfigError, ModelConfigError

__all__ = [
    "ModelFamily",
    "TinyShape",
    "FAMILIES",
    "ROUTER_RULE_NAMES",
    "register_family",
    "family_of",
    "tiny_families",
    "group_routing_mismatch",
    "group_routing_note",
    "model_group_routing",
    "megatron_overrides",
]

Config = Mapping[str, Any]

#: the gate-weight rules replay knows (r3lab.replay.hf implements each, in torch): softmax gathered (renormalized
#: if norm_topk_prob), softmax gathered and always renormalized in fp32 (Mixtral), softmax over the gathered
#: logits (GPT-OSS), sigmoid gathered (DeepSeek-V3: normalized if norm_topk_prob, scaled)
ROUTER_RULE_NAMES = ("softmax", "softmax_renormalized", "softmax_of_topk", "sigmoid")


@dataclass(frozen=True)
class TinyShape:
    """The shared sizes of a tiny test model (:func:`r3lab.testing.tiny_moe_config`'s arguments)."""

    num_experts: int = 8
    top_k: int = 2
    moe_layers: int = 2
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 16
    max_position_embeddings: int = 64
    intermediate_size: int = 64
    moe_intermediate_size: int = 32


@dataclass(frozen=True)
class ModelFamily:
    """One ``model_type``: its config keys, MoE layer rule, router, group routing, Megatron corrections, tiny config."""

    model_type: str
    experts_keys: tuple[str, ...]  # the expert count: the first of these keys the config has
    moe_layers: Callable[[Config, int], tuple[int, ...]]  # (config, num_hidden_layers) -> MoE layer ids
    top_k_key: str = "num_experts_per_tok"
    strict_experts: bool = False  # the expert key must be an integer (else: missing or 0 reads as a dense model)
    router_classes: tuple[str, ...] = ()  # transformers router class names (replay and recording hook them)
    # transformers releases (of r3lab.replay.hf_api's checked ones) at which these routers return logits only and
    # their MoE block selects the experts ("split"); at every other checked release the router selects ("fused")
    router_split_releases: tuple[str, ...] = ()
    router_rule: str | None = None  # a name in ROUTER_RULE_NAMES
    group_routing: bool = False  # routes by expert groups (n_group / topk_group): see group_routing_mismatch
    megatron_overrides: Callable[[Config], dict[str, Any]] | None = None  # corrections of the bridges' config
    mbridge_bridge: str | None = None  # "module:Class" of r3lab's own mbridge bridge (mbridge has none)
    # "module:function" editing Megatron's local CPU block spec (block_spec -> block_spec) under Megatron-Bridge: the
    # family's own modules (e.g. OLMoE's full-width q/k norms); None: the local spec as it is
    megatron_spec_hook: str | None = None
    config_class: str | None = None  # the transformers config class of the tiny model
    architecture: str | None = None  # the transformers causal-LM class (config.architectures)
    tiny_config: Callable[[TinyShape], dict[str, Any]] | None = None  # keyword arguments of config_class

    def __post_init__(self) -> None:
        if self.router_rule is not None and self.router_rule not in ROUTER_RULE_NAMES:
            raise ConfigError(f"family {self.model_type!r}: router rule {self.router_rule!r} is not one of "
                              f"{ROUTER_RULE_NAMES}")
        if self.mbridge_bridge is not None and ":" not in self.mbridge_bridge:
            raise ConfigError(f"family {self.model_type!r}: mbridge_bridge must be 'module:Class', got "
                              f"{self.mbridge_bridge!r}")
        if self.megatron_spec_hook is not None and ":" not in self.megatron_spec_hook:
            raise ConfigError(f"family {self.model_type!r}: megatron_spec_hook must be 'module:function', got "
                              f"{self.megatron_spec_hook!r}")
        if (self.tiny_config is None) != (self.config_class is None):
            raise ConfigError(f"family {self.model_type!r}: a tiny config needs both config_class and tiny_config")

    def num_experts(self, cfg: Config, arch: str) -> int:
        """The routed expert count from the config (an error naming the key when it reads as a dense model)."""
        key = next((k for k in self.experts_keys if k in cfg), self.experts_keys[0])
        if self.strict_experts:
            v = cfg.get(key)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ModelConfigError(f"{arch}: config field {key!r} must be an integer, got {v!r}")
            return v
        e = int(cfg.get(key, 0) or 0)
        if e <= 0:
            raise ModelConfigError(f"{arch}: {key}={e}; a dense model")
        return e


def _plugin_family(name: str, family: Any) -> ModelFamily:
    """What an ``r3lab.families`` entry point loaded, checked: the :class:`ModelFamily` of ``model_type`` ``name``."""
    if not isinstance(family, ModelFamily):
        raise ConfigError(f"an r3lab.families entry point names a ModelFamily, got {family!r}")
    if family.model_type != name:
        raise ConfigError(f"its model_type is {family.model_type!r}: name the entry point after the model_type")
    return family


#: every family by ``model_type``: r3lab's own (:func:`register_family`), then those of the ``r3lab.families`` entry
#: points (read on the first lookup)
FAMILIES: PluginRegistry[ModelFamily] = PluginRegistry("r3lab.families", "model family", _plugin_family)


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to the table (one entry per ``model_type``)."""
    if FAMILIES.peek(family.model_type) is not None:  # peek: r3lab's own families register before plugins are read
        raise ConfigError(f"model family {family.model_type!r} is registered already (distribution "
                          f"{FAMILIES.origin(family.model_type)})")
    FAMILIES[family.model_type] = family
    return family


def family_of(model_type: str) -> ModelFamily | None:
    """The family of ``model_type``, or None when r3lab has no entry for it."""
    return FAMILIES.get(model_type)


def tiny_families() -> tuple[str, ...]:
    """The families with a tiny test config (the replay tests run each)."""
    return tuple(name for name, f in FAMILIES.items() if f.tiny_config is not None)


# ---- group routing -------------------------------------------------------------------------------------------
def group_routing_mismatch(cfg: Config) -> str | None:
    """Why Megatron-core routes this checkpoint differently from transformers/vLLM, or None if it does not.

    Megatron-core 0.16 (``moe_utils.group_limited_topk``) scores each expert group by the sum of its best
    ``top_k // topk_group`` scores; DeepSeek-V3-style routers (transformers, vLLM) by the sum of the best 2.
    They agree only when ``n_group <= 1``, ``topk_group >= n_group`` (no group is dropped) or
    ``top_k // topk_group == 2``. No Megatron setting changes the 2.
    """
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if n_group <= 1 or topk_group >= n_group or top_k // max(topk_group, 1) == 2:
        return None
    return (
        f"group-limited routing (n_group={n_group}, topk_group={topk_group}, top_k={top_k}): Megatron-core scores a "
        f"group by its best top_k // topk_group = {top_k // topk_group} expert score(s), transformers and vLLM by the "
        "sum of the best 2, so native routes differ by construction (replayed routes are unaffected)"
    )


def group_routing_note(model: str, why: str, affected: str) -> str:
    """The one sentence tables and run summaries print for a model :func:`group_routing_mismatch` names:
    ``affected`` says what the difference enters (``'Its "none" columns measure'``)."""
    return f"{model}: {why}. {affected} that difference between the implementations, not numerics; R3 is unaffected."


def model_group_routing(model_dir: str | Path) -> str | None:
    """:func:`group_routing_mismatch` of the checkpoint in ``model_dir`` (its config.json)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{model_dir} has no config.json")
    return group_routing_mismatch(json.loads(path.read_text()))


# ---- Megatron ------------------------------------------------------------------------------------------------
def megatron_overrides(cfg: Config) -> dict[str, Any]:
    """The TransformerConfig settings read from the checkpoint's config (any family), then the family's own.

    ``add_qkv_bias`` from ``attention_bias`` (mbridge hard-codes True for some families); the partial rotary
    factor and rope theta from ``rope_parameters`` (transformers 5 moved them there; mbridge reads the old
    attributes), as the private keys ``_rotary_percent`` / ``_rotary_base`` (GPTModel arguments, not config).
    """
    rope: Mapping[str, Any] = cfg.get("rope_parameters") or {}
    o: dict[str, Any] = {"add_qkv_bias": bool(cfg.get("attention_bias", cfg.get("qkv_bias", False)))}
    fam = family_of(str(cfg.get("model_type", "")))
    if fam is not None and fam.megatron_overrides is not None:
        o.update(fam.megatron_overrides(cfg))
    o["_rotary_percent"] = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    o["_rotary_base"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return o


def _qwen3_megatron(cfg: Config) -> dict[str, Any]:
    return {"add_qkv_bias": False}  # Qwen3 has no q/k/v bias (mbridge's qwen3_moe reads qkv_bias)


def _olmoe_megatron(cfg: Config) -> dict[str, Any]:
    """OLMoE's router: softmax then top-k, renormalized only if ``norm_topk_prob`` (``pre_softmax`` is the
    unrenormalized rule; Megatron-Bridge's ``OlMoEBridge`` sets it True whatever the checkpoint says). ``clip_qkv``
    has no Megatron counterpart and is refused."""
    if cfg.get("clip_qkv") is not None:
        raise ModelConfigError(f"OLMoE clip_qkv={cfg['clip_qkv']}: Megatron-core has no q/k/v clamp")
    return {"moe_router_pre_softmax": not bool(cfg.get("norm_topk_prob", False))}


def _deepseek_megatron(cfg: Config) -> dict[str, Any]:
    """The shared expert's width times ``n_shared_experts``, and the router's groups, which mbridge leaves unset."""
    o: dict[str, Any] = {}
    if cfg.get("n_shared_experts"):
        o["moe_shared_expert_intermediate_size"] = int(cfg["moe_intermediate_size"]) * int(cfg["n_shared_experts"])
    if int(cfg.get("n_group") or 1) > 1:
        o["moe_router_num_groups"] = int(cfg["n_group"])
        o["moe_router_group_topk"] = int(cfg["topk_group"])
    return o


# ---- MoE layer rules -----------------------------------------------------------------------------------------
def _sparse_step_layers(cfg: Config, n: int) -> tuple[int, ...]:
    """Qwen: every ``decoder_sparse_step``-th layer, less ``mlp_only_layers``."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(n) if i not in only and (i + 1) % step == 0)


def _first_dense_layers(cfg: Config, n: int) -> tuple[int, ...]:
    """DeepSeek: dense before ``first_k_dense_replace``, then every ``moe_layer_freq``-th layer."""
    first = int(cfg.get("first_k_dense_replace", 0) or 0)
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    return tuple(i for i in range(n) if i >= first and i % freq == 0)


def _every_layer(cfg: Config, n: int) -> tuple[int, ...]:
    return tuple(range(n))


# ---- tiny configs --------------------------------------------------------------------------------------------
def _base(s: TinyShape) -> dict[str, Any]:
    return dict(vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_attention_heads=s.num_attention_heads,
                max_position_embeddings=s.max_position_embeddings)


def _gqa(s: TinyShape) -> dict[str, Any]:
    return dict(_base(s), num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim)


def _kv(s: TinyShape) -> dict[str, Any]:  # families whose head_dim is hidden / heads
    return dict(_base(s), num_key_value_heads=s.num_key_value_heads)


def _routed(s: TinyShape) -> dict[str, Any]:
    return dict(num_hidden_layers=s.moe_layers, num_experts_per_tok=s.top_k)


def _sigmoid(s: TinyShape) -> dict[str, Any]:
    """DeepSeek-V3 routing: one leading dense layer, grouped sigmoid routers, a shared expert."""
    return dict(n_routed_experts=s.num_experts, num_experts_per_tok=s.top_k, n_group=2, topk_group=1,
                first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                num_hidden_layers=s.moe_layers + 1, intermediate_size=s.intermediate_size,
                moe_intermediate_size=s.moe_intermediate_size)


def _tiny_qwen3(s: TinyShape) -> dict[str, Any]:
    return dict(_gqa(s), **_routed(s), intermediate_size=s.intermediate_size,
                moe_intermediate_size=s.moe_intermediate_size, num_experts=s.num_experts, norm_topk_prob=True)


def _tiny_qwen2(s: TinyShape) -> dict[str, Any]:
    return dict(_kv(s), **_routed(s), intermediate_size=s.intermediate_size,
                moe_intermediate_size=s.moe_intermediate_size, shared_expert_intermediate_size=s.moe_intermediate_size,
                num_experts=s.num_experts, norm_topk_prob=False)


def _tiny_olmoe(s: TinyShape) -> dict[str, Any]:
    return dict(_kv(s), **_routed(s), intermediate_size=s.moe_intermediate_size, num_experts=s.num_experts)


def _tiny_mixtral(s: TinyShape) -> dict[str, Any]:
    return dict(_gqa(s), **_routed(s), intermediate_size=s.moe_intermediate_size, num_local_experts=s.num_experts)


def _tiny_gpt_oss(s: TinyShape) -> dict[str, Any]:
    """Alternating sliding (window 8) and full attention."""
    alternating = (["sliding_attention", "full_attention"] * (s.moe_layers // 2)
                   + ["sliding_attention"] * (s.moe_layers % 2))
    return dict(_gqa(s), **_routed(s), intermediate_size=s.moe_intermediate_size, num_local_experts=s.num_experts,
                layer_types=alternating, sliding_window=8)


def _tiny_deepseek_v3(s: TinyShape) -> dict[str, Any]:
    """MLA: ranks 16, rope/nope head dims 8, two KV heads."""
    mla = dict(num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
               v_head_dim=16)
    return dict(_base(s), **mla, **_sigmoid(s))


def _tiny_glm4(s: TinyShape) -> dict[str, Any]:
    return dict(_gqa(s), **_sigmoid(s))


# ---- the table -----------------------------------------------------------------------------------------------
# Router classes and rules checked against transformers 5.12.1 and 5.25.0 source (r3lab.replay.hf_api.CHECKED: at 5.12.1
# the GLM-4-MoE and DeepSeek-V3 routers return logits only and their MoE block selects); layer rules against each
# family's modeling file.
_QWEN_EXPERTS = ("num_experts", "num_local_experts")
register_family(ModelFamily(
    "qwen3_moe", _QWEN_EXPERTS, _sparse_step_layers, router_classes=("Qwen3MoeTopKRouter",), router_rule="softmax",
    megatron_overrides=_qwen3_megatron, config_class="Qwen3MoeConfig", architecture="Qwen3MoeForCausalLM",
    tiny_config=_tiny_qwen3))
register_family(ModelFamily(
    "qwen2_moe", _QWEN_EXPERTS, _sparse_step_layers, router_classes=("Qwen2MoeTopKRouter",), router_rule="softmax",
    config_class="Qwen2MoeConfig", architecture="Qwen2MoeForCausalLM", tiny_config=_tiny_qwen2))
register_family(ModelFamily("qwen3_next", _QWEN_EXPERTS, _sparse_step_layers))
register_family(ModelFamily("qwen3_vl_moe_text", _QWEN_EXPERTS, _sparse_step_layers))
register_family(ModelFamily(
    "olmoe", ("num_experts",), _every_layer, strict_experts=True, router_classes=("OlmoeTopKRouter",),
    router_rule="softmax", megatron_overrides=_olmoe_megatron,
    mbridge_bridge="r3lab.trainers.megatron.mbridge_bridges.olmoe:OlmoeBridge",
    megatron_spec_hook="r3lab.trainers.megatron.olmoe_qk_norm:olmoe_spec", config_class="OlmoeConfig",
    architecture="OlmoeForCausalLM", tiny_config=_tiny_olmoe))
register_family(ModelFamily(
    "mixtral", ("num_local_experts",), _every_layer, strict_experts=True, router_classes=("MixtralTopKRouter",),
    router_rule="softmax_renormalized", config_class="MixtralConfig", architecture="MixtralForCausalLM",
    tiny_config=_tiny_mixtral))
register_family(ModelFamily(
    "gpt_oss", ("num_local_experts",), _every_layer, strict_experts=True, router_classes=("GptOssTopKRouter",),
    router_rule="softmax_of_topk", config_class="GptOssConfig", architecture="GptOssForCausalLM",
    tiny_config=_tiny_gpt_oss))
for _name in ("phimoe", "granitemoe", "minimax"):
    register_family(ModelFamily(_name, ("num_local_experts",), _every_layer, strict_experts=True))
register_family(ModelFamily(
    "deepseek_v3", ("n_routed_experts",), _first_dense_layers, router_classes=("DeepseekV3TopkRouter",),
    router_split_releases=("5.12.1",),
    router_rule="sigmoid", group_routing=True, megatron_overrides=_deepseek_megatron, config_class="DeepseekV3Config",
    architecture="DeepseekV3ForCausalLM", tiny_config=_tiny_deepseek_v3))
register_family(ModelFamily(
    "glm4_moe", ("n_routed_experts",), _first_dense_layers, router_classes=("Glm4MoeTopkRouter",),
    router_split_releases=("5.12.1",),
    router_rule="sigmoid", group_routing=True, megatron_overrides=_deepseek_megatron, config_class="Glm4MoeConfig",
    architecture="Glm4MoeForCausalLM", tiny_config=_tiny_glm4))
for _name in ("deepseek_v2", "glm4_moe_lite", "kimi_k2", "glm_moe_dsa"):
    register_family(ModelFamily(_name, ("n_routed_experts",), _first_dense_layers, group_routing=True,
                                megatron_overrides=_deepseek_megatron))
del _name
