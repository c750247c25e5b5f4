"""All or none, bounded: every wait on an actor has a deadline, and one failure ends the whole job.

:func:`gather` waits for one call on each member of a job (the ranks of a trainer, or the engine alone) and returns
every value, or raises one :class:`~r3lab.errors.ClusterError` that names the member that failed first and its node.
The cause comes first (the seeds: "ensure that all trainer ranks block on retrieving data to avoid hanging NCCL
communication"): a rank that dies makes its peers' collectives fail a moment later, so after the first task error
the other calls get a short grace to show a dead actor, and a dead actor is named before a peer's error. A member
that neither answers nor dies within ``timeout`` s is named as hung. The caller ends every actor before it raises
(the ``on_fail`` it passes to :func:`gather`).

Every fixed wait of the cluster code (the grace above, fetching a result Ray reports ready, an actor's polite close
before it is killed) is one field of :class:`RayTimeouts`, the one policy the actor classes take and pass to each
wait; the per-call deadline is the config's ``cluster_timeout``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from r3lab.errors import ConfigError

__all__ = ["get_one"]

@dataclasses.dataclass(frozen=True)
class RayTimeouts:
    """The fixed waits of the calls on actors, in seconds: one policy, passed down to every wait.

    ``death_grace_s``: after one call of a job raised, how long the others get to show a dead actor (the cause is
    named before its effects); ``ready_fetch_s``: the least time fetching a result Ray reports ready may take;
    ``close_grace_s``: one actor's polite close (the engine's vLLM shutdown, a trainer's) before it is killed;
    ``polite_stop_s``: the rank actors' polite close, all at once, before they are killed. The deadline of each
    call is not here: it is the config's ``cluster_timeout``, the ``timeout_s`` each actor class takes.
    """

    death_grace_s: float = 3.0
    ready_fetch_s: float = 1.0
    close_grace_s: float = 10.0
    polite_stop_s: float = 5.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ConfigError(f"RayTimeouts.{f.name} must be a number of seconds > 0, got {v!r}")


#: the policy an actor class uses when it is given none
RAY_TIMEOUTS = RayTimeouts()


@dataclasses.dataclass
class Member:
    """One actor of a job: its handle, its name, and where it runs (known once it answered at start)."""

    handle: Any
    name: str
    node_id: str = ""
    ip: str = ""
    pid: int | None = None

    def where(self) -> str:
        if not self.node_id:
            return f"actor {self.name} (not placed yet)"
        return f"actor {self.name} (node {self.node_id[:16]} at {self.ip}, pid {self.pid})"


def _last_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1][:400] if lines else type(e).__name__


def gather(refs: Sequence[Any], members: Sequence[Member], what: str, timeout: float,
           on_fail: Callable[[str], BaseException], *, passthrough: tuple[type[BaseException], ...] = (),
           timeouts: RayTimeouts = RAY_TIMEOUTS) -> list[Any]:
    """``ray.get`` of ``refs[i]`` (a call on ``members[i]``) for every i within ``timeout`` s, or
    ``raise on_fail(message)``: the message names the failing member, its node, and what happened.

    ``passthrough``: error types a call may raise as itself (a refused input; the actor lives on), never with
    ``on_fail``. ``timeouts``: the grace for a dead peer and the fetch of a ready result (:class:`RayTimeouts`)."""
    import ray

    deadline = time.monotonic() + timeout
    index = {ref: i for i, ref in enumerate(refs)}
    values: dict[int, Any] = {}
    pending = list(refs)
    raised: tuple[int, BaseException] | None = None
    while pending and raised is None:
        left = deadline - time.monotonic()
        if left <= 0:
            late = [members[index[r]].where() for r in pending]
            raise on_fail(f"{', '.join(late)} did not answer {what} within {timeout:.0f} s (hung, or its node is gone)")
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                values[index[ref]] = ray.get(ref, timeout=max(timeouts.ready_fetch_s, deadline - time.monotonic()))
            except ray.exceptions.RayActorError as e:  # the actor died (killed, OOM, its node lost)
                raise on_fail(f"{members[index[ref]].where()} died during {what}: {_last_line(e)}") from None
            except Exception as e:  # noqa: BLE001 - the call raised inside the actor: look for a dead peer first
                raised = (index[ref], e)
                break
    if raised is not None:
        i, err = raised
        cause = getattr(err, "cause", None)
        if passthrough and isinstance(cause, passthrough):
            raise cause
        if pending:  # a peer that died is the cause: give its death a moment to show
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=min(timeouts.death_grace_s, timeout))
            for ref in ready:
                try:
                    ray.get(ref, timeout=timeouts.ready_fetch_s)
                except ray.exceptions.RayActorError as e:
                    raise on_fail(f"{members[index[ref]].where()} died during {what}: {_last_line(e)}; "
                                  f"{members[i].where()} failed after it: {_last_line(err)}") from None
                except Exception:  # noqa: BLE001 - another effect; the first error is reported
                    pass
        raise on_fail(f"{members[i].where()} failed during {what}:\n{err}")
    return [values[i] for i in range(len(refs))]


def get_one(ref: Any, member: Member, what: str, timeout: float, on_fail: Callable[[str], BaseException], *,
            passthrough: tuple[type[BaseException], ...] = (), timeouts: RayTimeouts = RAY_TIMEOUTS) -> Any:
    """:func:`gather` of one call."""
    return gather([ref], [member], what, timeout, on_fail, passthrough=passthrough, timeouts=timeouts)[0]
