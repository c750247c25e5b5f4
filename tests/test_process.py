"""r3lab._process.end_process_group: the teardown the widgets' jobs and the vLLM server share."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from r3lab._process import end_process_group

# a leader with a child in its process group (as vLLM's server and its engine process); "stubborn" ignores SIGTERM
FAMILY = textwrap.dedent("""
    import signal, subprocess, sys, time
    if sys.argv[1] == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("ready", flush=True)
    time.sleep(120)
""")


def _family(kind: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", FAMILY, kind], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _group_gone(pgid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("kind", ["polite", "stubborn"])
def test_the_whole_group_ends_sigkill_after_the_grace_period(kind):
    proc = _family(kind)
    t0 = time.monotonic()
    code = end_process_group(proc, grace_s=1.0)
    took = time.monotonic() - t0
    assert code == (-15 if kind == "polite" else -9)  # SIGTERM ended it, or SIGKILL after the grace period
    assert took >= 1.0 if kind == "stubborn" else took < 1.0
    assert _group_gone(proc.pid), "a process of the group survived"
    proc.stdout.close()


def test_an_exited_process_is_only_reaped_and_a_second_call_is_harmless():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    proc.wait(30)
    assert end_process_group(proc) == 3
    assert end_process_group(proc) == 3
