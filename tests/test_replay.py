"""r3lab.replay: transformers router hooks (7 families) and Megatron-core RouterReplay injection, on CPU."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
import transformers  # noqa: E402  (a test requirement: the cpu extra)

from r3lab.compaction import decode, encode
from r3lab.errors import MegatronCoreAPIError, ReplayError
from r3lab.moe_layout import MoELayout
from r3lab.paths import MODELS, model_dir
from r3lab.replay import (
    MegatronReplay,
    check_route_tensor,
    count_replay_hooks,
    count_router_cast_hooks,
    find_hf_routers,
    find_orphaned_router_replays,
    hf_api,
    hf_replay,
    hf_token_logprobs,
    keep_routers_fp32,
    load_hf_model,
    mcore_api,
    megatron_replay,
    megatron_routers,
    recompute_routes,
    remove_router_casts,
)
from r3lab.routes import Routes
from r3lab.slicing import ParallelLayout
from r3lab.testing import MOE_FAMILIES, random_route_tensors, random_routes, tiny_moe_config

E, K, V = 8, 2, 64  # experts, top-k, vocab of every tiny model


# ==== transformers backend ======================================================================
FAMILIES = list(MOE_FAMILIES)
MOE_LAYERS = {f: ([1, 2] if f in ("deepseek_v3", "glm4_moe") else [0, 1]) for f in FAMILIES}


@functools.cache
def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_moe_config(family, num_experts=E, top_k=K, vocab_size=V), attn_implementation="eager"
    )
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
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):  # transformers 5.12 and 5.25
        model.gradient_checkpointing_disable()
    model.eval()
    model.zero_grad(set_to_none=True)
    assert count_replay_hooks(model) == 0


per_family = pytest.mark.parametrize("hf_model", FAMILIES, indirect=True)
TOKENS = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))


def _random_routes(n_tokens: int, layers: list[int], seed: int = 5) -> dict[int, torch.Tensor]:
    return random_route_tensors(n_tokens, layers, num_experts=E, top_k=K, seed=seed)


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
def test_hf_router_layout_is_the_one_read_for_this_transformers(hf_model):
    """Each router returns what r3lab.replay.hf_api says for the installed release: the (logits, weights, ids)
    triple (fused) or the logits alone while its MoE block selects (split: GLM-4-MoE, DeepSeek-V3 at 5.12.1)."""
    v = hf_api.check_transformers_version()
    assert v in hf_api.CHECKED  # this suite runs on the checked releases only
    for name, router in ((n, m) for n, m in hf_model.named_modules() if m in find_hf_routers(hf_model).values()):
        block = hf_model.get_submodule(name.rpartition(".")[0])
        layout = hf_api.router_layout(router, block)
        assert layout == hf_api.CHECKED[v][type(router).__name__]
        with torch.no_grad():
            out = router(torch.randn(5, hf_model.config.hidden_size))
        if layout == "fused":
            assert isinstance(out, tuple) and len(out) == 3 and out[2].shape == (5, K)
        else:
            assert torch.is_tensor(out) and out.shape == (5, E)
            ids, w = getattr(block, hf_api.SPLIT_METHOD)(out)
            assert ids.shape == w.shape == (5, K)
    for outside in ("5.11.0", "5.12.0", "5.26.0", "6.0.0"):
        with pytest.raises(ReplayError, match=f"transformers {outside}: r3lab's router replay was checked"):
            hf_api.check_transformers_version(outside)
    assert hf_api.check_transformers_version("5.20.1") == "5.20.1"


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
    for given in (
        per,
        [per[layer] for layer in rec.layer_ids],
        {layer: t.reshape(2, 12, K) for layer, t in per.items()},
    ):
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
    return {layer: r.weight.grad.clone() for layer, r in find_hf_routers(model).items()}


@per_family
def test_hf_router_gets_gradient_through_gathered_scores(hf_model, request):
    family = request.node.callspec.params["hf_model"]
    with hf_replay(hf_model, mode="record") as rec:
        hf_model(TOKENS).logits.float().pow(2).mean().backward()
    native = _router_grads(hf_model)
    hf_model.zero_grad(set_to_none=True)
    with hf_replay(hf_model, rec.tensors()):
        hf_model(TOKENS).logits.float().pow(2).mean().backward()
    for layer, g in _router_grads(hf_model).items():
        torch.testing.assert_close(g, native[layer], rtol=1e-5, atol=1e-8)
        assert g.abs().sum() > 0
    hf_model.zero_grad(set_to_none=True)
    with hf_replay(hf_model, _random_routes(24, MOE_LAYERS[family])):
        hf_model(TOKENS).logits.float().pow(2).mean().backward()
    for layer, g in _router_grads(hf_model).items():
        assert g.abs().sum() > 0 and not torch.allclose(g, native[layer])


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
    for layer, g in _router_grads(hf_model).items():
        torch.testing.assert_close(g, plain[layer], rtol=1e-5, atol=1e-8)


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
        ({layer + 1: t for layer, t in good.items()}, "model's MoE layers"),
        ({**good, first: good[first][:20]}, "token rows"),
        ("nonsense", "must be Routes"),
    ]
    for routes, msg in cases:
        with pytest.raises(ReplayError, match=msg):
            with hf_replay(hf_model, routes):
                pass
        assert count_replay_hooks(hf_model) == 0
    vals = np.stack([good[layer].numpy() for layer in layers], axis=1)
    shifted = Routes(
        vals, [0, 24], E, layer_ids=[layer - first for layer in layers]
    )  # positional ids: dense layer dropped
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


@per_family
def test_hf_replay_of_decoded_rows_ignores_order_inside_a_row(hf_model):
    """Set codecs decode each top-k row sorted by id; replay must give the logits of the original order.

    Order could matter wherever a rule gathers weights per position (every family's rule does)."""
    with torch.no_grad(), hf_replay(hf_model, mode="record") as rec:
        ref = hf_model(TOKENS).logits
    own = rec.to_routes(cu_seqlens=[0, 12, 24])
    decoded = decode(encode(own, "topk-set"))
    np.testing.assert_array_equal(decoded.values, np.sort(own.values, axis=2))
    assert (decoded.values != own.values).any(axis=2).mean() > 0.2  # the order really changed in many rows
    with torch.no_grad(), hf_replay(hf_model, decoded, record_replayed=True) as rep:
        out = hf_model(TOKENS).logits
    assert rep.to_routes(cu_seqlens=[0, 12, 24]) == decoded  # the experts got the sorted rows ...
    # ... and compute the same function: the k contributions are summed in another order, fp32 rounding only
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@per_family
def test_token_logprobs_records_what_the_routers_used(hf_model, request):
    family = request.node.callspec.params["hf_model"]
    ids = TOKENS[0].tolist()
    with torch.no_grad():  # the reference: one plain forward, log p(token t | tokens < t) from prompt_len on
        lp_ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)[3:-1].gather(
            1, TOKENS[0, 4:, None]
        )[:, 0]
    lp, none = hf_token_logprobs(hf_model, ids, prompt_len=4)
    assert none is None and lp.dtype == np.float64 and lp.shape == (8,)
    np.testing.assert_array_equal(lp, lp_ref.numpy().astype(np.float64))
    lp_rec, own = hf_token_logprobs(hf_model, np.asarray(ids), prompt_len=4, record=True)
    np.testing.assert_array_equal(lp_rec, lp)  # recording changes nothing
    assert own.layer_ids.tolist() == MOE_LAYERS[family] and own.total_tokens == 12 and len(own) == 1
    moe = MOE_LAYERS[family]
    rng = np.random.default_rng(3)
    other = random_routes(rng, num_experts=E, top_k=K, num_layers=len(moe), lengths=[12], layer_ids=moe)
    lp_other, used = hf_token_logprobs(hf_model, ids, prompt_len=4, routes=other, record=True)
    assert used == other and not np.allclose(lp_other, lp)
    lp_own, used = hf_token_logprobs(hf_model, ids, prompt_len=4, routes=own, record=True)
    assert used == own
    np.testing.assert_array_equal(lp_own, lp)
    assert count_replay_hooks(hf_model) == 0


