"""How the Megatron driver reaches its ranks: a :class:`RankTransport`, and :class:`SpawnedRanks`, the default.

:class:`~r3lab.trainers.megatron.trainer.MegatronTrainer` is the driver (batches, staging plans, replay checks,
losses) and takes its ranks from a transport, which

* starts the ``world`` ranks, each building its shard from the same spec, and returns each rank's coordinates;
* sends every rank one command and returns every reply, in rank order, within a bound: all or none (a rank that
  raises, dies or is late makes the call raise the error the driver's ``fail`` builds, after it ended every rank);
* holds the staging backend routes are put in (:mod:`r3lab.staging`), and releases a staged batch's chunks;
* gathers the weights (``export``) and ends the ranks (``close``).

:class:`SpawnedRanks` starts gloo processes here (:func:`~r3lab.trainers.megatron.rank_processes`) and stages
routes in the key-value store the driver hosts (:class:`~r3lab.trainers.megatron.store_backend.StoreBackend`);
:class:`r3lab.cluster.megatron.RayRanks` hosts the same ranks as Ray actors in a placement group, with
:class:`~r3lab.staging.RayBackend`. Errors say which: :attr:`RankTransport.label`, :attr:`RankTransport.ended` and
:attr:`RankTransport.error` (:class:`~r3lab.errors.MegatronTrainerError` here).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from r3lab.errors import MegatronTrainerError, R3LabError

__all__ = ["RankTransport", "SpawnedRanks", "Fail"]

#: what a transport calls on a failure: it ends every rank and returns the error to raise (the message in, the error
#: out; the driver's own, naming the model and layout)
Fail = Callable[[str], R3LabError]


class RankTransport(Protocol):
    """Starts, reaches and ends the Megatron trainer's ranks (module docstring); every wait bounded, all or none."""

    label: str  # how errors name the trainer: "Megatron trainer", "Megatron trainer on Ray"
    ended: str  # what a failure did to the ranks: "every rank was ended"
    error: type[R3LabError]  # the type of a failure (and of a call on a closed trainer)

    @property
    def backend(self) -> Any:
        """The staging backend the driver puts routes in (:class:`r3lab.staging.Backend`)."""
        ...

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, by rank."""
        ...

    def start(self, spec: dict[str, Any], world: int, timeout: float, fail: Fail) -> list[Any]:
        """Start ``world`` ranks building their shards from ``spec``; each rank's start reply, by rank."""
        ...

    def call(self, cmd: str, kwargs: dict[str, Any], timeout: float, fail: Fail) -> list[Any]:
        """``cmd(**kwargs)`` on every rank; every reply, by rank, within ``timeout`` s."""
        ...

    def export(self, timeout: float, fail: Fail) -> Mapping[str, Any]:
        """The weights gathered from every shard, in the checkpoint's names (CPU tensors, or a lazy mapping)."""
        ...

    def stage_info(self, info: dict[str, Any], staged: Any) -> dict[str, Any]:
        """What the ranks get about a staged batch: ``info`` (chunks, plan), with what this backend's ranks need."""
        ...

    def release(self, staged: Any) -> None:
        """Free a staged batch's chunks (after every rank got its own)."""
        ...

    def close(self) -> None:
        """End every rank (politely first); idempotent."""
        ...


