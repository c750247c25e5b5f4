"""Process plumbing shared by the engine, the server client and the Megatron-on-CPU harness.

Private and stage-neutral (it imports nothing from r3lab), so both sides of the pipeline may use it
without importing each other.
"""

from __future__ import annotations

import socket
from typing import Any, Self

__all__ = ["Closing", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` (loopback by default) at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