@pytest.mark.parametrize("hf_model", ["qwen3_moe"], indirect=True)
def test_token_logprobs_bad_inputs(hf_model):
    ids = TOKENS[0].tolist()
    own = hf_token_logprobs(hf_model, ids, record=True)[1]
    for kw, msg in [
        (dict(prompt_len=0), "prompt_len"),
        (dict(prompt_len=13), "prompt_len"),
        (dict(routes=own.values), "must be r3lab.routes.Routes"),
        (dict(routes=Routes(own.values[:11], [0, 11], E, own.layer_ids)), "11 token rows for 12 tokens"),
    ]:
        with pytest.raises(ReplayError, match=msg):
            hf_token_logprobs(hf_model, ids, **kw)
    for bad in ([], [[1, 2]], [0.5, 1.5]):
        with pytest.raises(ReplayError, match="token_ids"):
            hf_token_logprobs(hf_model, bad)
    assert count_replay_hooks(hf_model) == 0


# ---- the shipped checkpoints ----------------------------------------------------------------------
@pytest.fixture(scope="module", params=MODELS)
def shipped_bf16(request):
    model = load_hf_model(model_dir(request.param), "bfloat16")
    yield request.param, model
    remove_router_casts(model)


def test_shipped_models_replay_decoded_routes_exactly(shipped_bf16):
    """bf16 trainer with fp32 routers: replaying its own routes, decoded (rows sorted), changes no log-prob."""
    name, model = shipped_bf16
    layout = MoELayout.from_model_dir(model_dir(name))
    ids = np.random.default_rng(0).integers(4, layout_vocab(name), 40).tolist()
    lp, own = hf_token_logprobs(model, ids, prompt_len=8, record=True)
    assert own.layer_ids.tolist() == list(layout.moe_layer_ids) and own.total_tokens == 40
    decoded = decode(encode(own, "topk-set+zstd"))
    assert (decoded.values != own.values).any()  # GLM's top-k comes out unsorted; Qwen3's by score
    lp_r3, used = hf_token_logprobs(model, ids, prompt_len=8, routes=decoded, record=True)
    assert used == decoded
    np.testing.assert_array_equal(lp_r3, lp)
    routes, lps = recompute_routes(model_dir(name), [ids, ids[:9]], model=model, return_logprobs=True)
    assert routes.lengths.tolist() == [39, 8] and routes.layer_ids.tolist() == list(layout.moe_layer_ids)
    np.testing.assert_array_equal(routes.values[:39], own.values[:39])  # the engine's convention: len - 1 rows
    np.testing.assert_array_equal(lps[0][7:], lp)
    assert count_replay_hooks(model) == 0


