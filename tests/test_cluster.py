"""The engine and the Megatron ranks as Ray actors on a two-node cluster (r3lab.cluster), against the local path.

One two-raylet cluster per module (:func:`r3lab.testing.cluster.local_cluster`: Ray's ``cluster_utils.Cluster``,
each raylet told its agents' ports so that it starts on a loaded 2-core machine): node A holds the custom resource
``engine`` (1 CPU), node B holds ``trainer`` (2 CPUs). Asserted: an engine actor lands on A and both TP ranks on B
(node ids); a quick drift whose TP ranks are actors equals the local drift for the same seed bit for bit (same
kernels, same inputs: gloo ranks in actors are gloo ranks in processes); a 2-step R3W RL run with its own engine actor
and Megatron TP2 equals the local one bit for bit (vLLM in an actor is vLLM in a process); one engine actor starts
in the module (the drift and the killed run sample with the session's engine); killing a rank actor mid-step ends
the run within its bound,
naming the actor and its node, leaving no rank process, and the run folder says stopped with that reason. Raylets,
vLLM and two Megatron ranks: run under the heavy lock (``flock /tmp/r3lab-heavy.lock``)."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from r3lab.config import DriftConfig, RLConfig, RLMetric
from r3lab.errors import ClusterError

ENGINE = '{"engine": 1}'
TRAINER = '{"trainer": 1}'


@pytest.fixture(scope="module")
def cluster():
    from r3lab.testing.cluster import local_cluster

    nodes = [dict(num_cpus=1, resources={"engine": 1}), dict(num_cpus=2, resources={"trainer": 2})]
    with local_cluster(nodes) as (engine_id, trainer_id):
        yield {"engine": engine_id, "trainer": trainer_id}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _all_gone(pids, within: float = 30.0) -> bool:
    """Every process in ``pids`` has exited within ``within`` s (ray.kill returns before the worker process exits)."""
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_quick_drift_through_the_cluster_lands_on_its_nodes_and_equals_the_local_drift(cluster, tmp_path,
                                                                                        monkeypatch, engine_pool):
    """Both TP rank actors of the drift run land on node B; the ranks' processes end with the run; the result equals
    the local drift bit for bit. Both drifts sample with the session's engine (``engines=``, in a fresh start's
    state each time): the engine actor a run starts for itself, and where it lands, is the next test's (R3W needs
    one that captures routing weights). An engine no node can hold is refused before anything waits."""
    from r3lab.cluster import RayEngine
    from r3lab.experiments.drift import run_drift
    from r3lab.paths import model_dir
    from r3lab.runs import load

    engines = _spy_engine_actors(monkeypatch)
    trainers: list[tuple[list[str], list[int]]] = []
    base = dict(trainer="megatron", tp=2, models=("tiny-qwen3-moe",), trainer_dtypes=("float32",), prompts=3,
                max_tokens=8)
    d = model_dir("tiny-qwen3-moe")
    local = run_drift(DriftConfig.quick(**base), progress=False, runs_root=tmp_path, run_name="local",
                      engines={"tiny-qwen3-moe": engine_pool.engine(d, seed=0)})
    remote = run_drift(DriftConfig.quick(**base, cluster="ray", engine_resources=ENGINE, trainer_resources=TRAINER),
                       progress=False, runs_root=tmp_path, run_name="ray", engines={
                           "tiny-qwen3-moe": engine_pool.engine(d, seed=0)},
                       on_trainer=lambda label, tr, samples: trainers.append((tr.node_ids, tr.pids)))
    assert not engines, "a drift given its engine started an engine actor"
    [(node_ids, pids)] = trainers
    assert node_ids == [cluster["trainer"]] * 2
    assert _all_gone(pids)
    assert local[0].summary == remote[0].summary
    a, b = load(tmp_path / "local"), load(tmp_path / "ray")
    for col in ("logp_infer", "logp_none", "logp_r3", "flipped"):
        assert np.array_equal(a.tokens([0])[col].to_numpy(), b.tokens([0])[col].to_numpy()), col
    assert np.array_equal(a.routes(0, "engine").values, b.routes(0, "engine").values)
    with pytest.raises(ClusterError, match="no node of the cluster can hold the engine actor"):
        RayEngine(model_dir("tiny-qwen3-moe"), resources='{"GPU": 1}')


def _spy_engine_actors(monkeypatch) -> list:
    """The RayEngine instances started from now on (the engine actors runs start for themselves)."""
    from r3lab.cluster import RayEngine

    engines: list[RayEngine] = []
    start = RayEngine.__init__

    def seen_start(self, *a, **k):
        engines.append(self)
        start(self, *a, **k)

    monkeypatch.setattr(RayEngine, "__init__", seen_start)
    return engines


def _rl(mode: str = "R3", **kw) -> RLConfig:
    return RLConfig.quick(trainer="megatron", tp=2, steps=2, prompts_per_step=2, samples_per_prompt=2,
                          max_tokens=8, mini_batches=2, mode=mode, noise_every=0, **kw)


def test_a_two_step_megatron_r3w_run_through_the_cluster_equals_the_local_run(cluster, tmp_path, engine_pool,
                                                                              monkeypatch):
    """R3W (the engine actor the run starts for itself, on node A, captures its routers' weights; the rank actors
    replay ids and weights): the steps' values and the stored engine routes, ids and weights, equal the local
    run's (on the session's engine with the options R3W needs, restored after the run)."""
    from r3lab.experiments import rl
    from r3lab.experiments.rl import run_rl
    from r3lab.paths import model_dir
    from r3lab.runs import load

    cfg = _rl("R3W")
    with engine_pool.lease(model_dir(cfg.model), seed=cfg.seed, **rl.engine_options(cfg)) as engine:
        local = run_rl(cfg, engine=engine, progress=False, runs_root=tmp_path, run_name="local")
    engines = _spy_engine_actors(monkeypatch)
    remote = run_rl(_rl("R3W", cluster="ray", engine_resources=ENGINE, trainer_resources=TRAINER), progress=False,
                    runs_root=tmp_path, run_name="ray")
    assert [e.node_id for e in engines] == [cluster["engine"]]  # the run's own engine actor, on node A
    keys = [k for k in local.steps[0] if not k.startswith("time_")]
    assert RLMetric.ROUTER_WEIGHTS_L1 in keys, keys  # the live router's weights measured against the engine's
    for x, y in zip(local.steps, remote.steps, strict=True):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}  # bit-equal: same kernels, same inputs
    a, b = load(tmp_path / "local"), load(tmp_path / "ray")
    for step in (0, 1):
        ra, rb = a.routes(step, "engine"), b.routes(step, "engine")
        assert ra.weights is not None and rb.weights is not None, "R3W stored no engine routing weights"
        assert np.array_equal(ra.values, rb.values) and np.array_equal(ra.weights, rb.weights)


def test_a_rank_killed_mid_step_ends_the_run_within_its_bound(cluster, tmp_path, engine_pool):
    """The rank actors are what this test kills: the run samples with the session's engine (engine=), so no engine
    actor starts for it (the R3W test above starts the module's one)."""
    import ray

    from r3lab.cluster import megatron as cm
    from r3lab.experiments import rl
    from r3lab.experiments.rl import run_rl
    from r3lab.paths import model_dir

    seen: list = []
    init = cm.RayMegatronTrainer._start_ranks

    def keep(self, *a, **k):  # the trainer the run builds, to kill one of its ranks
        init(self, *a, **k)
        seen.append(self)

    cm.RayMegatronTrainer._start_ranks = keep
    bound = 60.0
    timers: list[threading.Timer] = []
    try:
        def kill_rank1_on_step_1(rec):  # step 0 written: rank 1 dies half a second into step 1
            if rec["step"] == 0:
                timers.append(threading.Timer(0.5, lambda: ray.kill(seen[0].members[1].handle, no_restart=True)))
                timers[-1].start()

        cfg = _rl(cluster="ray", trainer_resources=TRAINER, cluster_timeout=bound)
        with engine_pool.lease(model_dir(cfg.model), seed=cfg.seed, **rl.engine_options(cfg)) as engine:
            t0 = time.monotonic()
            with pytest.raises(ClusterError) as e:
                run_rl(cfg, engine=engine, progress=False, runs_root=tmp_path, run_name="killed",
                       on_step=kill_rank1_on_step_1)
            took = time.monotonic() - t0
    finally:
        cm.RayMegatronTrainer._start_ranks = init
        for t in timers:
            t.join(5)
    tr = seen[0]
    name = tr.members[1].name
    msg = str(e.value)
    assert name in msg and tr.members[1].node_id[:16] in msg and "every rank actor was ended" in msg
    assert took < 300 + bound  # two steps' work plus the bound, not a hang
    assert _all_gone(tr.pids)  # no rank process left behind
    stopped = json.loads((tmp_path / "killed" / "stopped.json").read_text())
    assert stopped["state"] == "stopped" and name in stopped["reason"]
