"""Routing-weight replay (R3W) without an engine: weights in Routes and the container, replay in transformers and
Megatron-core. The engine side (capture equals the engine router's own weights) is tests/test_r3w_engine.py."""

from __future__ import annotations

import inspect
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from r3lab.compaction import READ_VERSIONS, WeightCodec, decode, encode, read_header
from r3lab.compaction.codecs import PIPELINES
from r3lab.errors import ReplayError, RouteFormatError
from r3lab.replay import find_hf_routers, hf_replay, megatron_replay, megatron_weight_replay
from r3lab.replay.megatron_weights import check_megatron_router, count_weight_patches
from r3lab.rollout import append_last_row
from r3lab.routes import Routes
from r3lab.slicing import ParallelLayout
from r3lab.testing import random_route_tensors, tiny_moe_config

E, K, V = 8, 2, 64
FIXTURES = Path(__file__).parent / "fixtures"


def _weighted(seed: int = 0, T: int = 11, L: int = 3, E: int = 16, K: int = 4) -> Routes:
    rng = np.random.default_rng(seed)
    v = np.argsort(rng.random((T * L, E)), axis=1)[:, :K].reshape(T, L, K)
    w = rng.random((T, L, K)).astype(np.float32)
    return Routes(v, [0, 4, 4, T], E, [1, 2, 5], weights=w / w.sum(-1, keepdims=True))


# ---- Routes carry weights with their ids ---------------------------------------------------------
def test_routes_views_keep_each_weight_with_its_id():
    r = _weighted()
    pairs = {(t, g, int(i)): float(w) for t in range(r.total_tokens) for li, g in enumerate(r.layer_ids)
             for i, w in zip(r.values[t, li], r.weights[t, li], strict=True)}
    s = r.sorted_rows()
    assert all(pairs[(t, g, int(i))] == float(w) for t in range(s.total_tokens) for li, g in enumerate(s.layer_ids)
               for i, w in zip(s.values[t, li], s.weights[t, li], strict=True))
    t = r.take([2, 0])
    assert np.array_equal(t.weights, np.concatenate([r.weights[4:], r.weights[:4]]))
    assert np.array_equal(r.select_layers([5, 1]).weights, r.weights[:, [0, 2]])
    assert np.array_equal(Routes.concat(r.split(2)).weights, r.weights)
    last = append_last_row(r)
    assert last.weights.shape == (r.total_tokens + 3, 3, 4)
    assert np.allclose(last.weights[4], 1 / 4) and np.array_equal(last.weights[:4], r.weights[:4])
    assert r.without_weights().weights is None and r.without_weights() != r
    with pytest.raises(RouteFormatError, match="no routing weights"):
        Routes.concat([r, r.without_weights()])
    with pytest.raises(RouteFormatError, match="shape"):
        r.with_weights(r.weights[:, :, :2])
    with pytest.raises(RouteFormatError, match="not finite"):
        r.with_weights(np.where(r.weights > 0.5, np.nan, r.weights))