def layout_vocab(name: str) -> int:
    return int(json.loads((model_dir(name) / "config.json").read_text())["vocab_size"])


def test_load_hf_model_fp32_routers_are_counted_and_removable():
    model = load_hf_model(model_dir("tiny-qwen3-moe"), "bfloat16")
    routers = find_hf_routers(model)
    ids = list(range(4, 24))
    assert count_router_cast_hooks(model) == len(routers) == 8 and count_replay_hooks(model) == 0
    assert all(r.weight.dtype == torch.float32 for r in routers.values())
    lp, _ = hf_token_logprobs(model, ids)
    with pytest.raises(ReplayError, match="already run in fp32"):
        keep_routers_fp32(model)
    assert remove_router_casts(model) == 8
    assert count_router_cast_hooks(model) == 0 and remove_router_casts(model) == 0
    assert all(r.weight.dtype == torch.bfloat16 for r in routers.values())  # as loaded: transformers keeps them bf16
    lp_bf16, _ = hf_token_logprobs(model, ids)  # the plain bf16 model runs, and routes differently somewhere
    with keep_routers_fp32(model) as casts:
        assert len(casts) == count_router_cast_hooks(model) == 8
        np.testing.assert_array_equal(hf_token_logprobs(model, ids)[0], lp)
    assert count_router_cast_hooks(model) == 0
    np.testing.assert_array_equal(hf_token_logprobs(model, ids)[0], lp_bf16)
    assert load_hf_model(model_dir("tiny-qwen3-moe"), "float32") is not None
    with pytest.raises(ReplayError, match="dtype"):
        load_hf_model(model_dir("tiny-qwen3-moe"), "float16")


