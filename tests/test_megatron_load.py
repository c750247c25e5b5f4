"""Megatron-core GPTModels from the shipped checkpoints on gloo CPU ranks (r3lab.trainers.megatron).

Proof of the loading: with the transformers model's own routes replayed on both sides (so no routing flip
can enter), Megatron's fp32 log-probs equal transformers' fp32 log-probs on the same tokens within 1e-4,
in every layout; the weights gathered back from the shards equal the checkpoint's tensors bit for bit.
With native routing the share of agreeing routers is measured, not assumed: tiny-qwen3-moe agrees
everywhere, tiny-glm4-moe does not, because Megatron-core scores expert groups differently (the last
tests pin that cause against both implementations' own code).
All Megatron runs hold the heavy lock (``flock /tmp/r3lab-heavy.lock``).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from port_grabber import grabbing_ports

from r3lab.errors import LaunchTimeout, MegatronLoadError
from r3lab.families import group_routing_mismatch
from r3lab.paths import model_dir
from r3lab.replay import load_hf_model, score_batch
from r3lab.routes import Routes
from r3lab.slicing import ParallelLayout
from r3lab.testing import megatron as mc
from r3lab.trainers import megatron as tm

MODELS = ("tiny-qwen3-moe", "tiny-glm4-moe")
B, S = 4, 24  # 4 sequences: up to 4 DP ranks; 24 tokens: divisible by tp=2 (sequence parallelism)
WORLD = 4
# name -> ParallelLayout fields (world size 4; dp fills the ranks tp*pp leaves)
LAYOUTS = {
    "tp2_sp_dp2": dict(tp=2, dp=2, sequence_parallel=True),
    "pp2_uneven_dp2": dict(pp=2, dp=2, first_stage_layers=3, last_stage_layers=5),
    "ep2_dp4": dict(ep=2, dp=4),
    "tp2_sp_pp2": dict(tp=2, pp=2, sequence_parallel=True),
}
TOL = 1e-4  # fp32 on both sides, different kernels and summation orders (measured ~2e-6)


def _inputs(name: str):
    """Tokens, the transformers model's native routes and log-probs (record) and its replayed log-probs."""
    d = model_dir(name)
    torch.manual_seed(7)
    tokens = torch.randint(4, 388, (B, S))
    hf = load_hf_model(d)
    scored = torch.ones(B, S, dtype=torch.bool)
    scored[:, 0] = False
    rec = score_batch(hf, tokens, None, scored, record=True)
    rep = score_batch(hf, tokens, None, scored, routes=rec.routes)
    return tokens, rec.routes, rec.logprobs.view(B, S - 1), rep.logprobs.view(B, S - 1)