class SpawnedRanks:
    """The ranks as spawned gloo processes of this machine, one command pipe each; routes staged in the key-value
    store this process hosts on the ranks' rendezvous port (held from the start, so no other process takes it)."""

    label = "Megatron trainer"
    ended = "every rank was ended"
    error: type[R3LabError] = MegatronTrainerError

    def __init__(self) -> None:
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self._backend: Any = None
        self._closed = False

    @property
    def backend(self) -> Any:
        return self._backend

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self, spec: dict[str, Any], world: int, timeout: float, fail: Fail) -> list[Any]:
        from r3lab.trainers.megatron.launch import host_rendezvous, rank_processes
        from r3lab.trainers.megatron.store_backend import StoreBackend
        from r3lab.trainers.megatron.worker import rank_main

        # the ranks' rendezvous and the store routes are staged in: on a port this process holds from the start
        self._store = host_rendezvous(max(float(spec["collective_timeout_s"]), 60.0))
        self._backend = StoreBackend(self._store)
        ctx = rank_processes()
        environ = dict(os.environ)  # a rank forked from the fork server would have the server's (older) environment
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(r, world, self._store.port, child, spec, environ), daemon=True,
                            name=f"r3lab-megatron-rank{r}")
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        return self._collect("start", timeout, fail, expect="ready")

    def call(self, cmd: str, kwargs: dict[str, Any], timeout: float, fail: Fail) -> list[Any]:
        dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
        if dead:
            r = dead[0]
            raise fail(f"rank {r} (pid {self._procs[r].pid}) died before {cmd} (exit code "
                       f"{self._procs[r].exitcode}; dead ranks: {dead})")
        for r, c in enumerate(self._conns):
            try:
                c.send((cmd, kwargs))
            except (BrokenPipeError, OSError):
                raise fail(f"rank {r} is gone (its pipe is closed) before {cmd}") from None
        return self._collect(cmd, timeout, fail)

    def _collect(self, what: str, timeout: float, fail: Fail, expect: str = "ok") -> list[Any]:
        """Every rank's reply within ``timeout`` s, or end them all and raise (a failure, a death or the deadline)."""
        deadline = time.monotonic() + timeout
        replies: dict[int, Any] = {}
        while len(replies) < len(self._conns):
            for r, c in enumerate(self._conns):
                if r in replies:
                    continue
                try:
                    ready = c.poll(0.02)
                except (EOFError, OSError):
                    ready = False
                if ready:
                    try:
                        kind, value = c.recv()
                    except (EOFError, OSError) as e:
                        raise fail(f"rank {r} closed its pipe during {what} ({type(e).__name__})") from None
                    if kind == "error":
                        dead = [d for d, p in enumerate(self._procs) if not p.is_alive()]
                        if dead:  # the cause first: a rank that died makes its peers' collectives fail
                            d = dead[0]
                            raise fail(f"rank {d} (pid {self._procs[d].pid}) died during {what} (exit code "
                                       f"{self._procs[d].exitcode}; dead ranks: {dead}); rank {r} failed "
                                       f"after it:\n{value}")
                        raise fail(f"rank {r} failed during {what}:\n{value}")
                    if kind != expect:
                        raise fail(f"rank {r} answered {kind!r} to {what}")
                    replies[r] = value
                elif not self._procs[r].is_alive():
                    raise fail(f"rank {r} (pid {self._procs[r].pid}) died during {what} "
                               f"(exit code {self._procs[r].exitcode})")
            if len(replies) < len(self._conns) and time.monotonic() > deadline:
                late = [r for r in range(len(self._conns)) if r not in replies]
                raise fail(f"ranks {late} did not answer {what} within {timeout:.0f} s")
        return [replies[r] for r in range(len(self._conns))]

    def export(self, timeout: float, fail: Fail) -> Mapping[str, Any]:
        """Rank 0's gathered weights through its pipe, as torch tensors (bf16 travels as its bits)."""
        import torch

        replies = self.call("export", {}, timeout, fail)
        state = next(r for r in replies if r is not None)
        out = {}
        for n, (kind, a) in state.items():
            t = torch.from_numpy(np.array(a))
            out[n] = t.view(torch.bfloat16) if kind == "bfloat16" else t
        return out

    def stage_info(self, info: dict[str, Any], staged: Any) -> dict[str, Any]:
        return info  # the ranks reach the store through their rendezvous: nothing to add

    def release(self, staged: Any) -> None:
        staged.release()
        for k in staged.coordinator.keys(1):
            try:
                self._store.delete_key(k)
            except Exception:  # noqa: BLE001 - best effort
                pass

    def close(self) -> None:
        """End every rank (a polite ``close`` first, then terminate, then kill); idempotent."""
        if self._closed:
            return
        self._closed = True
        for c in self._conns:
            try:
                c.send(("close", {}))
            except (BrokenPipeError, OSError):
                pass
        end = time.monotonic() + 10.0
        for p in self._procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in self._conns:
            c.close()