# ---- the container: format version 3 beside 1 and 2 ----------------------------------------------
@pytest.mark.parametrize("codec", PIPELINES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_container_carries_weights_in_each_codec_and_dtype(codec, dtype):
    r = _weighted(1)
    buf = encode(r, codec, weights=dtype)
    h = read_header(buf)
    assert h["format_version"] == 3 and h["weights"] == {"id": "weights", "dtype": dtype}
    back = decode(buf)
    oracle = torch.from_numpy(np.ascontiguousarray(r.weights)).to(getattr(torch, dtype)).float().numpy()
    # weights follow their ids whether the codec keeps the row order (raw, bitpack) or sorts it (topk-*)
    s, o = r.sorted_rows(), Routes(r.values, r.cu_seqlens, r.num_experts, r.layer_ids, weights=oracle).sorted_rows()
    assert np.array_equal(back.sorted_rows().values, s.values)
    assert np.array_equal(back.sorted_rows().weights, o.weights)  # torch's own rounding is the oracle
    ids_only = encode(r.without_weights(), codec)
    assert read_header(ids_only)["format_version"] == 2  # ids-only bytes are still version 2, unchanged
    block = r.values.size * WeightCodec(dtype).encoded_size((1,))
    assert len(buf) - len(ids_only) == block + len(h_extra(buf, ids_only))


def h_extra(buf: bytes, ids_only: bytes) -> bytes:
    """The header bytes the weights field adds (the rest of the size difference is the weights block)."""
    hw = struct.unpack_from("<I", buf, 8)[0]
    h2 = struct.unpack_from("<I", ids_only, 8)[0]
    return b"x" * (hw - h2)


def test_container_refuses_malformed_weights():
    r = _weighted(2)
    buf = bytearray(encode(r, "raw"))
    # a version 2 frame that carries a weights field is refused (version 2 readers never knew weights)
    v2 = bytearray(buf)
    v2[4] = 2
    v2[-4:] = struct.pack("<I", zlib.crc32(bytes(v2[:-4])))
    with pytest.raises(RouteFormatError, match="exist from version 3"):
        decode(bytes(v2))
    ids_only = bytearray(encode(r.without_weights(), "raw"))
    ids_only[4] = 3
    ids_only[-4:] = struct.pack("<I", zlib.crc32(bytes(ids_only[:-4])))
    with pytest.raises(RouteFormatError, match="without a 'weights' header field"):
        decode(bytes(ids_only))
    with pytest.raises(RouteFormatError, match="truncated"):
        decode(bytes(buf[:-10]))
    with pytest.raises(RouteFormatError, match="beyond float16"):
        encode(r.with_weights(np.full_like(r.weights, 7e4)), "raw", weights="float16")
    with pytest.raises(RouteFormatError, match="weights dtype"):
        encode(r, "raw", weights="int8")
    assert READ_VERSIONS == (1, 2, 3)


def test_old_fixtures_still_decode_without_weights_and_v3_fixtures_decode_with_them():
    for folder in (FIXTURES / "v2", FIXTURES / "v1-cf15985", FIXTURES):
        for f in sorted(folder.glob("e64k8.*.r3")):
            assert decode(f.read_bytes()).weights is None
    v3 = sorted((FIXTURES / "v3").glob("*.r3"))
    assert len(v3) >= 9
    for f in v3:
        name = f.name.split(".")[0]
        exp = np.load(FIXTURES / "v3" / f"{name}.expected.npz")
        got = decode(f.read_bytes()).sorted_rows()
        want = Routes(exp["values"], exp["cu_seqlens"], int(exp["num_experts"]), exp["layer_ids"],
                      weights=exp["weights"]).sorted_rows()
        dtype = read_header(f.read_bytes())["weights"]["dtype"]
        assert np.array_equal(got.values, want.values)
        oracle = torch.from_numpy(np.ascontiguousarray(want.weights)).to(getattr(torch, dtype)).float().numpy()
        assert np.array_equal(got.weights, oracle), f.name


# ---- transformers: R3W hands the experts exactly the engine's weights ----------------------------
@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_moe_config("qwen3_moe", num_experts=E, top_k=K, vocab_size=V), attn_implementation="eager")
    with torch.no_grad():
        for router in find_hf_routers(model).values():
            router.weight.normal_(0.0, 0.5)
    return model


TOKENS = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(1))


def _engine_like_routes(model) -> Routes:
    layers = list(find_hf_routers(model))
    ids = random_route_tensors(12, layers, num_experts=E, top_k=K, seed=3)
    vals = np.stack([ids[g].numpy() for g in layers], axis=1)
    w = np.random.default_rng(4).random(vals.shape).astype(np.float32) + 0.1
    return Routes(vals, [0, 12], E, layers, weights=w / w.sum(-1, keepdims=True))


