"""Another process that keeps taking TCP ports the moment they are free, for the tests that prove r3lab never loses a
port it chose (what broke a fresh-clone CI run once: a rank's rendezvous port, found free and let go, was taken)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from typing import Any


def grab_freed_ports(stop: Any, grabbed: Any) -> None:
    """Until ``stop`` is set: bind and listen on a port the OS hands out (the port a free_port() caller would have been
    told), every 2 ms, holding the last 64; ``grabbed`` counts them."""
    import socket
    import time

    held = []
    while not stop.is_set():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        held.append(s)
        grabbed.value += 1
        if len(held) > 64:
            held.pop(0).close()
        time.sleep(0.002)
    for s in held:
        s.close()


@contextlib.contextmanager
def grabbing_ports() -> Iterator[Any]:
    """A :func:`grab_freed_ports` process for the block; yields its counter (``.value``: ports taken so far)."""
    ctx = multiprocessing.get_context("spawn")
    stop, grabbed = ctx.Event(), ctx.Value("i", 0)
    grabber = ctx.Process(target=grab_freed_ports, args=(stop, grabbed), daemon=True)
    grabber.start()
    try:
        yield grabbed
    finally:
        stop.set()
        grabber.join(10)
