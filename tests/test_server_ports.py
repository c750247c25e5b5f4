"""A server r3lab launches binds its own port (r3lab.rollout.server.launch_server): a port taken by another process
before the server binds it is chosen again once, a second loss is a ServerPortError, any other failed start is not
retried. The server here is a stand-in that starts as vLLM's does (a pause for its imports, then a bind with
SO_REUSEADDR that exits on failure, then ``/health``), so these run in seconds; the real one in tests/test_rollout.py.
"""

from __future__ import annotations

import socket
import sys
import urllib.request

import pytest
from port_grabber import grabbing_ports

from r3lab._process import end_process_group, port_in_use
from r3lab.errors import R3LabFailure, ServerPortError
from r3lab.rollout.server import launch_server
from r3lab.rollout.types import RolloutError

STAND_IN = r"""
import http.server, socket, sys, time
port, pause = int(sys.argv[1]), float(sys.argv[2])
time.sleep(pause)  # a real server's imports, before it binds: the window in which the port can be taken
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", port))  # raises (exit 1) when another process holds the port, as vLLM's bind does
sock.listen()

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Health, bind_and_activate=False)
server.socket = sock
server.serve_forever()
"""


class StandIn:
    """The command of a stand-in server; ``take`` says which launches (1, 2, ...) find their port held by another
    socket first (this test holds it, listening, until :meth:`release`)."""

    def __init__(self, take: tuple[int, ...] = (), pause: float = 0.2, exit_code: int | None = None,
                 let_go: tuple[int, ...] = ()):
        self.take, self.pause, self.exit_code, self.let_go = take, pause, exit_code, let_go
        self.ports: list[int] = []
        self.held: list[socket.socket] = []

    def __call__(self, port: int) -> list[str]:
        self.ports.append(port)
        if len(self.ports) in self.take:
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            self.held.append(s)
        if len(self.ports) in self.let_go:  # lost its port to a process that let it go before the exit was seen
            return [sys.executable, "-c", "import errno, os; raise OSError(errno.EADDRINUSE, "
                    "os.strerror(errno.EADDRINUSE))"]
        if self.exit_code is not None:
            return [sys.executable, "-c", f"raise SystemExit({self.exit_code})"]
        return [sys.executable, "-c", STAND_IN, str(port), str(self.pause)]

    def release(self) -> None:
        for s in self.held:
            s.close()


@pytest.fixture
def log(tmp_path):
    with open(tmp_path / "server.log", "wb") as f:
        yield f


def _health(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        return r.status


def test_port_in_use_sees_a_listener_and_a_bare_bind_and_nothing_else():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert port_in_use("127.0.0.1", port)  # bound, not listening, without address reuse
        s.listen()
        assert port_in_use("127.0.0.1", port)
    assert not port_in_use("127.0.0.1", port)


def test_a_port_taken_before_the_server_binds_it_is_chosen_again_once(log, tmp_path):
    command = StandIn(take=(1,))
    try:
        proc, port = launch_server(command, host="127.0.0.1", port=None, timeout=60, log=log, what="stand-in")
        try:
            assert command.ports == [command.ports[0], port] and port != command.ports[0]
            assert _health(port) == 200
        finally:
            end_process_group(proc, grace_s=5)
    finally:
        command.release()
    assert f"r3lab: port {command.ports[0]} was taken by another process" in (tmp_path / "server.log").read_text()


def test_a_port_lost_to_a_process_that_let_it_go_again_is_chosen_again_once(tmp_path):
    """The port-taker held the port only while the server tried to bind it (the grabber of the last test, on a busy
    machine): the port is free when the exit is seen, so what the launch logged (Python's "Address already in use")
    says the bind was lost. A log the launch cannot read, with no log_tail, leaves a plain start failure."""
    command = StandIn(let_go=(1,))
    with open(tmp_path / "readable.log", "w+b") as log:
        proc, port = launch_server(command, host="127.0.0.1", port=None, timeout=60, log=log, what="stand-in")
        try:
            assert len(command.ports) == 2 and port == command.ports[1] and _health(port) == 200
        finally:
            end_process_group(proc, grace_s=5)
    text = (tmp_path / "readable.log").read_text()
    assert "Address already in use" in text and f"r3lab: port {command.ports[0]} was taken" in text
    with open(tmp_path / "write-only.log", "wb") as log, pytest.raises(RolloutError, match="exited with code 1"):
        launch_server(StandIn(let_go=(1,)), host="127.0.0.1", port=None, timeout=60, log=log, what="stand-in")
    once = StandIn(let_go=(1, 2))  # a second loss after the relaunch: the tail since the relaunch says so again
    with open(tmp_path / "twice.log", "w+b") as log, pytest.raises(ServerPortError, match="took port"):
        launch_server(once, host="127.0.0.1", port=None, timeout=60, log=log, what="stand-in")


def test_a_port_lost_twice_is_a_server_port_error(log):
    command = StandIn(take=(1, 2))
    try:
        with pytest.raises(ServerPortError) as e:
            launch_server(command, host="127.0.0.1", port=None, timeout=60, log=log, log_tail=lambda: "the tail",
                          what="stand-in")
    finally:
        command.release()
    first, second = command.ports
    assert f"took port {first}, then port {second}" in str(e.value) and str(e.value).endswith("the tail")
    assert isinstance(e.value, R3LabFailure) and not isinstance(e.value, ValueError)  # a failure, not bad input


def test_a_given_port_that_is_held_is_not_chosen_again(log):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        command = StandIn()
        with pytest.raises(ServerPortError, match=f"could not bind 127.0.0.1:{port}, the port given"):
            launch_server(command, host="127.0.0.1", port=port, timeout=60, log=log, what="stand-in")
    assert command.ports == [port]


def test_a_server_that_fails_otherwise_is_not_launched_again(log):
    command = StandIn(exit_code=3)
    with pytest.raises(RolloutError, match="stand-in exited with code 3 during startup") as e:
        launch_server(command, host="127.0.0.1", port=None, timeout=60, log=log, what="stand-in")
    assert not isinstance(e.value, ServerPortError) and len(command.ports) == 1


def test_servers_started_beside_a_port_grabber_all_come_up():
    import tempfile

    ports = []
    with grabbing_ports() as grabbed, tempfile.TemporaryFile() as log:
        for _ in range(8):
            proc, port = launch_server(StandIn(pause=0.3), host="127.0.0.1", port=None, timeout=60, log=log)
            try:
                assert _health(port) == 200
            finally:
                end_process_group(proc, grace_s=5)
            ports.append(port)
    assert len(set(ports)) == len(ports) and grabbed.value > 100
