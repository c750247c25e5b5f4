"""Process plumbing shared by the engine, the server client, the widgets' jobs and the Megatron-on-CPU harness.

Private and stage-neutral (it imports nothing from r3lab), so both sides of the pipeline may use it
without importing each other.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
from typing import Any, Self

__all__ = ["Closing", "free_port", "end_process_group"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` (loopback by default) at the time of the call.

    Only for a port another process must bind itself (a server subprocess): it may be taken before that process
    binds it, so the caller detects that (:func:`port_in_use`) and chooses again. A port this process listens on
    itself is bound to port 0 and kept, never found free and let go."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether a socket holds TCP ``host:port`` now: one listening there, or bound there without address reuse.

    A bind with ``SO_REUSEADDR`` (as servers bind) is tried and undone; connections closing on the port
    (``TIME_WAIT``) do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
        return False


class Closing:
    """``with obj: ...`` calls ``obj.close()`` on the way out, also on exceptions.

    Subclasses implement ``close()`` and make it idempotent (safe to call twice, and after a failed start).
    """

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def end_process_group(proc: subprocess.Popen[Any], *, grace_s: float = 10.0, kill_wait_s: float = 10.0) -> int | None:
    """End the process group that ``proc`` leads (started with ``start_new_session=True``), its children too.

    SIGTERM to the group, then SIGKILL if ``proc`` has not exited after ``grace_s`` seconds; returns its exit
    code, or None if it still runs ``kill_wait_s`` seconds after the SIGKILL. A process that has already
    exited is only reaped; a group that is already gone is not an error.
    """
    if proc.poll() is not None:
        return proc.returncode
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the group is gone: reap the leader below
        try:
            return proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
    try:
        return proc.wait(kill_wait_s)
    except subprocess.TimeoutExpired:
        return None
