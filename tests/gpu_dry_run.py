"""pip's dry runs of the two GPU environments, started in the background as soon as pytest knows it will run
test_gpu_recipe.py (``conftest.pytest_collection_finish``): each resolution is network-bound (index pages and range
reads, one to three minutes here), so the two overlap each other and the CPU-bound tests instead of adding to the
suite's time. A test that needs one waits for it (:func:`result`); nothing else changes in what is checked.

Under pytest-xdist every worker collects every test, so every worker would start both dry runs (four pip processes,
about 15 s of CPU each, for two results). The workers of one run (``PYTEST_XDIST_TESTRUNUID``) share one folder per
dry run instead: the worker that creates it starts pip there, and :func:`result` in any worker waits for the exit
status that pip's wrapper writes beside the report when it ends.

Both environments are Python 3.12 (megatron-core 0.19 and Megatron-Bridge 0.6 require it), so pip resolves them for a
Python 3.12 interpreter: this one when it is 3.12, else one found on this machine (:func:`python312`), run by this
interpreter's pip (``pip --python``: the metadata-only range reads of ``fast-deps`` need a recent pip). Where none is
found the tests that need a resolution skip, saying so.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the two GPU environments and their requirement files
ENVS = {"engine": ROOT / "requirements-gpu-engine.txt", "trainer": ROOT / "requirements-gpu-trainer.txt"}
PYTHON = (3, 12)
TIMEOUT = 900  # s, from the start; each 2 to 3 minutes here, both at once; 10 under a load of 80 on 2 cores

_started: dict[tuple[str, ...], tuple[Path, float, list[str], subprocess.Popen | None]] = {}


@cache
def python312() -> str | None:
    """An interpreter of the GPU environments' Python (3.12): this one, else python3.12 on PATH or pyenv's."""
    if sys.version_info[:2] == PYTHON:
        return sys.executable
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for cand in [shutil.which("python3.12"), *sorted(glob.glob(f"{root}/versions/3.12*/bin/python3.12"))]:
        if not cand:
            continue
        try:
            ok = subprocess.run([cand, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return cand
    return None


def command(report: Path, *args: str) -> list[str]:
    """``pip install --dry-run`` of ``args`` for Python 3.12, metadata only, its report written to ``report``."""
    target = python312()
    if target is None:
        raise RuntimeError(f"no Python {PYTHON[0]}.{PYTHON[1]} interpreter on this machine")
    pip = [sys.executable, "-m", "pip"] + ([] if target == sys.executable else ["--python", target])
    return [*pip, "install", "--dry-run", "--ignore-installed", "--isolated", "--use-feature=fast-deps",
            "--progress-bar=off", "-v", "--report", str(report), *args]


def _folder(args: tuple[str, ...]) -> tuple[Path, bool]:
    """The scratch folder of the dry run of ``args``, and whether the workers of this run share it: under xdist one
    per run and arguments, shared (the worker that creates it runs pip); otherwise a new one of this process's own."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return Path(tempfile.mkdtemp(prefix="r3lab-gpu-dry-run-")), False
    key = hashlib.sha256("\0".join(args).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"r3lab-gpu-dry-run-{run}-{key}", True


def start(*args: str) -> None:
    """Start ``pip install --dry-run ARGS`` in a scratch folder (once per ARGS and run; nothing without a 3.12
    interpreter). pip runs under ``sh``, which writes its exit status to ``rc`` in that folder when it ends."""
    if args in _started or python312() is None:
        return
    folder, shared = _folder(args)
    cmd = command(folder / "report.json", *args)
    try:
        folder.mkdir(exist_ok=not shared)  # a folder of its own exists already (mkdtemp made it)
    except FileExistsError:  # another worker of this run started it: wait for its rc in result()
        _started[args] = (folder, time.monotonic(), cmd, None)
        return
    wrapper = 'cd "$1" && shift && "$@" > pip.log 2>&1; echo $? > rc.part && mv rc.part rc'
    proc = subprocess.Popen(["sh", "-c", wrapper, "sh", str(folder), *cmd], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _started[args] = (folder, time.monotonic(), cmd, proc)


def start_all() -> None:
    """Start the dry runs of both environments."""
    for env in ENVS:
        start(*requirements_args(env))


def result(*args: str) -> tuple[dict, str]:
    """The report and log of the dry run of ``ARGS`` (started now if it was not), waiting for it to end (its ``rc``
    file: the dry run may belong to another worker)."""
    start(*args)
    if args not in _started:
        raise RuntimeError(f"no Python {PYTHON[0]}.{PYTHON[1]} interpreter on this machine to resolve for")
    folder, t0, cmd, proc = _started[args]
    rc = folder / "rc"
    while not rc.exists():
        if time.monotonic() - t0 > TIMEOUT:
            if proc is not None:
                os.killpg(proc.pid, signal.SIGKILL)  # sh and pip
            raise AssertionError(f"pip's dry run took over {TIMEOUT} s: {' '.join(cmd)} (in {folder})")
        time.sleep(1.0)
    if proc is not None:
        proc.wait()
    log = (folder / "pip.log").read_text()
    code = rc.read_text().strip()
    assert code == "0", f"pip cannot resolve {' '.join(args)} (exit status {code}):\n{log[-6000:]}"
    return json.loads((folder / "report.json").read_text()), log


def requirements_args(env: str) -> tuple[str, ...]:
    """pip's arguments for environment ``env`` (a key of :data:`ENVS`)."""
    return ("-r", str(ENVS[env]))
