"""r3lab.replay: transformers router hooks (7 families) and Megatron-core RouterReplay injection, on CPU."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import transformers  # noqa: E402  (a test requirement: the cpu extra)

from r3lab.replay import (
    MegatronReplay,
    ReplayError,
    check_route_tensor,
    count_replay_hooks,
    find_hf_routers,
    find_orphaned_router_replays,
    hf_replay,
    megatron_replay,
)
from r3lab.routes import Routes

E, K, V = 8, 2, 64  # experts, top-k, vocab of every tiny model


# ==== transformers backend ======================================================================
def _configs() -> dict:
    tf = transformers
    base = dict(vocab_size=V, hidden_size=32, num_attention_heads=2, max_position_embeddings=64)
    gqa = dict(base, num_key_value_heads=1, head_dim=16)
    sig = dict(
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_hidden_layers=3,
        intermediate_size=64,
        moe_intermediate_size=32,
    )
    return {
        "qwen3_moe": tf.Qwen3MoeConfig(
            **gqa,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=E,
            num_experts_per_tok=K,
            norm_topk_prob=True,
        ),
        "qwen2_moe": tf.Qwen2MoeConfig(
            **base,
            num_key_value_heads=1,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=E,
            num_experts_per_tok=K,
            norm_topk_prob=False,
        ),
        "olmoe": tf.OlmoeConfig(
            **base, num_key_value_heads=1, num_hidden_layers=2, intermediate_size=32, num_experts=E, num_experts_per_tok=K
        ),
        "mixtral": tf.MixtralConfig(**gqa, num_hidden_layers=2, intermediate_size=32, num_local_experts=E, num_experts_per_tok=K),
        "gpt_oss": tf.GptOssConfig(
            **gqa,
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=E,
            num_experts_per_tok=K,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
        ),
        "deepseek_v3": tf.DeepseekV3Config(
            **base, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **sig
        ),
        "glm4_moe": tf.Glm4MoeConfig(**gqa, **sig),
    }


FAMILIES = list(_configs())
MOE_LAYERS = {f: ([1, 2] if f in ("deepseek_v3", "glm4_moe") else [0, 1]) for f in FAMILIES}


@functools.cache
def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_configs()[family], attn_implementation="eager")
    with torch.no_grad():
        for router in find_hf_routers(model).values():
            router.weight.normal_(0.0, 0.5)  # some families init routers to zeros: ties everywhere
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.uniform_(-0.3, 0.3)  # selection bias must not leak into weights
    return model


@pytest.fixture
def hf_model(request):
    model = _model(request.param)
    model.eval()
    model.zero_grad(set_to_none=True)
    yield model
    if model.is_activation_checkpointing:
        model.gradient_checkpointing_disable()
    model.eval()
    model.zero_grad(set_to_none=True)
    assert count_replay_hooks(model) == 0


per_family = pytest.mark.parametrize("hf_model", FAMILIES, indirect=True)
TOKENS = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))


def _random_routes(n_tokens: int, layers: list[int], seed: int = 5) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {l: torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n_tokens)]) for l in layers}


def _spy_experts(model):
    """Capture the (indices, weights) each MoE layer's experts are called with."""
    seen: dict[int, list] = {}
    handles = []
    for layer, router in find_hf_routers(model).items():
        block = model.get_submodule(_router_name(model, router).rsplit(".", 1)[0])
        handles.append(
            block.experts.register_forward_pre_hook(
                lambda m, a, layer=layer: seen.setdefault(layer, []).append((a[1].clone(), a[2].detach().clone()))
            )
        )
    return seen, handles


def _router_name(model, router):
    return next(n for n, m in model.named_modules() if m is router)


@per_family
def test_hf_finds_moe_layers_by_global_id(hf_model, request):
    family = request.node.callspec.params["hf_model"]
    assert list(find_hf_routers(hf_model)) == MOE_LAYERS[family]


@per_family
def test_hf_own_routes_reproduce_logits_exactly(hf_model):
    with torch.no_grad(), hf_replay(hf_model, mode="record") as rec:
        ref = hf_model(TOKENS).logits
    routes = rec.to_routes(cu_seqlens=[0, 12, 24])
    assert routes.layer_ids.tolist() == rec.layer_ids and routes.total_tokens == 24
    with torch.no_grad(), hf_replay(hf_model, routes) as rep:
        out = hf_model(TOKENS).logits
    assert torch.equal(out, ref)
    assert all(n == 1 for n in rep.calls.values())
    # the same through per-layer tensors, as a mapping and as a list, and [B, S, K] shaped
    per = rec.tensors()
    for given in (per, [per[l] for l in rec.layer_ids], {l: t.reshape(2, 12, K) for l, t in per.items()}):
        with torch.no_grad(), hf_replay(hf_model, given):
            assert torch.equal(hf_model(TOKENS).logits, ref)


