"""Joining a Ray cluster the way Ray's own tools do, and placing actors by resources, checked before they wait.

:func:`connect` resolves ``cluster`` as ``ray start`` / ``ray job submit`` users expect (Ray 2.x,
``ray/_private/worker.py::init`` and ``ray/_private/services.py::canonicalize_bootstrap_address``):

* ``"ray"``: ``$RAY_ADDRESS`` when set, else ``"auto"``, the cluster ``ray start`` made on this machine;
* ``"HOST:PORT"``: a GCS address (``ray start --head`` prints it; 6379 by default);
* ``"ray://HOST:PORT"``: Ray Client (a driver outside the cluster).

It never starts a private cluster: ``ray.init()`` without an address would, so r3lab always passes one, and a
named address is probed first (a TCP connect within ``timeout_s``), because Ray itself retries an absent GCS for
about a minute before it gives up. A driver that called ``ray.init`` itself (a notebook, a test's
``ray.cluster_utils.Cluster``) is reused as it is.

Resources are JSON objects as ``ray start --resources`` takes them: ``{"GPU": 1}``, ``{"CPU": 2, "engine": 1}``.
``CPU`` and ``GPU`` become the actor's ``num_cpus`` / ``num_gpus``; every other key is a custom resource.
:func:`check_placeable` refuses, at once and by name, a demand no node of the cluster could ever meet (Ray would
keep the actor pending forever with a warning in its logs).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from r3lab.errors import ClusterError

__all__ = ["node_here"]

#: what an actor asks for when no resources are given: one CPU (Ray's own default for actors is 0 for scheduling)
DEFAULT_RESOURCES: dict[str, float] = {"CPU": 1.0}

_HOW = ("start one with `ray start --head` (then `ray start --address HEAD:6379` on every other node), or set "
        "RAY_ADDRESS / pass --cluster HOST:PORT or ray://HOST:10001")


def resolve_address(cluster: str) -> str:
    """The address ``ray.init`` gets for ``cluster``: ``"ray"`` -> ``$RAY_ADDRESS`` or ``"auto"``; an address as is."""
    if not isinstance(cluster, str) or not cluster.strip():
        raise ClusterError(f"cluster must be 'ray', HOST:PORT or ray://HOST:PORT, got {cluster!r}")
    cluster = cluster.strip()
    if cluster == "ray":
        return os.environ.get("RAY_ADDRESS", "").strip() or "auto"
    if cluster == "auto" or cluster.startswith("ray://"):
        return cluster
    host, sep, port = cluster.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in host:
        raise ClusterError(f"cluster {cluster!r} is not 'ray', HOST:PORT (a GCS address) or ray://HOST:PORT")
    return cluster


def _probe(address: str, timeout_s: float) -> None:
    """A TCP connect to the address's host and port within ``timeout_s``, or a :class:`~r3lab.errors.ClusterError`
    naming it."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise ClusterError(f"no Ray cluster answers at {address} ({type(e).__name__}: {e}): {_HOW}") from None


def connect(cluster: str = "ray", *, timeout_s: float = 10.0, namespace: str = "r3lab") -> str:
    """Connect this process to the Ray cluster ``cluster`` names (see the module docstring); returns the address.

    Already connected (``ray.is_initialized()``): that connection is used, whatever ``cluster`` says.
    No cluster running: :class:`~r3lab.errors.ClusterError` saying how to start one; never a private cluster.
    """
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is in the `ray` extra
        raise ClusterError("--cluster ray needs Ray: pip install 'r3lab[ray]'") from e
    if ray.is_initialized():
        return str(ray.get_runtime_context().gcs_address)
    address = resolve_address(cluster)
    if address != "auto":
        _probe(address, timeout_s)
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
    except ConnectionError as e:
        where = "RAY_ADDRESS is unset and no `ray start` cluster runs on this machine" if address == "auto" else (
            f"the cluster at {address} refused the connection")
        raise ClusterError(f"no Ray cluster to join: {where} ({e}); {_HOW}") from None
    return address


def parse_resources(spec: str | Mapping[str, Any] | None, *, what: str) -> dict[str, float]:
    """A resource demand from JSON text or a mapping: ``{name: amount >= 0}``; None gives :data:`DEFAULT_RESOURCES`."""
    if spec is None:
        return dict(DEFAULT_RESOURCES)
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ClusterError(f"{what} must be a JSON object such as '{{\"GPU\": 1}}', got {spec!r} ({e})") from None
    if not isinstance(spec, Mapping):
        raise ClusterError(f"{what} must be a JSON object such as '{{\"GPU\": 1}}', got {spec!r}")
    out: dict[str, float] = {}
    for k, v in spec.items():
        if not isinstance(k, str) or not k or isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ClusterError(f"{what}: {k!r}: {v!r} is not a resource name with an amount >= 0")
        out[k] = float(v)
    return out


def actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray's actor options for a demand: ``num_cpus``, ``num_gpus`` and the custom ``resources``."""
    rest = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0), "resources": rest}


def check_placeable(resources: Mapping[str, float], *, what: str, count: int = 1) -> None:
    """Refuse a demand no alive node can hold (``count`` bundles of it in all: a placement group's), by name."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    fits = [n for n in nodes if all(n.get(k, 0.0) >= v for k, v in resources.items())]
    if not fits:
        have = sorted({k for n in nodes for k in n if not k.startswith(("node:", "memory", "object_store"))})
        raise ClusterError(f"no node of the cluster can hold {what} {dict(resources)} (the nodes' resources: {have}); "
                           f"start a node with them (`ray start --resources '{json.dumps(dict(resources))}'`) or "
                           "ask for less")
    total = {k: sum(n.get(k, 0.0) for n in nodes) for k in resources}
    short = {k: total[k] for k, v in resources.items() if v * count > total[k]}
    if short:
        raise ClusterError(f"{what}: {count} x {dict(resources)} exceeds the cluster's total {short}")


def node_here() -> dict[str, Any]:
    """Where the calling Ray worker runs: node id, node IP, process id (an actor reports this at start)."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid()}
