"""MTP routers under replay (issue 26): a Megatron GPTModel with an MTP block on the tiny Qwen3-MoE shape.

One gloo rank (world size 1, in this process), random init, ``moe_enable_routing_replay=True``, one model for the
module. What RouterReplay registers with an MTP block; that the decoder layers replay exactly the engine's routes
while the MTP router routes live (checked against its own top-k recomputed from its input and weight), or replays
a route source of its own; and that the field's ways of feeding routers (by ``layer_number``, by list position,
by a global action) hand an MTP router a decoder layer's routes or shift the decoder, which r3lab refuses.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from r3lab.errors import ReplayError
from r3lab.paths import model_dir
from r3lab.replay import mcore_api, megatron_replay, megatron_router_map
from r3lab.slicing import ParallelLayout
from r3lab.testing import megatron as mc
from r3lab.trainers.megatron import causal_mask, forward_tokens, launch

CFG = json.loads((model_dir("tiny-qwen3-moe") / "config.json").read_text())
L, E, K, H = CFG["num_hidden_layers"], CFG["num_experts"], CFG["num_experts_per_tok"], CFG["hidden_size"]
B, S = 2, 10
TOK = torch.randint(0, CFG["vocab_size"], (B, S), generator=torch.Generator().manual_seed(5))
MCORE = mcore_api.mcore_version()
#: the MTP router's layer_number for MTP depth 1, as read in each release: num_layers + 1 at 0.16.1, 1 at 0.19.2
MTP_NUMBER = {"0.16.1": L + 1, "0.19.2": 1}[MCORE]


def _spec(pp: int = 1, **extra) -> mc.TinyGPTSpec:
    return mc.TinyGPTSpec(
        ParallelLayout(num_layers=L, pp=pp),  # every layer MoE, as the tiny model (mlp_only_layers = [])
        hidden_size=H,
        num_attention_heads=CFG["num_attention_heads"],
        ffn_hidden_size=CFG["intermediate_size"],
        num_experts=E,
        topk=K,
        moe_ffn_hidden_size=CFG["moe_intermediate_size"],
        vocab_size=CFG["vocab_size"],
        mtp_num_layers=1,
        extra_config=dict(num_query_groups=CFG["num_key_value_heads"], kv_channels=CFG["head_dim"],
                          qk_layernorm=True, layernorm_epsilon=CFG["rms_norm_eps"], **extra),
    )


@pytest.fixture(scope="module")
def model():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    mc.init_cpu_parallel()
    RouterReplay.clear_global_router_replay_instances()
    (m,) = mc.build_tiny_gpt(_spec(), init_parallel=False)
    yield m
    RouterReplay.clear_global_router_replay_instances()
    mc.destroy_cpu_parallel()  # the gloo group stays: in-process vLLM engines of this session may hold it


def _forward(m, grad=False):
    """The model's forward with labels (an MTP block needs them): per-token loss [B, S]."""
    pos = torch.arange(S)[None].expand(B, S)
    with torch.set_grad_enabled(grad):
        return m(input_ids=TOK, position_ids=pos, attention_mask=causal_mask(S, batch=B), labels=TOK)


def _spy(m):
    """Every router's (input, chosen top-k as a [tokens, E] map) in each forward: decoder ids, then 'mtp'."""
    rm = megatron_router_map(m)
    seen: dict = {}
    named = [*rm.decoder.items(), *(("mtp", r) for r in rm.mtp.values())]
    hooks = [r.register_forward_hook(lambda mod, a, o, g=g: seen.setdefault(g, []).append((a[0].detach(),
                                                                                             o[1].clone())))
             for g, r in named]
    return seen, hooks


def _as_map(ids) -> torch.Tensor:
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
    return torch.zeros(ids.shape[0], E, dtype=torch.bool).scatter_(1, ids, True)


def _own_topk(router, x) -> torch.Tensor:
    """Oracle: the router's own choice on its input (top-k of the logits; softmax keeps the order)."""
    logits = x.reshape(-1, H).double() @ router.weight.detach().double().T
    return _as_map(logits.topk(K, dim=1).indices)


def _routes(seed: int, n: int = L) -> list[np.ndarray]:
    """``n`` layers of valid engine-like routes [B*S, K] (distinct ids per row), seeded."""
    rng = np.random.default_rng(seed)
    return [np.stack([rng.choice(E, K, replace=False) for _ in range(B * S)]).astype(np.int64) for _ in range(n)]


