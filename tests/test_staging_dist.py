"""r3lab.staging on torch.distributed: a driver and four trainer ranks as real gloo processes on loopback.

The same oracles as the local and Ray tests (tests/test_staging.py): every rank's share equals
``Routes.take`` of the plan's sequences of the whole batch, and its slices equal ``shard()`` of the whole
mini-batch; a missing, late, corrupt or swapped chunk, or a rank that never reports, makes every rank raise
the same StagingError naming the rank and chunk, within its deadline. Processes are started with
``torch.multiprocessing.spawn``; each writes what it saw to a file the test reads (asserts run here).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time

import numpy as np
import pytest
import torch.multiprocessing as mp
from test_staging import SLACK_S, _layout, _plan, _routes, check_share

from r3lab.errors import StagingError
from r3lab.slicing import shard_local
from r3lab.staging import RankCoords, TorchDistBackend, receive, stage

WORLD = 5  # the driver (global rank 0) and four trainer ranks
DIST_LAYOUTS = ["dp4", "dp2 pp2 (split stages)"]
FAULTS = ["corrupt", "swapped", "missing", "never reports", "late"]
TIMEOUT, GRACE = 3.0, 3.0  # grace: for the failing rank's report to reach the store on a loaded machine
CULPRIT = RankCoords(1)  # in the dp4 layout: global rank 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FaultyDriver(TorchDistBackend):
    """The driver's backend with one fault on the culprit's chunk (test double: every other path is the real one)."""

    def __init__(self, store, fault: str, chunk: str):
        super().__init__(store)
        self.fault, self.chunk, self.previous, self.held = fault, chunk, b"", None

    def put(self, key: str, data: bytes) -> str:
        name = key.split("/", 1)[1]
        if name == self.chunk and self.fault == "corrupt":
            b = bytearray(data)
            b[-12] ^= 0x08  # a bit of the routes payload
            data = bytes(b)
        elif name == self.chunk and self.fault == "swapped":
            data = self.previous  # DP rank 0's chunk of the same mini-batch, put just before
        self.previous = data
        return super().put(key, data)

    def publish(self, stage_id, plan, refs, layer_ids):
        if self.fault == "missing":
            refs = {k: v for k, v in refs.items() if k != self.chunk}
        return super().publish(stage_id, plan, refs, layer_ids)

    def send(self, stage_id, plan, refs):
        if self.fault in ("missing", "late"):
            self.held = (stage_id, plan, {self.chunk: refs[self.chunk]})
            refs = {k: v for k, v in refs.items() if k != self.chunk}
        super().send(stage_id, plan, refs)


def _driver(backend_store, out: dict) -> None:
    for name in DIST_LAYOUTS:
        routes, plan = _routes(seed=11), _plan(name)
        staged, stats = stage(routes, plan, TorchDistBackend(backend_store), stage_id=f"layout {name}")
        out[name] = {
            m: staged.backend.wait(staged.coordinator, staged.stage_id, m, 60.0) for m in range(len(plan.mini_batches))
        }
        out[name + " bytes"] = stats.bytes_put
        staged.release()
    for fault in FAULTS:
        routes, plan = _routes(seed=12), _plan("dp4")
        backend = FaultyDriver(backend_store, fault, plan.chunk_for(CULPRIT, 0).name)
        staged, _ = stage(routes, plan, backend, stage_id=f"fault {fault}")
        out[fault] = backend.wait(staged.coordinator, staged.stage_id, 0, TIMEOUT + GRACE + SLACK_S)
        if backend.held is not None and fault == "late":  # after every deadline: it must change nothing
            TorchDistBackend.send(backend, *backend.held)
            time.sleep(0.5)


def _trainer(index: int, backend: TorchDistBackend, out: dict) -> None:
    for name in DIST_LAYOUTS:
        layout = _layout(name)
        staged = backend.attach(f"layout {name}", timeout=120, layout=layout)
        rank = staged.plan.ranks()[index - 1]
        for m in range(len(staged.plan.mini_batches)):
            share, st = receive(staged, rank, m, timeout=60)
            n_mb = -(-len(staged.plan.mini_batches[m]) // layout.dp // layout.micro_batch_size)
            micro = [
                shard_local(share, layout, pp_rank=rank.pp, cp_rank=rank.cp, tp_rank=rank.tp, micro_batch=i)
                for i in range(n_mb)
            ]
            out[(name, m)] = (rank, np.array(share.values), share.cu_seqlens, share.layer_ids.tolist(), micro, st)
    for fault in FAULTS:
        staged = backend.attach(f"fault {fault}", timeout=120, layout=_layout("dp4"))
        rank = staged.plan.ranks()[index - 1]
        if fault == "never reports" and rank == RankCoords(3):
            out[fault] = None
            continue
        t0 = time.monotonic()
        try:
            receive(staged, rank, 0, timeout=TIMEOUT, grace=GRACE)
            out[fault] = ("ok", time.monotonic() - t0)
        except StagingError as e:
            out[fault] = (str(e), time.monotonic() - t0)


def _process(index: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, WORLD, index == 0, timeout=datetime.timedelta(seconds=180))
    dist.init_process_group("gloo", store=store, rank=index, world_size=WORLD, timeout=datetime.timedelta(seconds=180))
    out: dict = {}
    try:
        if index == 0:
            _driver(store, out)
        else:
            _trainer(index, TorchDistBackend(store), out)
    finally:
        with open(os.path.join(out_dir, f"{index}.pkl"), "wb") as f:
            pickle.dump(out, f)
    store.set(f"done/{index}", "1")  # the driver's process serves the store: it leaves last
    if index == 0:
        store.wait([f"done/{i}" for i in range(WORLD)], datetime.timedelta(seconds=120))
    os._exit(0)  # pending sends to ranks that gave up must not hold the process (the group is not reused)


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("gloo")
    t0 = time.monotonic()
    mp.spawn(_process, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=True)
    results = {}
    for i in range(WORLD):
        with open(out_dir / f"{i}.pkl", "rb") as f:
            results[i] = pickle.load(f)
    return results, time.monotonic() - t0


@pytest.mark.parametrize("name", DIST_LAYOUTS)
def test_gloo_ranks_receive_exactly_their_share(gloo_run, name):
    results, _ = gloo_run
    routes, plan = _routes(seed=11), _plan(name)
    driver = results[0]
    assert all(state == ("ok", "") for state in driver[name].values()), driver[name]
    read = 0
    for i in range(1, WORLD):
        for m in range(len(plan.mini_batches)):
            rank, values, cu, layer_ids, micro, st = results[i][(name, m)]
            assert rank == plan.ranks()[i - 1] and st.chunk == plan.chunk_for(rank, m).name
            check_share(routes, plan, rank, m, values, cu, layer_ids, micro)
            read += st.bytes_read
    # each rank read only its chunk: in all, every chunk once per rank that reads it
    readers = {c.name: sum(plan.chunk_for(r, c.mini_batch).name == c.name for r in plan.ranks()) for c in plan.chunks()}
    assert len(set(readers.values())) == 1  # here every chunk has the same number of readers
    assert read == driver[name + " bytes"] * next(iter(readers.values()))


@pytest.mark.parametrize("fault", FAULTS)
def test_gloo_fault_stops_every_rank_with_the_same_error_by_the_deadline(gloo_run, fault):
    results, _ = gloo_run
    plan = _plan("dp4")
    culprit = CULPRIT if fault != "never reports" else RankCoords(3)
    chunk = plan.chunk_for(culprit, 0).name
    got = [results[i][fault] for i in range(1, WORLD) if results[i][fault] is not None]
    assert len(got) == (3 if fault == "never reports" else 4)
    messages = {msg for msg, _ in got}
    assert len(messages) == 1, messages  # the same StagingError on every rank
    msg = messages.pop()
    assert msg != "ok" and str(culprit) in msg and chunk in msg, msg
    want = {
        "corrupt": "checksum mismatch",
        "swapped": "expected",
        "missing": "no such chunk was staged",
        "never reports": "did not report before the deadline",
        "late": f"not received from the driver within {TIMEOUT:.1f} s",
    }[fault]
    assert want in msg, msg
    assert all(elapsed < TIMEOUT + GRACE + SLACK_S for _, elapsed in got), got  # bounded: none waited it out
    state, detail = results[0][fault]  # the driver sees the same outcome
    assert state in ("failed", "pending") and (state == "pending" or detail == msg), (state, detail)


def test_store_tally_answers_as_the_coordinator_does():
    """The torch.distributed tally, on an in-process store: the first failure wins, a rank reports once,
    an unknown rank fails the batch, and a timeout names the ranks not heard from (as Coordinator does)."""
    import torch.distributed as dist

    from r3lab.staging import Coordinator, StoreTally

    ranks = [str(RankCoords(d)) for d in range(3)]
    tally, coord = StoreTally(dist.HashStore(), "t/s1", "s1", ranks), Coordinator()
    coord.open("s1", ranks)
    for r in ranks[:2]:
        tally.report(0, r, None, 1.0)
        coord.report("s1", 0, r, None, timeout=1.0)
    assert tally.wait(0, 0.2) == ("pending", [ranks[2]]) == tuple(coord.wait("s1", 0, 0.2))
    tally.report(0, ranks[2], None, 1.0)
    assert tally.wait(0, 0.2) == ("ok", "")
    tally.report(1, ranks[0], "rank 0 lost chunk dp0/mb1", 1.0)
    tally.report(1, ranks[1], "a later failure", 1.0)
    t0 = time.monotonic()
    assert tally.wait(1, 30.0) == ("failed", "rank 0 lost chunk dp0/mb1")
    assert time.monotonic() - t0 < SLACK_S  # at once, not at the deadline
    tally.report(2, ranks[0], None, 1.0)
    tally.report(2, ranks[0], None, 1.0)
    assert tally.wait(2, 0.2)[1].endswith(f"{ranks[0]} reported twice")
    tally.report(3, "rank (dp=7, pp=0, cp=0, tp=0)", None, 1.0)
    assert "unknown rank (dp=7" in tally.wait(3, 0.2)[1]


def test_a_late_chunk_in_the_drivers_store_is_a_timeout_and_nothing_else_is():
    """The store backend turns exactly the store's own timeout type into TimeoutError (store_timeout_error names it
    for the installed torch: if a release changes it, this fails), and lets any other store error through."""
    import torch.distributed as dist

    from r3lab.trainers.megatron.store_backend import StoreBackend, store_timeout_error

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    with pytest.raises(store_timeout_error()):
        store.wait(["never-set"], datetime.timedelta(seconds=0.2))
    backend = StoreBackend(store)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="chunk late not in the store within 0.3 s"):
        backend.get("late", 0.3)
    assert time.monotonic() - t0 < 5

    class Broken:
        def set_timeout(self, _t):
            pass

        def wait(self, _keys, _t):
            raise OSError("connection reset by peer")

    with pytest.raises(OSError, match="connection reset"):  # not reported as a late chunk
        StoreBackend(Broken()).get("x", 0.3)