def _rank(rank: int, world: int, jobs: list) -> list[dict]:
    """One rank: for each (model, layout), build and load, score with replayed and native routes, export."""
    out = []
    for name, lay_kw, tokens, packed in jobs:
        routes = Routes(*packed)  # Routes refuses pickling (immutable), so it travels as its parts
        d = model_dir(name)
        layout = tm.layout_for(d, packed=False, **lay_kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tm.GroupRoutingMismatchWarning)
            model = tm.build_model(d, layout)
        rp = mc.replay_then_record(model, layout, tokens, routes)
        last = rp.replay_logits is not None
        lp_replay = tm.logits_logprobs(rp.replay_logits, rp.tokens) if last else None
        lp_native = tm.logits_logprobs(rp.native_logits, rp.tokens) if last else None
        out.append(dict(model=name, last=last, lp_replay=lp_replay, lp_native=lp_native,
                        export=mc.export_check(model, d),
                        rank=dataclasses.replace(rp, tokens=None, replay_logits=None, native_logits=None)))
        tm.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    inputs = {name: _inputs(name) for name in MODELS}
    jobs = [(name, kw, inputs[name][0], mc.route_parts(inputs[name][1]))
            for name in MODELS for kw in LAYOUTS.values()]
    per_rank = tm.launch(_rank, WORLD, jobs, timeout_s=240)
    table = {}
    for j, (name, lay) in enumerate((n, lay) for n in MODELS for lay in LAYOUTS):
        tokens, routes, hf_native, hf_replay = inputs[name]
        mg_replay = torch.full((B, S - 1), float("nan"))
        mg_native = torch.full((B, S - 1), float("nan"))
        export = None
        for r in per_rank:
            res = r[j]
            if res["export"] is not None:
                export = res["export"]
            if res["last"] and res["rank"].tp == 0:
                mg_replay[torch.from_numpy(res["rank"].seqs)] = res["lp_replay"]
                mg_native[torch.from_numpy(res["rank"].seqs)] = res["lp_native"]
        agree, total = mc.router_agreement(routes, [r[j]["rank"] for r in per_rank],
                                           sequence_parallel=bool(LAYOUTS[lay].get("sequence_parallel")))
        table[(name, lay)] = dict(
            replay=float((mg_replay - hf_replay).abs().max()),
            native=float((mg_native - hf_native).abs().max()),
            agree=agree / total,
            rows=total,
            export=export,
        )
    print("\nmodel           layout          max|dlogp| replay  max|dlogp| native  routers agreeing")
    for (name, lay), v in table.items():
        print(f"{name:15s} {lay:15s} {v['replay']:.2e}{'':11s}{v['native']:.2e}{'':11s}{v['agree']:.4f} of {v['rows']}")
    return table


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("lay", list(LAYOUTS))
def test_replayed_logprobs_equal_transformers(results, name, lay):
    v = results[(name, lay)]
    assert np.isfinite(v["replay"]) and v["replay"] < TOL, v


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("lay", list(LAYOUTS))
def test_export_gives_back_the_checkpoint_bit_for_bit(results, name, lay):
    e = results[(name, lay)]["export"]
    assert e is not None and e["n"] > 0
    assert e["missing"] == [] and e["extra"] == [] and e["differ"] == [], e


@pytest.mark.parametrize("lay", list(LAYOUTS))
def test_native_routing_agreement(results, lay):
    qwen, glm = results[("tiny-qwen3-moe", lay)], results[("tiny-glm4-moe", lay)]
    # fp32 on both sides: softmax routing agrees but for near-ties (~1e-6 apart); measured 1.0 on these tokens
    assert qwen["agree"] >= 0.99, qwen
    if qwen["agree"] == 1.0:  # same routes natively: the native log-probs agree as the replayed ones do
        assert qwen["native"] < TOL, qwen
    # GLM: Megatron's group scoring differs (see the tests below), so many routers differ by construction
    assert 0.5 < glm["agree"] < 0.95, glm


# ---- the group-limited routing claim, against both implementations' own code ----------------------
def _glm_router_and_logits(n: int = 4096):
    from transformers import AutoConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    cfg = AutoConfig.from_pretrained(str(model_dir("tiny-glm4-moe")))
    block = Glm4MoeMoE(cfg)
    router = block.gate
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.1)
    x = torch.randn(n, cfg.hidden_size, generator=g) / cfg.hidden_size**0.5
    return cfg, block, x


def _hf_select(block, x):
    """transformers' own GLM-4-MoE selection: (logits, ids) from the router (5.25) or from its MoE block (5.12)."""
    out = block.gate(x)
    if isinstance(out, tuple):  # the router selects
        return out[0], out[2]
    ids, _ = block.route_tokens_to_experts(out)  # the router returns logits, the block selects
    return out, ids


def _megatron_topk(cfg, router, logits, num_groups, group_topk):
    tm.patch_megatron_for_cpu()
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    _, routing_map = topk_routing_with_score_function(
        logits,
        cfg.num_experts_per_tok,
        use_pre_softmax=True,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=cfg.routed_scaling_factor,
        score_function="sigmoid",
        expert_bias=router.e_score_correction_bias,
    )
    return routing_map


