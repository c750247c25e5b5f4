"""r3lab.staging: every rank gets exactly its share, memory stays near it, and failures stop every rank.

Oracles: the plan is checked against the DP split written out by hand; every rank's share against
``Routes.take`` of the plan's sequences of the whole batch, and what it slices against
:func:`r3lab.slicing.shard` run on the whole mini-batch (another path through the code: no staging,
no codec). The same assertions run on the local backend (threads) and on a local Ray cluster
(loopback, 2 CPUs, 4 worker actors). Failure tests bound their own run time.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest
from conftest import random_routes

from r3lab.errors import StagingError
from r3lab.routes import Routes
from r3lab.slicing import ParallelLayout, shard, shard_local
from r3lab.staging import (
    CHUNK_VERSION,
    Backend,
    ChunkSpec,
    LocalBackend,
    RankCoords,
    RayBackend,
    StagingPlan,
    TorchDistBackend,
    barrier,
    decode_chunk,
    encode_chunk,
    fetch,
    receive,
    stage,
)
from r3lab.testing.staging import RankWorker

EXPERTS, TOPK, LAYERS = 16, 2, 5  # layers 1..5 route, layer 0 is dense
#: scheduling slack a bounded wait gets on a busy 2-core machine (ranks are threads or Ray actors sharing it);
#: the cases it guards are a wait for a chunk that arrives after LATE_S, or forever, so it has teeth
SLACK_S = 10.0
LATE_S = 60.0
LAYOUTS = {
    "dp4": dict(dp=4, micro_batch_size=2),
    "dp2 pp2 (split stages)": dict(dp=2, pp=2, micro_batch_size=3),
    "dp2 cp2-zigzag tp2-sp": dict(dp=2, cp=2, tp=2, sequence_parallel=True, micro_batch_size=2),
    "dp2 pp2 cp2 strided": dict(dp=2, pp=2, cp=2, micro_batch_size=2, dp_split="strided"),
}


def _layout(name: str) -> ParallelLayout:
    return ParallelLayout(num_layers=LAYERS + 1, moe_layer_ids=tuple(range(1, LAYERS + 1)), **LAYOUTS[name])


def _routes(seed: int = 0, n: int = 24) -> Routes:
    rng = np.random.default_rng(seed)
    lens = rng.integers(3, 30, n)
    return random_routes(
        rng, num_experts=EXPERTS, top_k=TOPK, num_layers=LAYERS, lengths=lens, layer_ids=list(range(1, LAYERS + 1))
    )


def _plan(name: str, n: int = 24) -> StagingPlan:
    shuffled = np.random.default_rng(7).permutation(n).tolist()  # RL loops shuffle sequences into mini-batches
    mbs = [shuffled[: n // 2], shuffled[n // 2 :]]
    return StagingPlan.build(n, _layout(name), mini_batches=mbs, split_stages="split" in name)


def _srt(a: np.ndarray) -> np.ndarray:
    return np.sort(a, axis=-1)


def check_share(routes: Routes, plan: StagingPlan, rank: RankCoords, m: int, values, cu, layer_ids, micro) -> None:
    """The rank's share is the plan's sequences of the whole batch; its slices equal shard() on the mini-batch."""
    spec = plan.chunk_for(rank, m)
    want = routes.take(spec.seq_ids)
    if plan.split_stages:
        want = want.select_layers(plan.layout.router_layer_ids(rank.pp))
    assert layer_ids == want.layer_ids.tolist()
    np.testing.assert_array_equal(cu, want.cu_seqlens)
    np.testing.assert_array_equal(_srt(values), _srt(want.values))
    mb = routes.take(plan.mini_batches[m])
    assert len(micro) == -(-len(plan.mini_batches[m]) // plan.layout.dp // plan.layout.micro_batch_size)
    for i, arrays in enumerate(micro):
        oracle = shard(
            mb, plan.layout, dp_rank=rank.dp, pp_rank=rank.pp, cp_rank=rank.cp, tp_rank=rank.tp, micro_batch=i
        )
        assert len(arrays) == len(oracle) > 0
        for a, b in zip(arrays, oracle, strict=True):
            np.testing.assert_array_equal(_srt(a), _srt(b))


def _run_ranks(fn, ranks) -> dict:
    """Run fn(rank) on one thread per rank (as trainer ranks would), collect results or exceptions."""
    out: dict = {}

    def go(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # collected and asserted on below
            out[r] = e

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(not t.is_alive() for t in threads), "a rank hung"
    return out


# ---- the plan -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_plan_puts_every_sequence_in_exactly_one_chunk_per_stage(name):
    plan = _plan(name)
    L = plan.layout
    for m, ids in enumerate(plan.mini_batches):
        for p in range(L.pp) if plan.split_stages else [None]:
            got = [s for d in range(L.dp) for s in plan.chunk(d, m, p).seq_ids]
            assert sorted(got) == sorted(ids) and len(got) == len(ids)  # nothing lost, nothing duplicated
        n, mbs = len(ids), L.micro_batch_size
        for d in range(L.dp):  # the DP split written out by hand
            if L.dp_split == "contiguous":
                want = list(ids[d * n // L.dp : (d + 1) * n // L.dp])
            else:
                want = [ids[(k * L.dp + d) * mbs + j] for k in range(n // (L.dp * mbs)) for j in range(mbs)]
            assert list(plan.chunk(d, m, 0).seq_ids) == want
    assert len(plan.ranks()) == L.world_size == len(set(plan.ranks()))


def test_plan_refuses_what_cannot_be_staged():
    layout = _layout("dp4")
    with pytest.raises(StagingError, match="repeats a sequence"):
        StagingPlan.build(8, layout, mini_batches=[[0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0]])
    with pytest.raises(StagingError, match="outside"):
        StagingPlan.build(8, layout, mini_batches=[[0, 1, 2, 3, 4, 5, 6, 9]])
    with pytest.raises(StagingError, match="does not fit the layout"):
        StagingPlan.build(6, layout, mini_batches=1)
    with pytest.raises(StagingError, match="do not split into 3"):
        StagingPlan.build(8, layout, mini_batches=3)


# ---- chunk bytes ----------------------------------------------------------------------------------
def test_chunk_bytes_carry_their_identity_and_refuse_damage():
    routes = _routes()
    spec = ChunkSpec(1, 0, None, (3, 5, 7))
    share = routes.take(spec.seq_ids)
    buf = encode_chunk(share, spec, "s1", "bitpack")
    assert buf[:4] == b"R3SC" and buf[4] == CHUNK_VERSION
    assert decode_chunk(buf, spec, "s1") == share
    cases = {
        "bad magic": b"XXXX" + buf[4:],
        "unsupported chunk format version 9": buf[:4] + bytes([9]) + buf[5:],
        "truncated": buf[:10],
        "checksum mismatch in the chunk header": buf[:20] + bytes([buf[20] ^ 1]) + buf[21:],
        "checksum mismatch: the encoded routes": buf[:-10] + bytes([buf[-10] ^ 1]) + buf[-9:],
    }
    for what, bad in cases.items():
        with pytest.raises(StagingError, match=what) as e:
            decode_chunk(bad, spec, "s1")
        assert "chunk dp1/mb0" in str(e.value)
    with pytest.raises(StagingError, match="expected .*'s1', 2, 0"):  # another rank's chunk
        decode_chunk(buf, ChunkSpec(2, 0, None, spec.seq_ids), "s1")
    with pytest.raises(StagingError, match="other sequences"):
        decode_chunk(buf, ChunkSpec(1, 0, None, (3, 5, 8)), "s1")
    with pytest.raises(StagingError, match="expected .*'s2'"):  # a stale chunk of an earlier step
        decode_chunk(buf, spec, "s2")


# ---- local backend --------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["raw", "topk-set"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_local_backend_gives_every_rank_exactly_its_share(name, codec):
    routes, plan = _routes(), _plan(name)
    staged, stats = stage(routes, plan, LocalBackend(), codec=codec)
    assert stats.chunks == len(plan.chunks()) and stats.bytes_put > 0
    for m in range(len(plan.mini_batches)):
        got = _run_ranks(lambda r, m=m: receive(staged, r, m, timeout=10), plan.ranks())
        for r, res in got.items():
            assert not isinstance(res, Exception), res
            share, st = res
            assert st.chunk == plan.chunk_for(r, m).name and st.bytes_read > 0
            L = plan.layout
            micro = [
                shard_local_(share, L, r, i) for i in range(-(-len(plan.mini_batches[m]) // L.dp // L.micro_batch_size))
            ]
            check_share(routes, plan, r, m, share.values, share.cu_seqlens, share.layer_ids.tolist(), micro)


def shard_local_(share, layout, r, i):
    return shard_local(share, layout, pp_rank=r.pp, cp_rank=r.cp, tp_rank=r.tp, micro_batch=i)


def _expect_all_fail(got: dict, *needles: str) -> None:
    for r, res in got.items():
        assert isinstance(res, StagingError), f"{r} did not fail: {res!r}"
        for n in needles:
            assert n in str(res), f"{r}: {n!r} not in {res}"


def test_local_missing_late_corrupt_or_swapped_chunk_stops_every_rank_fast():
    routes, plan = _routes(), _plan("dp2 pp2 cp2 strided")
    culprit = RankCoords(1, 0, 0, 0)
    name = plan.chunk_for(culprit, 0).name
    t0 = time.monotonic()

    backend = LocalBackend()  # missing: never staged
    staged, _ = stage(routes, plan, backend)
    staged = dataclasses.replace(staged, refs={k: v for k, v in staged.refs.items() if k != name})
    _expect_all_fail(_run_ranks(lambda r: receive(staged, r, 0, timeout=5), plan.ranks()), name, "no such chunk")

    backend = LocalBackend()  # late: its bytes are put long after every deadline
    staged, _ = stage(routes, plan, backend)
    held = bytes(backend.get(staged.refs[name], timeout=1))
    late = dataclasses.replace(staged, refs={**staged.refs, name: "late"})
    timer = threading.Timer(LATE_S, backend.put, args=("late", held))
    timer.start()
    t1 = time.monotonic()
    got = _run_ranks(lambda r: receive(late, r, 0, timeout=1.5, grace=1.0), plan.ranks())
    assert time.monotonic() - t1 < 1.5 + 1.0 + SLACK_S  # within timeout + grace: no rank waited for the late bytes
    _expect_all_fail(got, name, "not put within 1.5 s", "rank (dp=1,")
    timer.cancel()

    for flip in (30, -12):  # corrupt: a byte of the chunk header, a byte of the routes payload
        backend = LocalBackend()
        staged, _ = stage(routes, plan, backend)
        b = bytearray(backend.get(staged.refs[name], timeout=1))
        b[flip] ^= 0x10
        bad = dataclasses.replace(staged, refs={**staged.refs, name: backend.put("corrupt", bytes(b))})
        _expect_all_fail(_run_ranks(lambda r, s=bad: receive(s, r, 0, timeout=5), plan.ranks()), name, "checksum")

    backend = LocalBackend()  # swapped: DP rank 1 would train on DP rank 0's sequences
    staged, _ = stage(routes, plan, backend)
    other = plan.chunk_for(RankCoords(0, 0, 0, 0), 0).name
    staged = dataclasses.replace(staged, refs={**staged.refs, name: staged.refs[other]})
    _expect_all_fail(_run_ranks(lambda r: receive(staged, r, 0, timeout=5), plan.ranks()), name, "expected")
    assert time.monotonic() - t0 < LATE_S  # five cases, each bounded by its own deadline


def test_a_rank_that_never_reports_stops_the_others_by_the_deadline():
    routes, plan = _routes(), _plan("dp4")
    staged, _ = stage(routes, plan, LocalBackend())
    absent = RankCoords(3)
    t0 = time.monotonic()
    got = _run_ranks(lambda r: receive(staged, r, 1, timeout=1.0, grace=0.5), plan.ranks()[:3])
    assert time.monotonic() - t0 < 1.0 + 0.5 + SLACK_S  # by the deadline; a wait for the absent rank would hang
    _expect_all_fail(got, str(absent), f"chunk {plan.chunk_for(absent, 1).name}", "did not report before the deadline")
    assert len({str(e) for e in got.values()}) == 1  # every rank raises the same error


def test_one_thread_can_fetch_for_every_rank_then_pass_the_barrier():
    """The notebook pattern on CPU: fetch for each rank in turn, then the barrier passes at once."""
    routes, plan = _routes(), _plan("dp4")
    staged, _ = stage(routes, plan, LocalBackend(), codec="raw")
    shares = {r: fetch(staged, r, 0, timeout=5)[0] for r in plan.ranks()}
    assert all(barrier(staged, r, 0, timeout=1) < 1 for r in plan.ranks())
    assert Routes.concat([shares[r] for r in plan.ranks()]) == routes.take(
        [s for r in plan.ranks() for s in plan.chunk_for(r, 0).seq_ids]
    )
    with pytest.raises(StagingError, match="not a rank of the layout"):
        fetch(staged, RankCoords(4), 0, timeout=1)


def test_every_backend_implements_the_protocol():
    assert all(isinstance(b, Backend) for b in (LocalBackend(), RayBackend(), TorchDistBackend(object())))


def _big_routes(n: int, length: int, layers: int, experts: int = 64, top_k: int = 4, seed: int = 0) -> Routes:
    """n sequences of ``length`` tokens, rows drawn from 512 distinct top-k sets (fast to build at MiB sizes)."""
    rng = np.random.default_rng(seed)
    base = np.stack([rng.permutation(experts)[:top_k] for _ in range(512)]).astype(np.uint8)
    vals = base[rng.integers(0, 512, (n * length, layers))]
    return Routes(vals, np.arange(n + 1) * length, experts, validate=False)


def _whole_plan(routes: Routes) -> StagingPlan:
    """The whole batch as one chunk: what every rank reads when the driver puts the whole batch."""
    return StagingPlan.build(len(routes), ParallelLayout(num_layers=8), mini_batches=1)


def test_local_peak_memory_stays_near_the_share():
    routes = _big_routes(16, 16_384, 8)  # 8 MiB batch, 2 MiB per DP rank
    plan = StagingPlan.build(len(routes), ParallelLayout(num_layers=8, dp=4), mini_batches=1)
    staged, _ = stage(routes, plan, LocalBackend(), codec="bitpack")
    worker = RankWorker()
    worker.warm_up("bitpack")
    shares = [fetch(staged, r, 0, timeout=5) for r in plan.ranks()[1:]]  # the other ranks, so the barrier passes
    res = worker.receive(staged, RankCoords(0), 0, timeout=5, measure=True, return_arrays=False)
    bound = 2 * res["share_bytes"] + (1 << 20)
    assert res["ok"] and 0 < res["peak_heap"] < bound, res
    # the same meter sees a whole-batch receive: the bound has teeth
    whole, _ = stage(routes, _whole_plan(routes), LocalBackend(), codec="bitpack")
    w = worker.receive_whole(whole, plan.layout, RankCoords(0))
    assert w["peak_heap"] > bound and w["peak_heap"] > routes.values.nbytes, w
    del shares


# ---- Ray (local cluster on loopback) --------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_workers():
    try:
        import ray
    except ImportError as e:  # a failure, never a skip: the test command installs the `ray` extra
        raise AssertionError("Ray is not installed: install r3lab[ray] (bash scripts/test.sh does)") from e
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for attempt in (1, 2):  # Ray gives its raylet a fixed 30 s to start; a loaded 2-core CI box can miss it once
        try:
            ray.init(
                address="local",  # a new instance of its own: never the cluster a test beside it (test_cluster) runs
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=256 << 20,
                configure_logging=False,
            )
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    try:
        actor = ray.remote(RankWorker).options(num_cpus=0, max_concurrency=2)
        workers = [actor.remote() for _ in range(4)]
        assert len(set(ray.get([w.pid.remote() for w in workers], timeout=120))) == 4
        yield ray, workers
    finally:
        ray.shutdown()


def _on_workers(ray, workers, staged, ranks, m, timeout, **kw) -> dict:
    """Each rank on a worker actor (round-robin: up to 2 ranks per actor, as threads)."""
    refs = {
        r: workers[i % len(workers)].receive.remote(staged, r, m, timeout=timeout, **kw) for i, r in enumerate(ranks)
    }
    return dict(zip(refs, ray.get(list(refs.values()), timeout=timeout + 60), strict=True))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_ray_workers_receive_exactly_their_share(ray_workers, name):
    ray, workers = ray_workers
    routes, plan = _routes(seed=3), _plan(name)
    staged, stats = stage(routes, plan, RayBackend(), codec="raw")
    for m in range(len(plan.mini_batches)):
        got = _on_workers(ray, workers, staged, plan.ranks(), m, 30)
        for r, res in got.items():
            assert res["ok"], res
            check_share(routes, plan, r, m, *res["share"], res["micro_batches"])
            assert res["stats"]["chunk"] == plan.chunk_for(r, m).name
        read = {res["stats"]["chunk"]: res["stats"]["bytes_read"] for res in got.values()}
        assert sum(read.values()) == sum(  # each chunk read is one the driver put, no more
            len(np.asarray(ray.get(staged.refs[c]))) for c in read
        )


def test_ray_peak_memory_per_worker_stays_near_its_share(ray_workers):
    ray, workers = ray_workers
    routes = _big_routes(16, 16_384, 8)  # 8 MiB batch, 2 MiB per DP rank
    plan = StagingPlan.build(len(routes), ParallelLayout(num_layers=8, dp=4), mini_batches=1)
    staged, _ = stage(routes, plan, RayBackend(), codec="bitpack")
    ray.get([w.warm_up.remote("bitpack") for w in workers], timeout=120)  # numba compiles outside the measurement
    got = _on_workers(ray, workers, staged, plan.ranks(), 0, 30, measure=True, return_arrays=False)
    for r, res in got.items():
        assert res["ok"], res
        assert res["share_bytes"] * 4 >= routes.values.nbytes
        assert 0 < res["peak_heap"] < 2 * res["share_bytes"] + (1 << 20), (r, res)
        if res["rss_growth"] >= 0:  # resident growth includes the object-store pages of the chunk it read
            assert res["rss_growth"] < 3 * res["share_bytes"] + (16 << 20), (r, res)
    whole, _ = stage(routes, _whole_plan(routes), RayBackend(), codec="bitpack")  # the anti-pattern, measured alike
    w = ray.get(workers[0].receive_whole.remote(whole, plan.layout, RankCoords(0)), timeout=60)
    assert w["peak_heap"] > routes.values.nbytes > 2 * res["share_bytes"] + (1 << 20), w


def test_ray_late_lost_or_corrupt_chunk_stops_every_worker_fast(ray_workers):
    from r3lab.staging import RayBackend
    from r3lab.testing.staging import late_bytes, lost_bytes

    ray, workers = ray_workers
    routes, plan = _routes(seed=4), _plan("dp2 pp2 (split stages)")
    culprit = RankCoords(1, 1)
    name = plan.chunk_for(culprit, 0).name
    t0 = time.monotonic()

    staged, _ = stage(routes, plan, RayBackend())  # late: its producer is still busy at the deadline
    data = np.asarray(ray.get(staged.refs[name])).tobytes()
    slow = ray.remote(late_bytes).options(num_cpus=0).remote(data, 60.0)
    late = dataclasses.replace(staged, refs={**staged.refs, name: slow})
    t1 = time.monotonic()
    grace = 4.0  # for the late rank's report to reach the others: a Ray round trip on a loaded 2-core machine
    got = _on_workers(ray, workers, late, plan.ranks(), 0, 2.0, grace=grace)
    assert time.monotonic() - t1 < 2.0 + grace + 2 * SLACK_S  # deadline + grace + Ray round trips, never the 60 s
    ray.cancel(slow, force=True)
    for res in got.values():
        assert not res["ok"] and res["error"] == "StagingError" and res["elapsed"] < 2.0 + grace + SLACK_S, res
        assert name in res["message"] and str(culprit) in res["message"] and "TimeoutError" in res["message"]

    staged, _ = stage(routes, plan, RayBackend())  # lost: the producer died
    dead = ray.remote(lost_bytes).options(num_cpus=0, max_retries=0).remote()
    lost = dataclasses.replace(staged, refs={**staged.refs, name: dead})
    for res in _on_workers(ray, workers, lost, plan.ranks(), 0, 20, grace=grace).values():
        assert not res["ok"] and name in res["message"] and "producer lost" in res["message"], res
        assert res["elapsed"] < 20, res  # at once: a lost producer is no reason to wait out the 20 s deadline

    staged, _ = stage(routes, plan, RayBackend())  # corrupt: one flipped bit in the routes payload
    b = bytearray(np.asarray(ray.get(staged.refs[name])).tobytes())
    b[-9] ^= 0x04
    bad = dataclasses.replace(staged, refs={**staged.refs, name: RayBackend().put("bad", bytes(b))})
    for res in _on_workers(ray, workers, bad, plan.ranks(), 0, 10, grace=grace).values():
        assert not res["ok"] and name in res["message"] and "checksum mismatch" in res["message"], res
    assert time.monotonic() - t0 < 60  # three cases, each bounded, none waited for the late producer's 60 s


def test_ray_coordinator_outlives_released_batches(ray_workers):
    """Step after step, one coordinator: a released, dropped staged batch must not take it along (Ray ends an
    actor once no handle to it is left; a next step would then race a dying actor or pay for a new one).
    The backend owns it, as a trainer keeps one backend for its run."""
    import gc

    ray, workers = ray_workers
    routes, plan = _routes(seed=5), _plan("dp4")
    backend = RayBackend()
    for _ in range(3):
        staged, _ = stage(routes, plan, backend)
        assert staged.coordinator == backend.coordinator  # every step reports to the backend's one coordinator
        got = _on_workers(ray, workers, staged, plan.ranks(), 1, 30, return_arrays=False)
        assert all(res["ok"] for res in got.values()), got
        released = staged.stage_id
        staged.release()
        del staged, got
        gc.collect()
        time.sleep(1.0)  # time for Ray to end an actor no handle points to
        state, detail = ray.get(backend.coordinator.wait.remote(released, 1, 0.0), timeout=30)  # still alive
        assert state == "failed" and "released" in detail


def test_ray_report_is_bounded_by_the_ranks_grace(ray_workers):
    """A coordinator too busy to take a report (every thread held by waiters) makes the rank raise after
    ``grace`` s, not after the backend's 30 s RPC allowance."""
    ray, workers = ray_workers
    routes, plan = _routes(seed=6), _plan("dp4")
    backend = RayBackend(coordinator_name="r3lab-staging-busy", max_concurrency=8)
    staged, _ = stage(routes, plan, backend)
    # all 8 threads wait for as long as the rank below may take (it starts a second after them): the coordinator
    # stays busy for the whole time the rank is allowed
    hold_s = 1.0 + 5.0 + SLACK_S
    hold = [staged.coordinator.wait.remote(staged.stage_id, 0, hold_s) for _ in range(8)]
    time.sleep(1.0)
    t0 = time.monotonic()
    res = ray.get(workers[0].receive.remote(staged, RankCoords(0), 0, timeout=5.0, return_arrays=False), timeout=60)
    assert time.monotonic() - t0 < 5.0 + SLACK_S < backend.rpc_timeout
    assert not res["ok"] and "coordinator is unreachable" in res["message"] and "within 1.0 s" in res["message"], res
    ray.get(hold, timeout=60)
