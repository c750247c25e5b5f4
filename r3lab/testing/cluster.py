"""A multi-node Ray cluster on one machine for tests and benches (r3lab.cluster on two raylets): :func:`local_cluster`.

Each node is a raylet of its own with its own resources (``ray.cluster_utils.Cluster``, the tool Ray's own tests use
for multi-node behaviour), so placement by resources, the object store between nodes and actors dying on one node
behave as on a real cluster; only the network is loopback.

One thing is changed so that it starts on a small, loaded machine: a raylet given port 0 for its agents waits for
the dashboard agent to write the ports it took, 15 s and no more, then aborts
(``NodeManager::WaitForDashboardAgentPorts`` and ``WaitForPersistedPort`` in ``src/ray/raylet/node_manager.cc``,
Ray 2.x; the Python side never passes ``--dashboard_agent_listen_port`` to the raylet, ``ray/_private/services.py::
start_raylet``), and on two busy cores the agent takes 20-30 s to import its modules. Here every node gets fixed
free ports for its agents, and the raylet is started through a two-line shell wrapper that adds
``--dashboard_agent_listen_port`` with the agent's port, so the raylet waits for no port file.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from r3lab.errors import ClusterError

__all__ = ["local_cluster", "agent_ports"]

_PORT_NAMES = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port", "runtime_env_agent_port")


def agent_ports() -> dict[str, int]:
    """Four free TCP ports for one node's agents (metrics, metrics export, dashboard agent, runtime env agent)."""
    socks = [socket.socket() for _ in _PORT_NAMES]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return {n: s.getsockname()[1] for n, s in zip(_PORT_NAMES, socks, strict=True)}
    finally:
        for s in socks:
            s.close()


def _raylet_wrapper(real: str, folder: Path) -> str:
    """A shell script that runs ``real`` with the dashboard agent's listen port passed on (the module docstring)."""
    path = folder / "raylet"
    path.write_text(
        "#!/bin/sh\n"
        "port=0\n"
        'for a in "$@"; do case "$a" in --dashboard_agent_command=*) '
        "port=$(printf '%s' \"$a\" | sed -n 's/.*--listen-port=\\([0-9]*\\).*/\\1/p');; esac; done\n"
        f'exec "{real}" "$@" --dashboard_agent_listen_port="$port"\n')
    path.chmod(0o755)
    return str(path)


@contextlib.contextmanager
def local_cluster(nodes: Sequence[Mapping[str, Any]], *, object_store_mb: int = 150) -> Iterator[list[str]]:
    """Start one raylet per entry of ``nodes`` (``ray start``'s settings: ``num_cpus``, ``resources``, ...; the
    first is the head), connect this process (``ray.init``), yield the node ids in that order; on exit disconnect
    and end every raylet, agent and worker. Refuses to run while this process is connected to another cluster."""
    import ray
    import ray._private.services as services
    from ray.cluster_utils import Cluster

    if not nodes:
        raise ClusterError("local_cluster needs at least one node")
    if ray.is_initialized():
        raise ClusterError("local_cluster: this process is already connected to a Ray cluster (ray.shutdown() first)")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    real = services.RAYLET_EXECUTABLE
    cluster = None
    with tempfile.TemporaryDirectory(prefix="r3lab-raylet-") as tmp:
        services.RAYLET_EXECUTABLE = _raylet_wrapper(real, Path(tmp))
        try:
            base = {"object_store_memory": object_store_mb << 20}
            head = {**base, "include_dashboard": False, **nodes[0], **agent_ports()}
            cluster = Cluster(initialize_head=True, head_node_args=head)
            added = [cluster.add_node(**{**base, **n, **agent_ports()}) for n in nodes[1:]]
            ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
            head_node: Any = cluster.head_node  # set by initialize_head
            ids = [head_node.node_id] + [n.node_id for n in added]
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if set(ids) - alive:
                raise ClusterError(f"local_cluster: nodes {sorted(set(ids) - alive)} did not come up")
            yield ids
        finally:
            services.RAYLET_EXECUTABLE = real
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