def test_megatron_group_routing_differs_from_transformers_by_construction():
    cfg, block, x = _glm_router_and_logits()
    router = block.gate
    with torch.no_grad():
        logits, hf_idx = _hf_select(block, x)
        hf_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, hf_idx, True)
        mg_map = _megatron_topk(cfg, router, logits, cfg.n_group, cfg.topk_group)
        mg_plain = _megatron_topk(cfg, router, logits, None, None)
        # transformers' own router with its group score changed to Megatron's (best top_k // topk_group)
        s = logits.sigmoid() + router.e_score_correction_bias
        k = cfg.num_experts_per_tok // cfg.topk_group
        gs = s.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group).topk(k, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(cfg.topk_group, dim=-1)[1], 1).bool()
        keep = keep[:, :, None].expand(-1, -1, cfg.n_routed_experts // cfg.n_group).reshape(len(s), -1)
        emu = torch.zeros_like(keep).scatter_(
            1, s.masked_fill(~keep, float("-inf")).topk(cfg.num_experts_per_tok)[1], True
        )
    differ = (hf_map != mg_map).any(1).float().mean().item()
    assert differ > 0.05, differ  # a real share of tokens routes differently
    assert torch.equal(mg_map, emu)  # and the cause is exactly the group score: with Megatron's score they agree
    assert torch.equal(mg_map, mg_plain)  # top_k == topk_group: Megatron's groups never restrict anything
    assert group_routing_mismatch(cfg.to_dict()) is not None


def test_group_routing_mismatch_is_named_and_only_when_it_applies():
    glm = {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}
    why = group_routing_mismatch(glm)
    assert "top_k // topk_group = 1" in why and "sum of the best 2" in why
    assert group_routing_mismatch({**glm, "num_experts_per_tok": 4}) is None  # 4 // 2 == 2: DeepSeek-V3's case
    assert group_routing_mismatch({**glm, "n_group": 1}) is None
    assert group_routing_mismatch({"num_experts_per_tok": 2}) is None  # no groups (Qwen3-MoE)
    assert group_routing_mismatch({**glm, "topk_group": 4}) is None  # every group kept


def test_build_model_refuses_cp_and_warns_or_raises_on_group_routing():
    layout = tm.layout_for(model_dir("tiny-glm4-moe"), cp=2)
    with pytest.raises(MegatronLoadError, match="TEDotProductAttention"):
        tm.build_model(model_dir("tiny-glm4-moe"), layout)
    with pytest.raises(MegatronLoadError, match="top_k // topk_group"):
        tm.build_model(model_dir("tiny-glm4-moe"), tm.layout_for(model_dir("tiny-glm4-moe")), group_routing="raise")
    with pytest.raises(MegatronLoadError, match="layers"):
        tm.build_model(model_dir("tiny-glm4-moe"), ParallelLayout(num_layers=8))


# ---- the launcher's bounded, all-or-none wait ----------------------------------------------------
def _sleep_on_rank_1(rank: int, world: int) -> int:
    import time

    if rank == 1:
        time.sleep(120)
    return rank


def _fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def _world_sum(rank: int, world: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)  # the gloo world formed: every rank's number arrives
    return int(t.item())


def test_launch_never_loses_its_rendezvous_port_to_another_process():
    with grabbing_ports() as grabbed:
        for _ in range(4):
            assert tm.launch(_world_sum, 2, timeout_s=120) == [3, 3]
    assert grabbed.value > 100  # the other process was grabbing all along


def _rank_environment(rank: int, world: int, name: str) -> tuple[str | None, str | None, int]:
    import os
    import sys

    return os.environ.get(name), os.environ.get("RANK"), int("megatron.core" in sys.modules)


def test_ranks_are_forked_from_the_preloaded_server_yet_see_the_environment_of_their_start(monkeypatch):
    """The ranks start from the fork server (megatron-core already imported there: no rank imports it afresh), and
    each sees the environment of the launch that started it, not the server's: a variable set after the server
    started reaches the ranks, and one removed since is gone."""
    from r3lab.trainers.megatron.launch import RANK_PRELOAD

    assert "megatron.core" in RANK_PRELOAD
    monkeypatch.setenv("R3LAB_RANK_ENV_PROBE", "before")
    assert tm.launch(_world_sum, 2) == [3, 3]  # the fork server is up now, with "before" in its environment
    monkeypatch.setenv("R3LAB_RANK_ENV_PROBE", "set after the server started")
    got = tm.launch(_rank_environment, 2, "R3LAB_RANK_ENV_PROBE")
    assert got == [("set after the server started", "0", 1), ("set after the server started", "1", 1)]
    monkeypatch.delenv("R3LAB_RANK_ENV_PROBE")
    assert [g[0] for g in tm.launch(_rank_environment, 2, "R3LAB_RANK_ENV_PROBE")] == [None, None]


def _one_process_worlds(out) -> None:
    """Three one-rank worlds in turn, as a scorer's process makes them: each must form and sum, and none may have
    chosen a port (``MASTER_PORT`` is what a port-choosing setup would leave behind)."""
    import os

    import torch.distributed as dist

    from r3lab.trainers.megatron.cpu import destroy_parallel, init_parallel

    os.environ.pop("MASTER_ADDR", None)
    os.environ.pop("MASTER_PORT", None)
    sums = []
    for _ in range(3):
        init_parallel()
        t = torch.tensor([2])
        dist.all_reduce(t)
        sums.append(int(t.item()))
        destroy_parallel(keep_process_group=False)
    out.put((sums, os.environ.get("MASTER_PORT")))


def test_a_one_process_world_takes_no_port_another_process_could_take():
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with grabbing_ports() as grabbed:
        child = ctx.Process(target=_one_process_worlds, args=(out,))
        child.start()
        try:
            sums, master_port = out.get(timeout=120)
        finally:
            child.join(30)
    assert child.exitcode == 0
    assert sums == [2, 2, 2] and master_port is None  # formed three times, with no rendezvous port at all
    assert grabbed.value > 100


def test_launch_is_bounded_and_all_or_none():
    import time

    import torch.multiprocessing as mp

    assert tm.launch(_sleep_on_rank_1, 1) == [0]
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose"):
        tm.launch(_fail_on_rank_1, 2)
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout):
        tm.launch(_sleep_on_rank_1, 2, timeout_s=20)
    assert time.monotonic() - t0 < 60  # the sleeping rank was terminated, not waited for