def _clear(hooks):
    for h in hooks:
        h.remove()


# ---- what RouterReplay registers ---------------------------------------------------------------------------------
def test_router_replay_registers_decoder_then_mtp(model):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    reg = RouterReplay.global_router_replay_instances
    rm = megatron_router_map(model)
    dec = [layer.mlp.router for layer in model.decoder.layers]
    mtp_layer = model.mtp.layers[0]
    inner = getattr(mtp_layer, {"0.16.1": "transformer_layer", "0.19.2": "mtp_model_layer"}[MCORE])
    assert mcore_api.mtp_inner_layer(mtp_layer) is inner
    assert len(reg) == L + 1 == len(rm.decoder) + len(rm.mtp)  # nine: 8 decoder MoE layers + 1 MTP MoE layer
    assert [id(rr) for rr in reg] == [id(r.router_replay) for r in [*dec, inner.mlp.router]]
    assert [r.layer_number for r in dec] == list(range(1, L + 1))
    # the MTP layer is numbered from 1; its inner layer (and router) num_layers + 1 at 0.16.1, 1 at 0.19.2
    assert mtp_layer.layer_number == 1 and inner.mlp.router.layer_number == MTP_NUMBER
    assert all(rm.decoder[g] is dec[g] for g in range(L)) and rm.mtp[0] is inner.mlp.router
    # the test weights key the MTP layer num_layers + 1 in every release, never as decoder layer 0 (same number)
    qkv = [lay.self_attention.linear_qkv.weight for lay in (inner, model.decoder.layers[0])]
    assert qkv[0].shape == qkv[1].shape and not torch.equal(*qkv)
    assert rm.dense == () and rm.mtp_layers == 1
    # Megatron's own positional API wants one tensor per registered instance: the engine's 8 decoder layers fail
    with pytest.raises(ValueError, match="does not match instances"):
        RouterReplay.set_replay_data([torch.as_tensor(r) for r in _routes(0)])


# ---- replay with an MTP block present ----------------------------------------------------------------------------
def test_decoder_layers_replay_engine_routes_mtp_router_live(model):
    engine = _routes(1)
    seen, hooks = _spy(model)
    try:
        with megatron_replay(model, [engine]) as rep:  # mtp="live" is the default
            rep.begin_microbatch()
            _forward(model)
            rep.after_forward()
    finally:
        _clear(hooks)
    for g in range(L):
        assert torch.equal(seen[g][0][1], _as_map(engine[g])), f"decoder layer {g} did not route the engine's ids"
    (x, got), mtp = seen["mtp"][0], megatron_router_map(model).mtp[0]
    assert torch.equal(got, _own_topk(mtp, x))  # the MTP router chose on its own
    for g in range(L):  # ... and no decoder layer's routes reached it
        assert (got != _as_map(engine[g])).any(dim=1).float().mean() > 0.5


def test_mtp_router_replays_its_own_route_source(model):
    engine, mtp_src = _routes(2), _routes(3, n=1)
    seen, hooks = _spy(model)
    try:
        with megatron_replay(model, [engine], mtp="replay", mtp_routes=[mtp_src]) as rep:
            rep.begin_microbatch()
            loss = _forward(model, grad=True)
            rep.after_forward()
            loss.sum().backward()  # REPLAY_BACKWARD state for the MTP router too; no recomputation here
        model.zero_grad(set_to_none=True)
    finally:
        _clear(hooks)
    assert all(torch.equal(seen[g][0][1], _as_map(engine[g])) for g in range(L))
    assert torch.equal(seen["mtp"][0][1], _as_map(mtp_src[0]))
    rr = megatron_router_map(model).mtp[0].router_replay  # cleared on exit
    assert rr.router_replay_action is None and rr.target_topk_idx is None and rr.replay_backward_list == []


