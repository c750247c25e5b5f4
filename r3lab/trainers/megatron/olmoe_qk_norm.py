"""OLMoE's q/k norm on Megatron-core's local spec: one RMSNorm over every head of a token, tensor-parallel.

``OlmoeAttention`` (transformers 5.24 ``models/olmoe/modeling_olmoe.py``) normalizes the whole q (and k) projection,
``hidden_size`` (``head_dim * num_key_value_heads``) wide, before splitting it into heads; Megatron-core's
``qk_layernorm`` normalizes each head. :class:`OlmoeQNorm` / :class:`OlmoeKNorm` take the place of Megatron's q/k
layernorm modules (:func:`olmoe_spec`): under tensor parallelism a rank holds ``heads / tp`` heads, so the sum of
squares is all-reduced over the TP group (forward and backward: :func:`tp_sum`) and the weight is TP-sharded along
its only dimension (this rank's heads, in order). Megatron-Bridge's ``OLMoESelfAttention``
(``megatron/bridge/models/olmoe/olmoe_provider.py``, 0.6.2) builds the norm ``num_attention_heads * head_dim`` wide
on every rank and applies it to the rank's flattened heads, which holds at TP 1 only; vLLM all-gathers q and k
instead (``OlmoeAttention._apply_qk_norm``).

Used by both Megatron loaders: r3lab's mbridge mapping (:mod:`r3lab.trainers.megatron.mbridge_bridges.olmoe`) and
Megatron-Bridge's (:mod:`r3lab.trainers.megatron.megatron_bridge_loader`). Needs megatron-core only.
"""

from __future__ import annotations

from typing import Any

import torch

from r3lab.errors import MegatronLoadError

__all__ = ["OlmoeQNorm", "OlmoeKNorm", "tp_sum", "olmoe_spec"]


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
    weight_split_over_tp = True  # the weight is this rank's slice along dim 0 (a loader's TP rule: column-parallel)

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
