"""r3lab.rollout.logs: vLLM's known start-up warnings are hidden behind one line per process; others still show.

The messages below are vLLM 0.30's own texts (vllm/v1/worker/cpu_worker.py, vllm/triton_utils/importing.py),
logged through a real logging handler into a buffer.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from r3lab.rollout import logs

ROOT = Path(__file__).resolve().parent.parent
KNOWN = ["libtcmalloc is not found in LD_PRELOAD. For best performance, please follow the section ...",
         "libiomp is not found in LD_PRELOAD. For best performance, please follow the section ...",
         "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.",
         "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.",
         "Node 1 is not in available memory nodes [0].",
         # as logged by an in-process engine start here (vLLM 0.30, CPU)
         "Triton is installed, but `triton.backends` could not be imported. Disabling Triton.",
         "The global random seed is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, this may affect "
         "the random state of the Python process that launched vLLM.",
         "Enforce eager set, disabling torch.compile and CUDAGraphs. This is equivalent to setting -cc.mode=none "
         "-cc.cudagraph_mode=none",
         "Inductor compilation was disabled by user settings, optimizations settings that are only active during "
         "inductor compilation will be ignored.",
         "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'.",
         "Model Runner V2 requires Triton; using the V1 model runner instead.",
         "Failed to import the DeepSelect extension (vllm._deepselect_C): No module named 'vllm._deepselect_C'"]


@pytest.fixture
def logged(monkeypatch):
    monkeypatch.setattr(logs.KnownNoise, "said", False)
    monkeypatch.delenv(logs.SHOW_ENV, raising=False)
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.addFilter(logs.KnownNoise())
    log = logging.getLogger("r3lab-test-vllm")
    log.addHandler(handler)
    log.propagate = False
    yield log, buf
    log.removeHandler(handler)


def test_known_warnings_collapse_into_one_line_and_unknown_ones_show(logged):
    log, buf = logged
    for msg in KNOWN:
        log.warning(msg)
    log.warning("Something new went wrong: %s", "check it")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("r3lab: hiding vLLM's known, benign start-up warnings") and logs.SHOW_ENV in lines[0]
    assert lines[1] == "Something new went wrong: check it"


def test_every_warning_shows_when_asked(logged, monkeypatch):
    log, buf = logged
    monkeypatch.setenv(logs.SHOW_ENV, "all")
    for msg in KNOWN:
        log.warning(msg)
    assert buf.getvalue().splitlines() == KNOWN


def test_engine_processes_get_the_filter_and_stderr_through_vllms_config_variable(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    with logs.quiet_vllm_logs():
        path = os.environ["VLLM_LOGGING_CONFIG_PATH"]
        config = json.loads(Path(path).read_text())
        # what a spawned engine process does with it: dictConfig, then vLLM's warnings
        code = ("import json, logging, logging.config, sys; logging.config.dictConfig(json.load(open(sys.argv[1])));"
                "log = logging.getLogger('vllm.v1.worker.cpu_worker');"
                f"[log.warning(m) for m in {KNOWN!r}]; log.warning('an unknown warning'); print('result')")
        cfg = {**config, "formatters": {"vllm": {"format": "%(message)s"}}}  # vLLM's formatter needs vLLM
        Path(path + ".plain").write_text(json.dumps(cfg))
        p = subprocess.run([sys.executable, "-c", code, path + ".plain"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
        Path(path + ".plain").unlink()
    assert "VLLM_LOGGING_CONFIG_PATH" not in os.environ  # restored after the block
    assert p.returncode == 0, p.stderr
    assert p.stdout == "result\n"  # logs never on stdout
    err = p.stderr.splitlines()
    assert len(err) == 2 and err[0].startswith("r3lab: hiding") and err[1] == "an unknown warning", err
    assert config["loggers"]["vllm"]["level"] == "WARNING"


def test_a_users_own_logging_config_is_left_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "mine.json"))
    with logs.quiet_vllm_logs():
        assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(tmp_path / "mine.json")