def test_check_route_tensor_accepts_wire_dtypes():
    t = check_route_tensor(np.array([[1, 0], [3, 2]], dtype=np.uint8), top_k=2, num_experts=4)
    assert t.dtype == torch.int64 and t.tolist() == [[1, 0], [3, 2]]
    with pytest.raises(ReplayError, match="numpy"):
        check_route_tensor([[0, 1]], top_k=2, num_experts=4)
    with pytest.raises(ReplayError, match="out of range"):
        check_route_tensor(torch.tensor([[-1, 0]]), top_k=2, num_experts=4)


# ==== Megatron backend ==========================================================================
from r3lab.testing import megatron as mc  # noqa: E402  (megatron-core is a test requirement: the cpu extra)
from r3lab.trainers.megatron import forward_tokens  # noqa: E402  (the same: megatron-core)


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
    spec = mc.TinyGPTSpec(ParallelLayout(num_layers=3, moe_layer_ids=(1, 2)), num_experts=E, topk=K, extra_config=extra)
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
        ref = forward_tokens(model, MTOK)
        got = rec.after_forward()
    assert list(got) == [1, 2] and rec.recorded == [got]
    for g, ids in got.items():
        assert ids.shape == (20, K) and ids.dtype == torch.int64
        assert torch.equal(_as_map(ids), seen[g][0])
    assert _replay_state_clean(model)
    with megatron_replay(model, [got]) as rep:  # R2: replay the trainer's own routes
        rep.begin_microbatch()
        out = forward_tokens(model, MTOK)
    assert torch.equal(out, ref)
    for h in handles:
        h.remove()


def test_megatron_replay_forward_makes_every_router_use_the_routes(megatron_world):
    model = _gpt()
    ref = forward_tokens(model, MTOK)
    new = _random_routes(20, [1, 2])
    seen, handles = _spy_routers(model)
    with megatron_replay(model, [[new[1].numpy().astype(np.uint8), new[2]]], num_experts=E) as rep:
        rep.begin_microbatch()
        out = forward_tokens(model, MTOK)
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
            outs.append(forward_tokens(model, MTOK, grad=True))
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
            forward_tokens(model, MTOK)
        rrs = [r.router_replay for r in rep.routers.values()]
        assert all(rr.replay_backward_list == [] for rr in rrs)
        step = rep.wrap_forward_step(lambda tok, m: forward_tokens(m, tok, grad=True))
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


_MCORE = tuple(int(x) for x in mcore_api.mcore_version().split(".")[:2])


