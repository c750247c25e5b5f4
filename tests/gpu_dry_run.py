"""pip's dry runs of the two GPU environments, started in the background as soon as pytest knows it will run
test_gpu_recipe.py (``conftest.pytest_collection_finish``): each resolution is network-bound (index pages and range
reads, one to three minutes here), so the two overlap each other and the CPU-bound tests instead of adding to the
suite's time. A test that needs one waits for it (:func:`result`); nothing else changes in what is checked.

Both environments are Python 3.12 (megatron-core 0.19 and Megatron-Bridge 0.6 require it), so pip resolves them for a
Python 3.12 interpreter: this one when it is 3.12, else one found on this machine (:func:`python312`), run by this
interpreter's pip (``pip --python``: the metadata-only range reads of ``fast-deps`` need a recent pip). Where none is
found the tests that need a resolution skip, saying so.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
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

_started: dict[tuple[str, ...], tuple[subprocess.Popen, Path, float, list[str]]] = {}


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


def start(*args: str) -> None:
    """Start ``pip install --dry-run ARGS`` in a scratch folder (once per ARGS; nothing without a 3.12 interpreter)."""
    if args in _started or python312() is None:
        return
    folder = Path(tempfile.mkdtemp(prefix="r3lab-gpu-dry-run-"))
    cmd = command(folder / "report.json", *args)
    log = open(folder / "pip.log", "w")  # noqa: SIM115 - closed when the result is read
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=folder)
    _started[args] = (proc, folder, time.monotonic(), cmd)


def start_all() -> None:
    """Start the dry runs of both environments."""
    for env in ENVS:
        start(*requirements_args(env))


def result(*args: str) -> tuple[dict, str]:
    """The report and log of the dry run of ``ARGS`` (started now if it was not), waiting for it to end."""
    start(*args)
    if args not in _started:
        raise RuntimeError(f"no Python {PYTHON[0]}.{PYTHON[1]} interpreter on this machine to resolve for")
    proc, folder, t0, cmd = _started[args]
    try:
        proc.wait(timeout=max(1.0, TIMEOUT - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired as e:
        proc.kill()
        raise AssertionError(f"pip's dry run took over {TIMEOUT} s: {' '.join(cmd)}") from e
    log = (folder / "pip.log").read_text()
    assert proc.returncode == 0, f"pip cannot resolve {' '.join(args)}:\n{log[-6000:]}"
    return json.loads((folder / "report.json").read_text()), log


def requirements_args(env: str) -> tuple[str, ...]:
    """pip's arguments for environment ``env`` (a key of :data:`ENVS`)."""
    return ("-r", str(ENVS[env]))