def _layouts_in_turn(rank: int, world: int) -> dict:
    """Four layouts built in turn on one world (init_parallel, destroy_parallel): this rank's thread count after each,
    and how many of the groups Megatron held are still registered with torch after each teardown."""
    import os

    import torch.distributed as dist

    from r3lab.trainers.megatron.cpu import _megatron_process_groups, destroy_parallel, init_parallel

    threads, left = [], []
    for tp, ep in ((2, 1), (1, 2), (2, 1), (1, 2)):
        init_parallel(tp=tp, ep=ep)
        groups = _megatron_process_groups()
        assert groups, "Megatron holds no process group: nothing to check"
        destroy_parallel()
        left.append(sum(dist.distributed_c10d._world.pg_map.get(g) is not None for g in groups))
        threads.append(len(os.listdir("/proc/self/task")))
    return {"threads": threads, "left": left, "world_alive": dist.is_initialized()}


def test_torchs_group_registry_is_read_where_it_is_and_refused_where_it_is_gone(monkeypatch):
    """destroy_parallel reads torch's private registry of live groups (cpu.live_process_groups): this torch has it
    (the compatibility tier's far end runs this test on torch 2.11), and a torch without it is refused by name before
    any group is destroyed."""
    import torch.distributed as dist

    from r3lab.errors import MegatronCoreAPIError
    from r3lab.trainers.megatron import cpu

    assert isinstance(cpu.live_process_groups(), dict)
    assert torch.__version__.split("+")[0] in cpu.TORCH_GROUP_REGISTRY_CHECKED, torch.__version__

    class Renamed:
        _pg_registry: dict = {}

    monkeypatch.setattr(dist.distributed_c10d, "_world", Renamed())
    with pytest.raises(MegatronCoreAPIError, match=r"_world\.pg_map .* read in torch 2\.11\.0 and 2\.13\.0"):
        cpu.live_process_groups()


def test_layouts_built_in_turn_leave_no_process_group_and_no_thread_behind():
    """Megatron's destroy_model_parallel only forgets its groups; on CPU each is a gloo group with a socket loop
    thread and two workers. destroy_parallel destroys them (the world stays): four layouts in turn leave none of the
    groups registered and the thread count where the first left it (before: all 20 groups left registered after each
    teardown, and 60 more threads a layout)."""
    for r in tm.launch(_layouts_in_turn, 2, timeout_s=300):
        assert r["left"] == [0, 0, 0, 0], r
        assert r["threads"][-1] <= r["threads"][0] + 4, r
        assert r["world_alive"], r