def test_mtp_record_then_replay_reproduces_the_live_forward(model):
    with megatron_replay(model, mode="record", mtp="record") as rec:
        rec.begin_microbatch()
        live = _forward(model)
        dec = rec.after_forward()
    (mtp_own,) = rec.recorded_mtp
    with megatron_replay(model, [dec], mtp="replay", mtp_routes=[mtp_own]) as rep:  # R2, MTP included
        rep.begin_microbatch()
        again = _forward(model)
        rep.after_forward()
    assert sorted(dec) == list(range(L)) and sorted(mtp_own) == [0]
    assert torch.equal(live, again)
    with pytest.raises(ReplayError, match="mtp='replay' needs mode='replay'"):
        megatron_replay(model, mode="record", mtp="replay").__enter__()
    with pytest.raises(ReplayError, match="takes no mtp_routes"):
        megatron_replay(model, [dec], mtp_routes=[mtp_own]).__enter__()


# ---- the field's ways of feeding routers, and what r3lab does instead ------------------------------------------
def test_feeding_by_layer_number_gives_the_mtp_router_decoder_routes(model):
    """megatron-core 0.19.2 (as Megatron-LM main at f2f0f7b, NeMo-RL #4057 review) numbers MTP inner layers from 1:
    an MTP router shares ``layer_number`` 1 with decoder layer 0 (at 0.16.1 the test renumbers it so). A replay keyed
    on ``layer_number`` (NeMo-RL's legacy ``NRL_ROUTER_REPLAY_EXCLUDE_MTP=0`` path) then feeds it decoder layer 0's
    routes."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    engine = _routes(4)
    inner = mcore_api.mtp_inner_layer(model.mtp.layers[0])
    saved = inner.layer_number
    inner.layer_number = inner.mlp.router.layer_number = 1  # 0.19.2's numbering (already so there)
    seen, hooks = _spy(model)
    try:
        for m in model.modules():  # the naive replay: every router gets routes[layer_number - 1]
            if isinstance(m, TopKRouter):
                m.router_replay.set_target_indices(torch.as_tensor(engine[m.layer_number - 1]))
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        _forward(model)
        naive = seen["mtp"][-1][1]
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        assert torch.equal(naive, _as_map(engine[0]))  # the bug: MTP routed with decoder layer 0's routes
        rm = megatron_router_map(model)  # r3lab finds routers by place, so the renumbering changes nothing
        assert sorted(rm.decoder) == list(range(L)) and rm.mtp[0] is inner.mlp.router
        with megatron_replay(model, [engine]) as rep:
            rep.begin_microbatch()
            _forward(model)
            rep.after_forward()
        x, got = seen["mtp"][-1]
        assert torch.equal(got, _own_topk(inner.mlp.router, x)) and not torch.equal(got, _as_map(engine[0]))
        assert all(torch.equal(seen[g][-1][1], _as_map(engine[g])) for g in range(L))
    finally:
        _clear(hooks)
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        inner.layer_number = inner.mlp.router.layer_number = saved


def test_feeding_by_list_position_shifts_the_decoder_and_r3lab_refuses(model):
    """An engine dump holding the MTP draft layer's rows at position 0 (vLLM #48622) fed by list position
    (Megatron's ``RouterReplay.set_replay_data``): every decoder layer gets the layer before's routes."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    engine, draft = _routes(5), _routes(6, n=1)
    dump = [*draft, *engine]  # nine arrays, as many as RouterReplay has instances: its count check passes
    seen, hooks = _spy(model)
    try:
        RouterReplay.set_replay_data([torch.as_tensor(a) for a in dump])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        _forward(model)
    finally:
        _clear(hooks)
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
    assert torch.equal(seen[0][0][1], _as_map(draft[0]))  # decoder layer 0 routed with the MTP draft's rows
    assert all(torch.equal(seen[g][0][1], _as_map(engine[g - 1])) for g in range(1, L))  # shifted by one
    assert torch.equal(seen["mtp"][0][1], _as_map(engine[L - 1]))  # and the MTP router the last layer's
    with pytest.raises(ReplayError, match="9 id tensors for 8 routers.*plus 1 MTP routers.*mtp_routes"):
        with megatron_replay(model, [dump]) as rep:
            rep.begin_microbatch()


def test_a_global_action_on_a_live_mtp_router_fails_loudly(model):
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    try:
        with pytest.raises(ReplayError, match=r"MTP router \(depth 0\) has replay action REPLAY_FORWARD"):
            with megatron_replay(model, [_routes(7)]) as rep:
                rep.begin_microbatch()
                RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)  # e.g. a framework
                _forward(model)
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()


