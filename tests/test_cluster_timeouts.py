"""The cluster's fixed waits are one policy (r3lab.cluster.waits.RayTimeouts), read at every wait: no module of
r3lab.cluster spells a number of seconds in a call, and a policy given to an actor class reaches each of its waits.

Ray is replaced by a recorder of the waits it is asked for (the code imports ``ray`` when it runs, so a module in
``sys.modules`` stands in): no raylet starts here (fast tier). The real waits run in tests/test_cluster.py.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest

import r3lab.cluster
from r3lab.cluster.waits import RAY_TIMEOUTS, Member, RayTimeouts, gather
from r3lab.errors import ClusterError, ConfigError

CLUSTER_DIR = Path(r3lab.cluster.__file__).parent
TINY = RayTimeouts(death_grace_s=0.125, ready_fetch_s=0.25, close_grace_s=0.375, polite_stop_s=0.5)


def _numeric_timeouts(source: str, filename: str) -> list[str]:
    """Every keyword argument named ``timeout*`` of a call whose value holds a number literal, as ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg is None or not kw.arg.startswith("timeout"):
                continue
            literal = any(isinstance(n, ast.Constant) and isinstance(n.value, int | float)
                          and not isinstance(n.value, bool) for n in ast.walk(kw.value))
            if literal:
                found.append(f"{filename}:{kw.value.lineno}")
    return found


def test_no_module_of_the_cluster_spells_a_wait_in_seconds():
    found = [hit for path in sorted(CLUSTER_DIR.glob("*.py"))
             for hit in _numeric_timeouts(path.read_text(), path.name)]
    assert not found, f"waits spelled in seconds, not read from RayTimeouts: {found}"


def test_the_check_catches_a_literal_wait():
    src = "ray.get(ref, timeout=10.0)\nray.wait(p, timeout=min(3, t))\nray.get(ref, timeout=policy.close_grace_s)\n"
    assert _numeric_timeouts(src, "x.py") == ["x.py:1", "x.py:2"]


def test_the_policy_keeps_the_waits_the_cluster_always_had_and_refuses_nonsense():
    assert (RAY_TIMEOUTS.death_grace_s, RAY_TIMEOUTS.ready_fetch_s, RAY_TIMEOUTS.close_grace_s,
            RAY_TIMEOUTS.polite_stop_s) == (3.0, 1.0, 10.0, 5.0)
    for bad in (0, -1.0, float("nan"), True, "5"):
        with pytest.raises(ConfigError, match="close_grace_s must be a number of seconds > 0"):
            RayTimeouts(close_grace_s=bad)
    with pytest.raises(AttributeError):  # frozen: one policy, never edited in place
        RAY_TIMEOUTS.close_grace_s = 1.0  # type: ignore[misc]


class _TaskError(Exception):
    """What ``ray.get`` raises for a call that raised inside its actor."""


class _ActorDied(Exception):
    """Ray's RayActorError."""


class FakeRay(types.ModuleType):
    """The few calls of ``ray`` the cluster code makes, each recording the wait it was asked for.

    A ref is a string: ``"ok:..."`` answers, ``"raise:..."`` raised in its actor, ``"pending:..."`` never answers."""

    def __init__(self) -> None:
        super().__init__("ray")
        self.waits: list[tuple[str, float | None]] = []
        self.killed: list[object] = []
        self.exceptions = types.SimpleNamespace(RayActorError=_ActorDied, GetTimeoutError=TimeoutError)
        self.util = types.SimpleNamespace(remove_placement_group=lambda pg: None)

    def get(self, ref: str, timeout: float | None = None) -> str:
        self.waits.append(("get", timeout))
        if ref.startswith("raise"):
            raise _TaskError(f"{ref} raised")
        if ref.startswith("pending"):
            raise TimeoutError(ref)
        return ref

    def wait(self, refs: list[str], num_returns: int = 1, timeout: float | None = None):
        self.waits.append(("wait", timeout))
        ready = [r for r in refs if not r.startswith("pending")][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def kill(self, handle: object, no_restart: bool = True) -> None:
        self.killed.append(handle)


@pytest.fixture
def fake_ray(monkeypatch):
    ray = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", ray)
    return ray


class _Handle:
    """An actor handle whose ``close.remote()`` is a ref that answers."""

    def __init__(self, name: str):
        self.close = types.SimpleNamespace(remote=lambda: f"ok:{name}.close")


def test_gather_reads_its_grace_and_its_fetch_from_the_policy(fake_ray):
    members = [Member(None, "rank0"), Member(None, "rank1")]
    with pytest.raises(ClusterError, match="actor rank0 .* failed during step"):
        gather(["raise:0", "pending:1"], members, "step", 60.0, ClusterError, timeouts=TINY)
    # rank 0's result fetched (at least ready_fetch_s), then rank 1 given death_grace_s to show it died
    assert fake_ray.waits[0] == ("wait", pytest.approx(60.0, abs=1.0))
    assert fake_ray.waits[1][0] == "get" and fake_ray.waits[1][1] >= TINY.ready_fetch_s
    assert fake_ray.waits[2] == ("wait", TINY.death_grace_s)
    fake_ray.waits.clear()
    with pytest.raises(ClusterError):
        gather(["raise:0", "pending:1"], members, "step", 60.0, ClusterError)
    assert fake_ray.waits[2] == ("wait", RAY_TIMEOUTS.death_grace_s)  # no policy given: the default one


def test_the_engine_and_the_trainer_actor_close_within_the_policys_grace(fake_ray):
    from r3lab.cluster.engine import RayEngine
    from r3lab.cluster.trainer import RayTrainer

    for cls in (RayEngine, RayTrainer):
        actor = cls.__new__(cls)  # only what close() reads: starting one needs a cluster (tests/test_cluster.py)
        actor._closed, actor.member, actor.timeouts = False, Member(_Handle(cls.__name__), cls.__name__), TINY
        fake_ray.waits.clear()
        actor.close()
        assert fake_ray.waits == [("get", TINY.close_grace_s)], cls
        assert fake_ray.killed[-1] is actor.member.handle


def test_the_rank_actors_stop_within_the_policys_polite_wait(fake_ray, monkeypatch):
    from r3lab.cluster import megatron as cm

    monkeypatch.setattr(cm, "connect", lambda cluster: None)  # no cluster to join: the transport's own waits only
    ranks = cm.RayRanks(timeouts=TINY)
    ranks._members = [Member(_Handle(f"rank{r}"), f"rank{r}") for r in range(2)]
    ranks.close()
    assert fake_ray.waits == [("wait", TINY.polite_stop_s)]
    assert fake_ray.killed == [m.handle for m in ranks._members]
    assert cm.RayRanks().timeouts is RAY_TIMEOUTS