@pytest.mark.skipif(_MCORE < (0, 19), reason="quantile_balancing routing is new in megatron-core 0.19")
def test_megatron_quantile_balancing_ignores_router_replay_and_r3lab_refuses_it(megatron_world):
    """megatron-core 0.19's quantile-balancing routing selects its own experts even under REPLAY_FORWARD (shown with
    Megatron's own API), so r3lab refuses it as it refuses sinkhorn."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    model = _gpt(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0)
    with pytest.raises(ReplayError, match="quantile_balancing routing .* without RouterReplay"):
        MegatronReplay(model)
    routers = list(model.decoder.layers[g].mlp.router for g in (1, 2))
    want = _random_routes(20, [1, 2], seed=9)
    seen: dict = {}
    hooks = [r.register_forward_hook(lambda m, a, o, g=g: seen.update({g: o[1].clone()}))
             for g, r in zip((1, 2), routers, strict=True)]
    try:
        RouterReplay.set_replay_data([want[1], want[2]])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        with torch.no_grad():
            forward_tokens(model, MTOK)
    finally:
        for h in hooks:
            h.remove()
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
    assert not any(torch.equal(seen[g], _as_map(want[g])) for g in (1, 2))  # the replayed ids were ignored


def test_mcore_api_holds_for_the_installed_release():
    """The internals r3lab reaches are where r3lab.replay.mcore_api says, and every routing type that
    ``TopKRouter.routing`` special-cases (so never hands RouterReplay to the top-k) is one replay refuses."""
    import inspect
    import re

    from megatron.core.transformer.moe.router import TopKRouter

    v = mcore_api.check_mcore_api()
    assert v in mcore_api.CHECKED  # this suite runs on the checked releases only
    src = inspect.getsource(TopKRouter.routing)
    special = set(re.findall(r"self\.routing_type == [\"']([a-z_]+)[\"']", src))
    assert special and special <= set(mcore_api.REPLAY_BYPASSING_ROUTING), special
    assert "router_replay=self.router_replay" in src  # the default branch still consults RouterReplay
    for outside in ("0.15.0", "0.16.0", "0.20.0", "1.0.0"):
        with pytest.raises(MegatronCoreAPIError, match=f"megatron-core {outside}: r3lab was checked against"):
            mcore_api.check_mcore_version(outside)
    assert mcore_api.check_mcore_version("0.19.5rc1") == "0.19.5rc1"


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
        forward_tokens(model, MTOK)
    for h in handles:
        h.remove()
    assert all(torch.equal(seen[g][0], _as_map(new[g])) for g in (1, 2))
    with megatron_replay(model, [new], orphans="prune") as rep:
        assert len(RouterReplay.global_router_replay_instances) == 2
        rep.begin_microbatch()
        forward_tokens(model, MTOK)
    RouterReplay.clear_global_router_replay_instances()
    with pytest.raises(ReplayError, match="not in RouterReplay's global registry"):
        MegatronReplay(model)


@pytest.mark.parametrize("mode", ["replay", "record"])
def test_megatron_exit_leaves_another_models_router_replays_alone(megatron_world, mode):
    """orphans='ignore' promises that the other model's routers are not ours to touch: not on exit either."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    other = _gpt()  # e.g. a live reference model, mid-way through its own replay
    model = _gpt()
    other_rrs = [r.router_replay for r in megatron_routers(other)[0].values()]
    held = _random_routes(20, [1, 2], seed=31)
    for rr, g in zip(other_rrs, (1, 2), strict=True):
        rr.set_target_indices(held[g])
        rr.record_indices(held[g].flip(1))
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    before = [
        (rr.router_replay_action, rr.target_topk_idx, rr.recorded_topk_idx, list(rr.replay_backward_list))
        for rr in other_rrs
    ]
    with megatron_replay(
        model, [_random_routes(20, [1, 2])] if mode == "replay" else None, mode, orphans="ignore"
    ) as rep:
        rep.begin_microbatch()
        forward_tokens(model, MTOK)
        rep.after_forward()
    assert _replay_state_clean(model)
    for rr, (action, target, recorded, queue) in zip(other_rrs, before, strict=True):
        assert rr.router_replay_action is action and rr.target_topk_idx is target and rr.recorded_topk_idx is recorded
        assert len(rr.replay_backward_list) == len(queue) and all(
            a is b for a, b in zip(rr.replay_backward_list, queue, strict=True)
        )
    seen, handles = _spy_routers(other)
    forward_tokens(other, MTOK)  # and the other model still replays what it held
    for h in handles:
        h.remove()
    assert all(torch.equal(seen[g][0], _as_map(held[g])) for g in (1, 2))


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
            forward_tokens(model, MTOK)
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
        forward_tokens(model, MTOK)
    for h in handles:
        h.remove()
    assert all(torch.equal(seen[g][0], _as_map(new[g])) for g in (1, 2))
    assert _replay_state_clean(model)