# ---- the count of registered routers against the config ----------------------------------------------------------
def test_router_count_must_match_decoder_moe_plus_mtp_moe(model):
    cfg = model.config
    router0, mtp_router = model.decoder.layers[0].mlp.router, mcore_api.mtp_inner_layer(model.mtp.layers[0]).mlp.router
    cases = [
        ("moe_layer_freq", [1] * (L - 1) + [0], "moe_layer_freq routes layers"),
        ("mtp_num_layers", 2, "MTP block has 1 layers, config.mtp_num_layers=2"),
    ]
    for attr, value, msg in cases:
        saved = getattr(cfg, attr)
        setattr(cfg, attr, value)
        try:
            with pytest.raises(ReplayError, match=msg):
                megatron_router_map(model)
        finally:
            setattr(cfg, attr, saved)
    saved = mtp_router.router_replay
    mtp_router.router_replay = router0.router_replay
    try:
        with pytest.raises(ReplayError, match="share one RouterReplay"):
            megatron_router_map(model)
    finally:
        mtp_router.router_replay = saved
    model.stray = copy.copy(router0)  # another TopKRouter object, outside the decoder and the MTP block
    try:
        with pytest.raises(ReplayError, match="sit neither in the decoder's layers nor in the MTP block"):
            megatron_replay(model, [_routes(8)], orphans="ignore").__enter__()
    finally:
        del model.stray
    assert sorted(megatron_router_map(model).decoder) == list(range(L))  # all restored


# ---- two pipeline stages: the MTP block on the last --------------------------------------------------------------
def _pp2_worker(rank: int, world: int, engine: list[np.ndarray]) -> dict:
    """PP=2 on two gloo ranks: what each stage registers, and replay of the engine's routes with MTP live."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # language_module.py l.243 moves the MTP stage's embedding copy to CUDA before its all-reduce with stage 0
    # (hard-coded .cuda()); in this spawned rank only, for the build, a tensor stays where it is
    cuda, torch.Tensor.cuda = torch.Tensor.cuda, lambda self, *a, **k: self
    try:
        (m,) = mc.build_tiny_gpt(_spec(pp=2))
    finally:
        torch.Tensor.cuda = cuda
    rm = megatron_router_map(m)
    reg = RouterReplay.global_router_replay_instances
    out = dict(decoder=sorted(rm.decoder), mtp=sorted(rm.mtp), registry=len(reg),
               in_order=[id(x) for x in reg] == [id(x) for x in rm.replays()],
               numbers=[r.layer_number for r in [*rm.decoder.values(), *rm.mtp.values()]])
    seen, hooks = _spy(m)
    pos, mask = torch.arange(S)[None].expand(B, S), causal_mask(S, batch=B)
    with megatron_replay(m, [{g: engine[g] for g in rm.decoder}]) as rep, torch.no_grad():
        rep.begin_microbatch()
        if ps.get_pipeline_model_parallel_rank() == 0:
            y = forward_tokens(m, TOK, position_ids=pos, attention_mask=mask)
            dist.send(y.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        else:
            x = torch.empty(S, B, H)
            dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
            m.set_input_tensor(x)
            m(input_ids=TOK, position_ids=pos, attention_mask=mask, labels=TOK)
        rep.after_forward()
    _clear(hooks)
    out["decoder_replayed"] = all(torch.equal(seen[g][0][1], _as_map(engine[g])) for g in rm.decoder)
    if rm.mtp:
        x, got = seen["mtp"][0]
        out["mtp_own"] = torch.equal(got, _own_topk(rm.mtp[0], x))
        out["mtp_is_any_decoder"] = any(torch.equal(got, _as_map(e)) for e in engine)
    mc.destroy_cpu_parallel()
    return out


def test_two_pipeline_stages_mtp_on_the_last_replays_decoder_routes_only():
    engine = _routes(9)
    first, last = launch(_pp2_worker, 2, engine)
    assert first == dict(decoder=[0, 1, 2, 3], mtp=[], registry=4, in_order=True, numbers=[1, 2, 3, 4],
                         decoder_replayed=True)
    # the last stage: its 4 decoder routers, then the MTP router, numbered as on one stage (num_layers + 1 at 0.16.1,
    # 1 at 0.19.2)
    assert last == dict(decoder=[4, 5, 6, 7], mtp=[0], registry=5, in_order=True, numbers=[5, 6, 7, 8, MTP_NUMBER],
                        decoder_replayed=True, mtp_own=True, mtp_is_any_decoder=False)
