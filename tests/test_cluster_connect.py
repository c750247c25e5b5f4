"""Joining a Ray cluster (r3lab.cluster.connect) without one: the address resolution Ray's tools use, a clear error
within seconds when no cluster runs (never a private cluster started instead), resource demands checked, and the
configs' cluster knobs validated. No raylet starts here (fast tier)."""

from __future__ import annotations

import functools
import socket
import time

import pytest

from r3lab.cluster import actor_options, connect, parse_resources, resolve_address
from r3lab.config import DriftConfig, RLConfig
from r3lab.errors import ClusterError, ConfigError


def test_ray_resolves_to_ray_address_else_the_local_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_address("ray") == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert resolve_address("ray") == "10.0.0.5:6379"
    assert resolve_address("ray://head:10001") == "ray://head:10001"
    assert resolve_address("head:6379") == "head:6379"
    for bad in ("", "head", "head:port", "http://x:1"):
        with pytest.raises(ClusterError):
            resolve_address(bad)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: nothing listens there


def test_no_cluster_is_a_clear_error_and_none_is_started(monkeypatch):
    import ray
    import ray._private.services as services

    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # "auto" finds any GCS process on this machine (Ray's legacy lookup): hide another test's or job's cluster
    none_found = functools.lru_cache(maxsize=1)(lambda: [])  # Ray clears the lookup's cache before it looks
    monkeypatch.setattr(services, "find_gcs_addresses", none_found)
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="no Ray cluster to join.*ray start --head"):
        connect("ray")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_closed_port()}")
    with pytest.raises(ClusterError, match="no Ray cluster answers at 127.0.0.1:"):
        connect("ray", timeout_s=2)  # the named address, not a new cluster
    with pytest.raises(ClusterError, match="no Ray cluster answers at ray://127.0.0.1:"):
        connect(f"ray://127.0.0.1:{_closed_port()}", timeout_s=2)
    assert time.monotonic() - t0 < 30  # Ray alone retries an absent GCS for about a minute
    assert not ray.is_initialized()


def test_resources_parse_into_actor_options():
    assert parse_resources(None, what="x") == {"CPU": 1.0}
    r = parse_resources('{"GPU": 1, "engine": 0.5}', what="--engine-resources")
    assert actor_options(r) == {"num_cpus": 0.0, "num_gpus": 1.0, "resources": {"engine": 0.5}}
    for bad in ("{", "[1]", '{"GPU": -1}', '{"GPU": true}', '{"": 1}'):
        with pytest.raises(ClusterError, match="--engine-resources"):
            parse_resources(bad, what="--engine-resources")


def test_the_configs_cluster_knobs_are_checked():
    cfg = RLConfig.quick(trainer="megatron", tp=2, cluster="ray", trainer_resources='{"trainer": 1}')
    assert "--cluster" in cfg.to_cli_args() and RLConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="--engine-resources places actors on a Ray cluster: it needs --cluster"):
        DriftConfig.quick(engine_resources='{"GPU": 1}')
    with pytest.raises(ConfigError, match="--cluster must be ray, HOST:PORT or ray://HOST:PORT"):
        RLConfig.quick(cluster="somewhere")
    with pytest.raises(ConfigError, match="--trainer-resources must map resource names"):
        DriftConfig.quick(cluster="ray", trainer_resources='{"GPU": "one"}')
    with pytest.raises(ConfigError, match="--cluster-timeout must be > 0"):
        DriftConfig.quick(cluster="ray", cluster_timeout=0)


def test_the_cluster_flags_appear_in_a_command_only_when_set():
    from r3lab.cli import _parser
    from r3lab.config import config_overrides

    for cfg in (RLConfig.quick(), DriftConfig.quick()):  # the commands of runs without a cluster: as before
        assert not any(a.startswith("--cluster") or a.endswith("-resources") for a in cfg.to_cli_args())
    cfg = RLConfig.quick(trainer="megatron", tp=2, cluster="10.0.0.5:6379", engine_resources='{"GPU": 1}',
                         trainer_resources='{"GPU": 1}', cluster_timeout=45.0)
    args = cfg.to_cli_args()
    assert args[args.index("--cluster-timeout") + 1] == "45.0"
    back = RLConfig(**config_overrides(_parser().parse_args(["rl", *args]), RLConfig))
    assert back == cfg  # the command runs exactly this config
    drift = DriftConfig.quick(cluster="ray", cluster_timeout=300.0)
    back = DriftConfig(**config_overrides(_parser().parse_args(["drift", *drift.to_cli_args()]), DriftConfig))
    assert back == drift and "--cluster-timeout" not in drift.to_cli_args()