@per_family
def test_hf_padded_batch_replays_packed_routes(hf_model):
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0  # right padding of sequence 1
    with torch.no_grad(), hf_replay(hf_model, mode="record") as rec:
        ref = hf_model(TOKENS, attention_mask=mask).logits
    routes = rec.to_routes(attention_mask=mask)
    assert routes.lengths.tolist() == [12, 7]
    with torch.no_grad(), hf_replay(hf_model, routes, attention_mask=mask):
        out = hf_model(TOKENS, attention_mask=mask).logits
    valid = mask.bool()
    # padding rows now route to arange(k), so expert GEMMs see other row counts: equal up to BLAS blocking
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=1e-5)


@per_family
def test_hf_other_routes_are_used_and_change_logits(hf_model, request):
    family = request.node.callspec.params["hf_model"]
    with torch.no_grad():
        ref = hf_model(TOKENS).logits
    new = _random_routes(24, MOE_LAYERS[family])
    seen, handles = _spy_experts(hf_model)
    try:
        with torch.no_grad(), hf_replay(hf_model, new):
            out = hf_model(TOKENS).logits
    finally:
        for h in handles:
            h.remove()
    assert not torch.allclose(out, ref)
    for layer, ids in new.items():
        ((used, weights),) = seen[layer]
        assert torch.equal(used, ids)
        assert torch.isfinite(weights).all() and (weights > 0).all()
        if family in ("qwen3_moe", "mixtral", "gpt_oss", "olmoe"):
            norm = hf_model.config.norm_topk_prob if family in ("qwen3_moe", "olmoe") else True
            if norm:
                torch.testing.assert_close(weights.sum(-1).float(), torch.ones(24))
        if family in ("deepseek_v3", "glm4_moe"):
            torch.testing.assert_close(weights.sum(-1), torch.full((24,), 2.5))


def _router_grads(model):
    return {l: r.weight.grad.clone() for l, r in find_hf_routers(model).items()}


@per_family
def test_hf_router_gets_gradient_through_gathered_scores(hf_model, request):
    family = request.node.callspec.params["hf_model"]
    with hf_replay(hf_model, mode="record") as rec:
        hf_model(TOKENS).logits.float().pow(2).mean().backward()
    native = _router_grads(hf_model)
    hf_model.zero_grad(set_to_none=True)
    with hf_replay(hf_model, rec.tensors()):
        hf_model(TOKENS).logits.float().pow(2).mean().backward()
    for l, g in _router_grads(hf_model).items():
        torch.testing.assert_close(g, native[l], rtol=1e-5, atol=1e-8)
        assert g.abs().sum() > 0
    hf_model.zero_grad(set_to_none=True)
    with hf_replay(hf_model, _random_routes(24, MOE_LAYERS[family])):
        hf_model(TOKENS).logits.float().pow(2).mean().backward()
    for l, g in _router_grads(hf_model).items():
        assert g.abs().sum() > 0 and not torch.allclose(g, native[l])


@per_family
def test_hf_gradient_checkpointing_replays_same_routes(hf_model, request):
    family = request.node.callspec.params["hf_model"]
    new = _random_routes(24, MOE_LAYERS[family], seed=11)
    hf_model.train()
    with hf_replay(hf_model, new):
        hf_model(TOKENS).logits.float().pow(2).mean().backward()
    plain = _router_grads(hf_model)
    hf_model.zero_grad(set_to_none=True)
    hf_model.gradient_checkpointing_enable()
    seen, handles = _spy_experts(hf_model)
    try:
        with hf_replay(hf_model, new) as rep:
            hf_model(TOKENS).logits.float().pow(2).mean().backward()
    finally:
        for h in handles:
            h.remove()
    assert all(n == 2 for n in rep.calls.values()), rep.calls  # forward + recomputation in backward
    for layer, ids in new.items():
        assert len(seen[layer]) == 2 and all(torch.equal(used, ids) for used, _ in seen[layer])
    for l, g in _router_grads(hf_model).items():
        torch.testing.assert_close(g, plain[l], rtol=1e-5, atol=1e-8)


