"""OLMoE (``OlmoeForCausalLM``) as a Megatron-core GPTModel: r3lab's mapping (mbridge 0.15.1 has none).

What OLMoE is, read in transformers 5.24 ``models/olmoe/modeling_olmoe.py`` and vLLM 0.30
``model_executor/models/olmoe.py``, and what each part becomes in Megatron-core 0.16.1:

* **names**: OLMoE's checkpoint names are Qwen3-MoE's (``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``,
  ``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``, no shared expert), so the name and format mapping is
  mbridge's ``Qwen2MoEBridge`` (``mbridge/models/qwen2moe.py``: q/k/v and gate/up fusion, TP split and merge),
  whose shared-expert entries never match here;
* **router**: ``OlmoeTopKRouter`` takes the softmax over all experts, then the top-k of those probabilities, and
  renormalizes them only if ``norm_topk_prob`` (False in OLMoE's checkpoints; vLLM's ``OlmoeMoE`` passes
  ``renormalize=False`` always). In Megatron's ``topk_routing_with_score_function`` (``moe_utils.py``) that is
  ``moe_router_score_function="softmax"`` with ``moe_router_pre_softmax=True`` (softmax, then top-k: the gathered
  probabilities, not renormalized); ``pre_softmax=False`` is top-k of the logits then a softmax over them, which
  is the renormalized rule (``norm_topk_prob=True``). No ``moe_router_topk_scaling_factor``, no expert bias, no
  groups. Under ``RouterReplay`` the replayed ids gather the same softmax scores;
* **qk-norm over all heads**: ``OlmoeAttention`` normalizes the whole projection (``q_norm`` is ``hidden_size``
  wide, ``k_norm`` ``head_dim * num_key_value_heads``) before splitting it into heads; Megatron's
  ``qk_layernorm`` normalizes each head (``hidden_size_per_attention_head`` wide). OLMoE's q/k norms
  (:mod:`r3lab.trainers.megatron.olmoe_qk_norm`, shared with the Megatron-Bridge loader; :func:`olmoe_spec`)
  replace Megatron's q/k layernorm modules: one RMS over every head of a token, all-reduced over tensor-parallel
  ranks, the weight TP-sharded along its only dimension (mbridge's generic split and merge rules apply);
* **experts**: ``intermediate_size`` is the expert FFN width (OLMoE has no dense FFN and no
  ``moe_intermediate_size``); ``clip_qkv`` (None in OLMoE's checkpoints) has no Megatron counterpart and is refused.
"""

from __future__ import annotations

from typing import Any

from r3lab.errors import MegatronLoadError
from r3lab.trainers.megatron.mbridge_api import PINNED
from r3lab.trainers.megatron.olmoe_qk_norm import olmoe_spec

try:
    from mbridge.models.qwen2moe import Qwen2MoEBridge
except ImportError as e:  # this module is imported only to load an OLMoE checkpoint into Megatron
    raise MegatronLoadError(f"OLMoE's Megatron mapping reuses mbridge's Qwen2-MoE names: pip install --no-deps "
                            f"{PINNED}") from e

__all__ = ["OlmoeBridge"]


class OlmoeBridge(Qwen2MoEBridge):
    """mbridge's Qwen2-MoE name mapping with OLMoE's TransformerConfig and layer spec (module docstring)."""

    def _build_config(self):
        hf = self.hf_config
        if getattr(hf, "clip_qkv", None) is not None:
            raise MegatronLoadError(f"OLMoE clip_qkv={hf.clip_qkv}: Megatron-core has no q/k/v clamp")
        return self._build_base_config(
            use_cpu_initialization=False,
            moe_ffn_hidden_size=hf.intermediate_size,
            moe_router_topk=hf.num_experts_per_tok,
            num_moe_experts=hf.num_experts,
            moe_aux_loss_coeff=hf.router_aux_loss_coef,
            moe_router_load_balancing_type="none",
            moe_grouped_gemm=True,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not bool(hf.norm_topk_prob),  # softmax, then top-k: not renormalized
            qk_layernorm=True,
            add_qkv_bias=bool(getattr(hf, "attention_bias", False)),
            persist_layer_norm=True,
            bias_activation_fusion=True,
            bias_dropout_fusion=True,
        )

    def local_spec_hook(self, block_spec: Any) -> Any:
        """OLMoE's full-width q/k norms in place of Megatron's per-head ones (:func:`olmoe_spec`)."""
        return olmoe_spec(block_spec)