def _spy_experts(model):
    seen: dict[int, list] = {}
    handles = []
    names = {m: n for n, m in model.named_modules()}
    for g, router in find_hf_routers(model).items():
        block = model.get_submodule(names[router].rsplit(".", 1)[0])
        handles.append(block.experts.register_forward_pre_hook(
            lambda m, a, g=g: seen.setdefault(g, []).append((a[1].clone(), a[2].detach().clone()))))
    return seen, handles


@pytest.mark.parametrize("mode", ["stop", "straight"])
def test_hf_r3w_gives_the_experts_exactly_the_engine_weights(qwen, mode):
    routes = _engine_like_routes(qwen)
    seen, handles = _spy_experts(qwen)
    try:
        qwen.zero_grad(set_to_none=True)
        with hf_replay(qwen, routes, weights=mode, record_replayed=True) as rep:
            qwen(TOKENS).logits.float().logsumexp(-1).mean().backward()
    finally:
        for h in handles:
            h.remove()
    for j, g in enumerate(routes.layer_ids):
        ids, w = seen[g][0]
        assert torch.equal(ids, torch.as_tensor(routes.values[:, j].astype(np.int64)))
        assert torch.equal(w.float(), torch.from_numpy(routes.weights[:, j]).to(w.dtype).float())
        assert torch.equal(rep.replayed_weights[g][0].float(), w.float())
    grads = [r.weight.grad for r in find_hf_routers(qwen).values()]
    if mode == "stop":  # the engine's weights are constants: the loss sends the router nothing (#3509)
        assert all(gr is None or not gr.any() for gr in grads)
    else:  # straight-through: the live rule's gradient at the replayed ids
        assert all(gr is not None and gr.abs().sum() > 0 for gr in grads)
    qwen.zero_grad(set_to_none=True)


def test_hf_r3w_differs_from_r3_and_refuses_routes_without_weights(qwen):
    routes = _engine_like_routes(qwen)
    with torch.no_grad():
        with hf_replay(qwen, routes.without_weights()):
            r3 = qwen(TOKENS).logits
        with hf_replay(qwen, routes, weights="stop"):
            stop = qwen(TOKENS).logits
        with hf_replay(qwen, routes, weights="straight"):
            straight = qwen(TOKENS).logits
    assert torch.equal(stop, straight) and not torch.allclose(stop, r3)
    with pytest.raises(ReplayError, match="carry them"):
        with hf_replay(qwen, routes.without_weights(), weights="stop"):
            pass
    with pytest.raises(ReplayError, match="weights must be one of"):
        with hf_replay(qwen, routes, weights="frozen"):
            pass


# ---- Megatron-core: RouterReplay replays ids; r3lab's patch adds the weights ---------------------
@pytest.fixture(scope="module")
def megatron_world():
    from r3lab.testing import megatron as mc

    mc.init_cpu_parallel()
    yield mc
    mc.destroy_cpu_parallel()  # the gloo group stays: in-process vLLM engines of this session may hold it


@pytest.fixture(autouse=True)
def _reset_router_replay_registry():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    yield
    RouterReplay.clear_global_router_replay_instances()


def _gpt(mc, *, recompute=False, **extra):
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    spec = mc.TinyGPTSpec(ParallelLayout(num_layers=3, moe_layer_ids=(1, 2)), num_experts=E, topk=K, extra_config=extra)
    (model,) = mc.build_tiny_gpt(spec, init_parallel=False)
    return model


MTOK = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))