@per_family
def test_hf_hooks_removed_on_exit_and_on_exception(hf_model):
    n = len(find_hf_routers(hf_model))
    with hf_replay(hf_model, mode="record"):
        assert count_replay_hooks(hf_model) == n
        with hf_replay(hf_model, mode="record"):
            assert count_replay_hooks(hf_model) == 2 * n
        assert count_replay_hooks(hf_model) == n
    assert count_replay_hooks(hf_model) == 0
    with pytest.raises(RuntimeError, match="boom"):
        with hf_replay(hf_model, mode="record"):
            assert count_replay_hooks(hf_model) == n
            raise RuntimeError("boom")
    assert count_replay_hooks(hf_model) == 0
    with pytest.raises(ReplayError, match="token rows"):  # error raised inside the hook
        with torch.no_grad(), hf_replay(hf_model, _random_routes(5, list(find_hf_routers(hf_model)))):
            hf_model(TOKENS)
    assert count_replay_hooks(hf_model) == 0


@pytest.mark.parametrize("hf_model", ["qwen3_moe", "glm4_moe"], indirect=True)
def test_hf_bad_inputs_raise_clear_errors(hf_model):
    layers = list(find_hf_routers(hf_model))
    good = _random_routes(24, layers)
    first = layers[0]

    cases = [
        ({**good, first: good[first][:, :1]}, "top_k=2"),
        ({**good, first: good[first] + E}, "out of range"),
        ({**good, first: torch.full((24, K), 3)}, "repeated expert id"),
        ({**good, first: good[first].float()}, "integer dtype"),
        ([good[first]], "1 per-layer id tensors for 2 MoE layers"),
        ({l + 1: t for l, t in good.items()}, "model's MoE layers"),
        ({**good, first: good[first][:20]}, "token rows"),
        ("nonsense", "must be Routes"),
    ]
    for routes, msg in cases:
        with pytest.raises(ReplayError, match=msg):
            with hf_replay(hf_model, routes):
                pass
        assert count_replay_hooks(hf_model) == 0
    vals = np.stack([good[l].numpy() for l in layers], axis=1)
    shifted = Routes(vals, [0, 24], E, layer_ids=[l - first for l in layers])  # positional ids: dense layer dropped
    if first > 0:
        with pytest.raises(ReplayError, match="routes lack MoE layers"):
            with hf_replay(hf_model, shifted):
                pass
    with pytest.raises(ReplayError, match="experts"):
        with hf_replay(hf_model, Routes(vals, [0, 24], E + 1, layer_ids=layers)):
            pass
    with pytest.raises(ReplayError, match="row lengths"):
        with hf_replay(hf_model, Routes(vals, [0, 12, 24], E, layer_ids=layers), attention_mask=torch.ones(2, 13)):
            pass
    with pytest.raises(ReplayError, match="mode"):
        with hf_replay(hf_model, mode="replay_forward"):
            pass
    with pytest.raises(ReplayError, match="before any routes"):
        with torch.no_grad(), hf_replay(hf_model):
            hf_model(TOKENS)
    assert count_replay_hooks(hf_model) == 0


def test_hf_routes_keep_extra_dense_layers_out():
    model = _model("glm4_moe")
    with torch.no_grad(), hf_replay(model, mode="record") as rec:
        ref = model(TOKENS).logits
    per = rec.tensors()
    vals = np.zeros((24, 3, K), dtype=np.uint8)  # vLLM style: every layer, dense layer 0 as rows of 0, 1
    vals[:, 0] = np.arange(K)
    vals[:, 1], vals[:, 2] = per[1].numpy(), per[2].numpy()
    with torch.no_grad(), hf_replay(model, Routes(vals, [0, 12, 24], E)):
        assert torch.equal(model(TOKENS).logits, ref)


def test_check_route_tensor_accepts_wire_dtypes():
    t = check_route_tensor(np.array([[1, 0], [3, 2]], dtype=np.uint8), top_k=2, num_experts=4)
    assert t.dtype == torch.int64 and t.tolist() == [[1, 0], [3, 2]]
    with pytest.raises(ReplayError, match="numpy"):
        check_route_tensor([[0, 1]], top_k=2, num_experts=4)
    with pytest.raises(ReplayError, match="out of range"):
        check_route_tensor(torch.tensor([[-1, 0]]), top_k=2, num_experts=4)


# ==== Megatron backend ==========================================================================
from r3lab import megatron_cpu as mc  # noqa: E402  (megatron-core is a test requirement: the cpu extra)


