"""Trainer ranks as torch.distributed processes: started here, gloo on loopback, bounded waits, all or none.

:func:`launch` runs ``fn(rank, world_size, *args)`` on ``world_size`` processes started as
:func:`rank_processes` starts them and returns every rank's return value, or raises: when a rank raises
(:class:`torch.multiprocessing.ProcessRaisedException` names it), when a rank dies, or when the whole
run takes longer than ``timeout_s`` (:class:`~r3lab.errors.LaunchTimeout`; every rank is then terminated). Collectives
inside a rank wait at most ``collective_timeout_s`` (the gloo process group's timeout). The ranks meet through
a rendezvous store the launching process hosts on a port it holds (:func:`host_rendezvous`, :func:`join_world`).

Why processes rather than Ray actors: Megatron's parallel state is one torch.distributed world per
process, the same on GPU nodes (torchrun, NCCL); rank processes need nothing beyond torch, start in
seconds and die with the driver. A Ray actor would host the same function unchanged.

How they start (:func:`rank_processes`): forked from ``multiprocessing``'s fork server, which imported
:data:`RANK_PRELOAD` once, instead of spawned (a fresh interpreter importing torch, megatron-core and transformers
for every rank; ``tests/test_megatron_load.py`` alone: 130 s spawned, 75 s forked, this machine). A forked rank
would have the fork server's environment, which is this process's when the server started: each rank is handed
this process's environment at its start and makes it its own (:func:`adopt_environment`).
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from r3lab.errors import ConfigError, LaunchTimeout, R3LabFailure

__all__ = ["host_rendezvous", "join_world"]

WORLD_PREFIX = "r3lab-world/"  # the gloo world's keys in a rendezvous store that may hold other keys (staging)

#: the modules a rank imports before it joins, imported once in the fork server every rank is forked from. Only
#: imports without side effects beyond defining things: the CPU patches (``patch_megatron_for_cpu``) and
#: Megatron-Bridge's Transformer Engine stand-in are applied in each rank. A module that cannot be imported there is
#: skipped (``multiprocessing`` ignores its ImportError) and imported by the rank itself, as a spawned rank would.
RANK_PRELOAD = (
    "torch", "torch.distributed", "numpy", "transformers", "megatron.core", "megatron.core.models.gpt",
    "megatron.core.transformer.moe.router", "megatron.core.tensor_parallel", "r3lab.slicing", "r3lab.staging",
    "r3lab.replay", "r3lab.trainers.megatron.worker", "r3lab.trainers.megatron.checkpoint",
    "r3lab.trainers.megatron.cpu", "r3lab.trainers.megatron.forward", "r3lab.trainers.megatron.store_backend",
    "r3lab.trainers.megatron.rank_preload",  # Megatron-Bridge through its stand-in, its guard run once
)
RANK_START_METHOD = "forkserver"


def rank_processes() -> Any:
    """The ``torch.multiprocessing`` context trainer ranks start in: the fork server's, with :data:`RANK_PRELOAD`
    (read when this process's fork server starts, at its first rank)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context(RANK_START_METHOD)
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    return ctx


def adopt_environment(environ: dict[str, str] | None) -> None:
    """Make ``environ`` (the starting process's environment when it started this rank) this process's own: a rank
    forked from the fork server would otherwise see the server's, which is the starting process's at an earlier
    time (a variable set since, a test's or a user's, would be missing)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)


def host_rendezvous(timeout_s: float, host: str = "127.0.0.1") -> Any:
    """A ``TCPStore`` server on a port the OS picks (port 0) and this process keeps listening on: the ranks'
    rendezvous. Nothing else can take the port between choosing it and using it (a port found free and let go
    could be, and once was: "Gloo connectFullMesh failed ... Connection closed by peer" in a fresh-clone CI run).
    Its ``port`` is what the ranks are told."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=float(timeout_s)))


def join_world(rank: int, world_size: int, host: str, port: int, timeout_s: float, store: Any = None) -> None:
    """Join the ranks' gloo world through the rendezvous store at ``host:port`` (``store``: the server itself, in
    the process that hosts it); gloo's own sockets are then bound by each rank and exchanged through the store."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(timeout_s))
    if store is None:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", store=dist.PrefixStore(WORLD_PREFIX, store), rank=rank, world_size=world_size,
                            timeout=timeout)


def _worker(rank: int, world_size: int, port: int, outdir: str, coll_s: float, fn: Callable, args: tuple,
            environ: dict[str, str] | None = None) -> None:
    import torch.distributed as dist

    from r3lab.trainers.megatron.cpu import patch_megatron_for_cpu

    adopt_environment(environ)
    torch.set_num_threads(1)
    patch_megatron_for_cpu()
    join_world(rank, world_size, "127.0.0.1", port, coll_s)
    try:
        result = fn(rank, world_size, *args)
        tmp = os.path.join(outdir, f"{rank}.pkl.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        os.replace(tmp, os.path.join(outdir, f"{rank}.pkl"))
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:  # noqa: BLE001 - teardown must not hide the rank's own error
            pass
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` CPU ranks (gloo, loopback; started by
    :func:`rank_processes`); results by rank.

    ``fn`` must be importable (module level) and its arguments and return value picklable. The launch
    returns within ``timeout_s`` (raising :class:`~r3lab.errors.LaunchTimeout` after terminating every rank) and raises
    if any rank fails; it never returns a partial result.
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    rendezvous = host_rendezvous(collective_timeout_s)  # held until every rank is done
    with tempfile.TemporaryDirectory(prefix="r3lab_launch_") as outdir:
        rank_processes()  # the fork server's preload, before torch starts the processes in its context
        ctx = mp.start_processes(
            _worker,
            args=(world_size, rendezvous.port, outdir, float(collective_timeout_s), fn, args, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=RANK_START_METHOD,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise LaunchTimeout(f"{world_size} ranks did not finish within {timeout_s:.0f} s; terminated")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"{r}.pkl")
            if not os.path.exists(path):
                raise R3LabFailure(f"rank {r} exited without a result")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    return results