def _ids_and_weights():
    ids = random_route_tensors(20, [1, 2], num_experts=E, top_k=K, seed=5)
    w = {g: torch.rand(20, K, generator=torch.Generator().manual_seed(g)) + 0.05 for g in (1, 2)}
    return ids, w


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", ["stop", "straight"])
def test_megatron_r3w_gives_the_experts_exactly_the_engine_weights(megatron_world, recompute, mode):
    from r3lab.trainers.megatron import forward_tokens
    mc = megatron_world
    model = _gpt(mc, recompute=recompute)
    model.train()
    ids, w = _ids_and_weights()
    seen: dict[int, list] = {}
    from r3lab.replay import megatron_routers

    routers, _ = megatron_routers(model)
    hooks = [r.register_forward_hook(lambda m, a, o, g=g: seen.setdefault(g, []).append(o[0].detach().clone()))
             for g, r in routers.items()]
    with megatron_replay(model, [ids]) as rep:
        rep.begin_microbatch()
        r3 = forward_tokens(model, MTOK)
    seen.clear()
    with megatron_weight_replay(model, [ids], [w], weights=mode) as rep:
        assert count_weight_patches(model) == 4
        rep.begin_microbatch()
        out = forward_tokens(model, MTOK, grad=True)
        rep.after_forward()
        out.float().square().mean().backward()
    for h in hooks:
        h.remove()
    assert count_weight_patches(model) == 0
    calls = 2 if recompute else 1  # recomputation in backward mixes with the same weights
    for g in (1, 2):
        assert len(rep.used[g]) == calls and all(torch.equal(u, w[g]) for u in rep.used[g])
        dense = seen[g][0]  # what the router returned to the experts' dispatcher: [tokens, E]
        assert torch.equal(dense.gather(1, ids[g]).float(), w[g])
        assert int((dense != 0).sum()) == 20 * K
    assert not torch.allclose(out.detach(), r3)
    grads = [p.grad for n, p in model.named_parameters() if "router" in n]
    assert len(grads) == 2
    if mode == "stop":
        assert all(gr is None or not gr.any() for gr in grads)
    else:
        assert all(gr is not None and gr.abs().sum() > 0 for gr in grads)


def test_megatron_r3w_guards(megatron_world, monkeypatch):
    from r3lab.trainers.megatron import forward_tokens
    mc = megatron_world
    model = _gpt(mc, moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs")
    ids, w = _ids_and_weights()
    with pytest.raises(ReplayError, match="routing_map is not the replayed ids"):
        with megatron_weight_replay(model, [ids], [w]) as rep:
            rep.begin_microbatch()
            forward_tokens(model, MTOK)
    assert count_weight_patches(model) == 0
    bad = {g: t[:, :1] for g, t in w.items()}
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    model = _gpt(mc)
    with pytest.raises(ReplayError, match="like its ids"):
        with megatron_weight_replay(model, [ids], [bad]) as rep:
            rep.begin_microbatch()
    from megatron.core.transformer.moe.router import TopKRouter

    src = inspect.getsource(TopKRouter.routing)
    monkeypatch.setattr(inspect, "getsource", lambda obj: src.replace("router_replay=self.router_replay", "")
                        if obj is TopKRouter.routing else inspect.getsourcelines(obj) and "".join(
                            inspect.getsourcelines(obj)[0]))
    with pytest.raises(ReplayError, match="changed under r3lab"):
        check_megatron_router()


def test_the_gloo_group_an_in_process_engine_holds_is_never_destroyed(megatron_world, monkeypatch):
    """A Megatron teardown that destroyed the process group an in-process vLLM engine had set up its world group on
    broke every engine started after it ("Process group ... is not initialized in the world group map", seen in a
    shuffled suite): destroy_parallel refuses, naming why, and the group stays."""
    import sys
    import types

    import torch.distributed as dist

    from r3lab.errors import R3LabError

    assert dist.is_initialized()
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", types.SimpleNamespace(_WORLD=object()))
    with pytest.raises(R3LabError, match="an in-process vLLM engine holds this process's torch.distributed group"):
        megatron_world.destroy_cpu_parallel(keep_process_group=False)
    assert dist.is_initialized()
    megatron_world.init_cpu_parallel()  # the module's Megatron groups back for the tests after this one