@pytest.fixture(scope="module")
def megatron_world():
    mc.init_cpu_parallel()  # also patches megatron for CPU, recomputation's RNG state included
    yield


@pytest.fixture(autouse=True)
def _reset_router_replay_registry():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    yield
    RouterReplay.clear_global_router_replay_instances()


def _gpt(megatron_world=None, *, recompute=False, init_parallel=False, **extra):
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    spec = mc.TinyGPTSpec(num_layers=3, dense_leading=1, num_experts=E, topk=K, extra_config=extra)
    (model,) = mc.build_tiny_gpt(spec, init_parallel=init_parallel)
    return model


MTOK = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))  # [B, S]: 20 router rows


def _spy_routers(model):
    seen: dict[int, list] = {}
    handles = [
        r.register_forward_hook(lambda m, a, o, g=g: seen.setdefault(g, []).append(o[1].clone()))
        for g, r in MegatronReplay(model, mode="record", orphans="ignore").routers.items()
    ]
    return seen, handles


def _as_map(ids):
    return torch.zeros(ids.shape[0], E, dtype=torch.bool).scatter_(1, ids, True)


def _replay_state_clean(model):
    for r in MegatronReplay(model, mode="record", orphans="ignore").routers.values():
        rr = r.router_replay
        assert rr.router_replay_action is None and rr.target_topk_idx is None and rr.recorded_topk_idx is None
        assert rr.replay_backward_list == [] and not r._forward_pre_hooks
    return True


def test_megatron_record_returns_trainer_routes_and_replays_them_exactly(megatron_world):
    model = _gpt()
    seen, handles = _spy_routers(model)
    with megatron_replay(model, mode="record") as rec:
        rec.begin_microbatch()
        ref = mc.forward_tokens(model, MTOK)
        got = rec.after_forward()
    assert list(got) == [1, 2] and rec.recorded == [got]
    for g, ids in got.items():
        assert ids.shape == (20, K) and ids.dtype == torch.int64
        assert torch.equal(_as_map(ids), seen[g][0])
    assert _replay_state_clean(model)
    with megatron_replay(model, [got]) as rep:  # R2: replay the trainer's own routes
        rep.begin_microbatch()
        out = mc.forward_tokens(model, MTOK)
    assert torch.equal(out, ref)
    for h in handles:
        h.remove()


def test_megatron_replay_forward_makes_every_router_use_the_routes(megatron_world):
    model = _gpt()
    ref = mc.forward_tokens(model, MTOK)
    new = _random_routes(20, [1, 2])
    seen, handles = _spy_routers(model)
    with megatron_replay(model, [[new[1].numpy().astype(np.uint8), new[2]]], num_experts=E) as rep:
        rep.begin_microbatch()
        out = mc.forward_tokens(model, MTOK)
    for h in handles:
        h.remove()
    for g in (1, 2):
        assert torch.equal(seen[g][0], _as_map(new[g]))
    assert not torch.allclose(out, ref)
    assert _replay_state_clean(model)


def test_megatron_replay_backward_under_recompute_pops_each_microbatch(megatron_world):
    model = _gpt(recompute=True)
    model.train()
    mbs = [_random_routes(20, [1, 2], seed=s) for s in (21, 22)]
    seen, handles = _spy_routers(model)
    with megatron_replay(model, mbs) as rep:
        outs = []
        for _ in mbs:  # 1F1B-like order: both forwards, then both backwards
            rep.begin_microbatch()
            outs.append(mc.forward_tokens(model, MTOK, grad=True))
            rep.after_forward()
        rrs = [r.router_replay for r in rep.routers.values()]
        assert all(len(rr.replay_backward_list) == 2 for rr in rrs)
        for o in outs:
            o.float().pow(2).mean().backward()
        assert all(rr.replay_backward_list == [] for rr in rrs)
    for h in handles:
        h.remove()
    for g in (1, 2):  # forward mb0, forward mb1, recompute mb0, recompute mb1
        want = [_as_map(mbs[0][g]), _as_map(mbs[1][g])] * 2
        assert len(seen[g]) == 4 and all(torch.equal(a, b) for a, b in zip(seen[g], want, strict=True))
    assert _replay_state_clean(model)


