"""The mismatch dial: a *simulation* of weight quantization for the rollout engine (fake quantization).

FP8/INT8 rollouts with bf16 training are how engine and trainer drift apart in the field (FlashRL/TIS, the
LMSYS FP8-RL report; Miles notes that FP8 flips routes). Here the engine's attention and expert weights are
quantized per output channel and dequantized back to the engine's dtype, so vLLM still runs its bf16 kernels
on weights that carry the quantization error; no quantized kernel runs. Settings:

- ``fp8``: e4m3 (``torch.float8_e4m3fn``), one scale per output channel, ``scale = amax / 448``;
- ``int8``, ``int6``, ``int4``: symmetric rounding to ``2^(N-1) - 1`` levels each side, ``scale = amax / qmax``.

What is quantized (as FP8-rollout recipes do): the 2-D projection weights of attention (q/k/v/o) and of the
MLPs (routed experts, shared experts, dense MLP layers). Routers, norms, embeddings, the LM head and biases
stay as they are. The trainer's weights are never touched: this module is on the inference side only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from r3lab.rollout.types import RolloutError

__all__ = ["QUANT_SETTINGS", "FP8_E4M3_MAX", "is_quantized_weight", "fake_quantize", "quantize_state_dict"]

QUANT_SETTINGS = ("none", "fp8", "int8", "int6", "int4")
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn

# checkpoint (Hugging Face) names of the weights the dial quantizes; mlp.gate.weight (the router) never matches
_QUANTIZED = re.compile(
    r"(^|\.)(self_attn\.(q_proj|k_proj|v_proj|o_proj)"
    r"|mlp\.((experts\.\d+|shared_experts?)\.)?(gate_proj|up_proj|down_proj))\.weight$"
)


def is_quantized_weight(name: str) -> bool:
    """Whether the dial quantizes this checkpoint tensor (attention and MLP/expert projections; never a
    router, norm, embedding, LM head or bias)."""
    return bool(_QUANTIZED.search(name))


def _check_setting(quant: str) -> None:
    if quant not in QUANT_SETTINGS:
        raise RolloutError(f"engine_quant must be one of {QUANT_SETTINGS}, got {quant!r}")


def fake_quantize(weight: Any, quant: str, *, dtype: Any = None) -> Any:
    """``weight`` ``[out, in]`` quantized per output channel (row) and dequantized to ``dtype`` (default: its own).

    Computed in float32. A row of zeros stays zero. ``quant="none"`` returns ``weight`` itself (cast to
    ``dtype`` if given).
    """
    import torch

    _check_setting(quant)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not weight.is_floating_point():
        raise RolloutError(f"fake_quantize needs a 2-D float tensor [out, in], got "
                           f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}")
    dtype = weight.dtype if dtype is None else dtype
    if quant == "none":
        return weight.to(dtype)
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    if not torch.isfinite(amax).all():
        raise RolloutError("fake_quantize: the weight has non-finite values")
    if quant == "fp8":
        scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
        q = (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    else:
        qmax = float(2 ** (int(quant[3:]) - 1) - 1)
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        q = torch.round(w / scale).clamp(-qmax, qmax)
    return (q * scale).to(dtype)


def quantize_state_dict(state_dict: Mapping[str, Any], quant: str, *, dtype: Any = None) -> dict[str, Any]:
    """A new state dict with every dial weight (:func:`is_quantized_weight`) fake-quantized to ``dtype``;
    every other tensor is the same object as in ``state_dict`` (untouched, bit for bit)."""
    _check_setting(quant)
    if quant == "none":
        return dict(state_dict)
    return {k: fake_quantize(v, quant, dtype=dtype) if is_quantized_weight(k) else v for k, v in state_dict.items()}
