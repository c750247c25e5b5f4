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
  ``qk_layernorm`` normalizes each head (``hidden_size_per_attention_head`` wide). :class:`OlmoeQNorm` and
  :class:`OlmoeKNorm` replace Megatron's q/k layernorm modules: one RMS over every head of a token. Under tensor
  parallelism a rank holds ``heads / tp`` heads, so the sum of squares is all-reduced over the TP group (forward and
  backward: :func:`tp_sum`) and the weight is TP-sharded along its only dimension (the rank's heads, in order;
  mbridge's generic split and merge rules apply). Megatron-Bridge's ``OLMoESelfAttention``
  (NVIDIA-NeMo/Megatron-Bridge ``src/megatron/bridge/models/olmoe/olmoe_provider.py``, commit 217dc58) builds the
  norm ``num_attention_heads * head_dim`` wide on every rank, which only holds at TP 1; vLLM all-gathers q and k
  instead (``OlmoeAttention._apply_qk_norm``);
* **experts**: ``intermediate_size`` is the expert FFN width (OLMoE has no dense FFN and no
  ``moe_intermediate_size``); ``clip_qkv`` (None in OLMoE's checkpoints) has no Megatron counterpart and is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from r3lab.errors import MegatronLoadError
from r3lab.trainers.megatron.mbridge_api import PINNED

try:
    from mbridge.models.qwen2moe import Qwen2MoEBridge
except ImportError as e:  # this module is imported only to load an OLMoE checkpoint into Megatron
    raise MegatronLoadError(f"OLMoE's Megatron mapping reuses mbridge's Qwen2-MoE names: pip install --no-deps "
                            f"{PINNED}") from e

__all__ = ["OlmoeBridge", "OlmoeQNorm", "OlmoeKNorm", "tp_sum", "olmoe_spec"]


class _TPSum(torch.autograd.Function):
    """All-reduce (sum) over the tensor-parallel group; its gradient is the all-reduced gradient (every rank's
    output depends on the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        g = grad.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def tp_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the tensor-parallel ranks (differentiable; the identity at TP 1)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return x
    return _TPSum.apply(x, ps.get_tensor_model_parallel_group())


class _FullWidthNorm(torch.nn.Module):
    """One RMSNorm over every head of a token (OLMoE's q/k norm), on this rank's ``heads / tp`` heads.

    Built where Megatron builds a per-head q/k layernorm (``hidden_size`` is the head dim there); the input is
    ``[s, b, local heads, head dim]``. Computes transformers' ``OlmoeRMSNorm``: fp32 mean of squares over the
    whole width, ``x * rsqrt(mean + eps)``, cast back, times the weight.
    """

    heads_field = ""  # the TransformerConfig field with this norm's head count

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        heads = int(getattr(config, self.heads_field))
        tp = ps.get_tensor_model_parallel_world_size()
        if heads % tp:
            raise MegatronLoadError(f"OLMoE's full-width qk-norm splits {self.heads_field}={heads} over tp={tp}: "
                                    "tp must divide it (Megatron replicates KV heads when tp > num_query_groups, "
                                    "which this norm does not implement)")
        self.local_heads, self.head_dim, self.width, self.eps = heads // tp, int(hidden_size), heads * hidden_size, eps
        self.weight = torch.nn.Parameter(torch.ones(self.local_heads * self.head_dim, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)  # this rank's heads, in order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != (self.local_heads, self.head_dim):
            raise MegatronLoadError(f"{type(self).__name__} expects [..., {self.local_heads}, {self.head_dim}] "
                                    f"(this rank's heads), got {tuple(x.shape)}")
        xf = x.float()
        mean = tp_sum(xf.pow(2).sum(dim=(-2, -1), keepdim=True)) / self.width
        y = (xf * torch.rsqrt(mean + self.eps)).to(x.dtype)
        return self.weight.view(self.local_heads, self.head_dim) * y

    def extra_repr(self) -> str:
        return f"{self.local_heads} heads x {self.head_dim} of {self.width}, eps={self.eps}"


class OlmoeQNorm(_FullWidthNorm):
    """OLMoE's ``q_norm``: one RMSNorm over all query heads (``num_attention_heads * head_dim`` wide)."""

    heads_field = "num_attention_heads"


class OlmoeKNorm(_FullWidthNorm):
    """OLMoE's ``k_norm``: one RMSNorm over all key heads (``num_query_groups * head_dim`` wide)."""

    heads_field = "num_query_groups"


def olmoe_spec(block_spec: Any) -> Any:
    """Megatron's (local, CPU) block spec with every layer's q/k layernorm replaced by OLMoE's full-width ones."""
    import dataclasses

    layers = []
    for ls in block_spec.layer_specs:
        attn = ls.submodules.self_attention
        if attn.submodules.q_layernorm is None or attn.submodules.k_layernorm is None:
            raise MegatronLoadError("OLMoE needs qk_layernorm=True (the spec has no q/k layernorm)")
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(
            attn.submodules, q_layernorm=OlmoeQNorm, k_layernorm=OlmoeKNorm))
        layers.append(dataclasses.replace(ls, submodules=dataclasses.replace(ls.submodules, self_attention=attn)))
    return dataclasses.replace(block_spec, layer_specs=layers)


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