def test_megatron_wrap_forward_step_and_forward_only(megatron_world):
    model = _gpt(recompute=True)
    model.train()
    new = _random_routes(20, [1, 2])
    with megatron_replay(model, [new]) as rep:
        rep.begin_microbatch(new, forward_only=True)  # old log-probs: no backward follows
        with torch.no_grad():
            mc.forward_tokens(model, MTOK)
        rrs = [r.router_replay for r in rep.routers.values()]
        assert all(rr.replay_backward_list == [] for rr in rrs)
        step = rep.wrap_forward_step(lambda tok, m: mc.forward_tokens(m, tok, grad=True))
        out = step(MTOK, model)
        assert all(rr.router_replay_action.name == "REPLAY_BACKWARD" for rr in rrs)
        out.float().sum().backward()
    assert _replay_state_clean(model)


def test_megatron_refuses_fused_and_sinkhorn_routing(megatron_world):
    with pytest.raises(ReplayError, match="moe_router_fusion"):
        MegatronReplay(_gpt(moe_router_fusion=True))
    with pytest.raises(ReplayError, match="sinkhorn"):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
        MegatronReplay(_gpt(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1))


def test_megatron_detects_orphaned_router_replays(megatron_world):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    _gpt()  # an earlier build that was never cleared
    model = _gpt()
    assert len(find_orphaned_router_replays(model)) == 2
    with pytest.raises(ReplayError, match="orphaned"):
        MegatronReplay(model)
    new = _random_routes(20, [1, 2])
    seen, handles = _spy_routers(model)
    with megatron_replay(model, [new], orphans="ignore") as rep:  # e.g. a live reference model owns them
        assert len(RouterReplay.global_router_replay_instances) == 4
        rep.begin_microbatch()
        mc.forward_tokens(model, MTOK)
    for h in handles:
        h.remove()
    assert all(torch.equal(seen[g][0], _as_map(new[g])) for g in (1, 2))
    with megatron_replay(model, [new], orphans="prune") as rep:
        assert len(RouterReplay.global_router_replay_instances) == 2
        rep.begin_microbatch()
        mc.forward_tokens(model, MTOK)
    RouterReplay.clear_global_router_replay_instances()
    with pytest.raises(ReplayError, match="not in RouterReplay's global registry"):
        MegatronReplay(model)


def test_megatron_cleanup_on_exception(megatron_world):
    model = _gpt()
    with pytest.raises(RuntimeError, match="boom"):
        with megatron_replay(model, [_random_routes(20, [1, 2])]) as rep:
            rep.begin_microbatch()
            assert all(r._forward_pre_hooks for r in rep.routers.values())
            raise RuntimeError("boom")
    assert _replay_state_clean(model)
    with pytest.raises(ReplayError, match="token rows"):  # the check in the routers' pre-hook
        with megatron_replay(model, [_random_routes(12, [1, 2])]) as rep:
            rep.begin_microbatch()
            mc.forward_tokens(model, MTOK)
    assert _replay_state_clean(model)


def test_megatron_bad_inputs_raise_clear_errors(megatron_world):
    model = _gpt()
    good = _random_routes(20, [1, 2])
    cases = [
        ([good[1]], "1 id tensors for 2 routers"),
        ({0: good[1], 1: good[2]}, "this rank's MoE routers are layers"),
        ([good[1], good[2][:, :1]], "top_k=2"),
        ([good[1], good[2].reshape(2, 10, K)], "top_k=2"),
        ([good[1], good[2] + E], "out of range"),
        ([good[1], torch.zeros(20, K, dtype=torch.long)], "repeated expert id"),
        ([good[1], good[2].float()], "integer dtype"),
        ([good[1], good[2][:5]], "token rows"),
    ]
    for routes, msg in cases:
        with pytest.raises(ReplayError, match=msg):
            with megatron_replay(model, [routes]) as rep:
                rep.begin_microbatch()
        assert _replay_state_clean(model)
    with pytest.raises(ReplayError, match="micro-batch 1"):
        with megatron_replay(model, [good]) as rep:
            rep.begin_microbatch()
            rep.begin_microbatch()
    with pytest.raises(ReplayError, match="experts"):
        MegatronReplay(model, num_experts=E + 1)
    with pytest.raises(ReplayError, match="not active"):
        MegatronReplay(model, [good]).begin_microbatch()


def test_megatron_without_model_drives_the_registry(megatron_world):
    model = _gpt()
    new = _random_routes(20, [1, 2])
    seen, handles = _spy_routers(model)
    with megatron_replay(None, [[new[1], new[2]]], num_experts=E) as rep:
        rep.begin_microbatch()
        mc.forward_tokens(model, MTOK)
    for h in handles:
        h.remove()
    assert all(torch.equal(seen[g][0], _as_map(new[g])) for g in (1, 2))
    assert _replay_state_clean(model)
