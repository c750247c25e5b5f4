"""pip's dry run of the GPU recipe, started in the background as soon as pytest knows it will run
test_gpu_recipe.py (``conftest.pytest_collection_finish``): the resolution is network-bound (index pages and
range reads, one to three minutes here), so it overlaps the CPU-bound tests instead of adding to the suite's time.
A test that needs it waits for it (:func:`result`); nothing else changes in what is checked."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REQ = Path(__file__).resolve().parents[1] / "requirements-gpu.txt"
TIMEOUT = 600  # s, from the start; measured 41 s on a quiet machine, 3.7 min before the metadata-only switches

_started: dict[tuple[str, ...], tuple[subprocess.Popen, Path, float, list[str]]] = {}


def command(report: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--isolated",
            "--use-feature=fast-deps", "--progress-bar=off", "-v", "--report", str(report), *args]


def start(*args: str) -> None:
    """Start ``pip install --dry-run ARGS`` in a scratch folder (once per ARGS)."""
    if args in _started:
        return
    folder = Path(tempfile.mkdtemp(prefix="r3lab-gpu-dry-run-"))
    cmd = command(folder / "report.json", *args)
    log = open(folder / "pip.log", "w")  # noqa: SIM115 - closed when the result is read
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=folder)
    _started[args] = (proc, folder, time.monotonic(), cmd)


def result(*args: str) -> tuple[dict, str]:
    """The report and log of the dry run of ``ARGS`` (started now if it was not), waiting for it to end."""
    start(*args)
    proc, folder, t0, cmd = _started[args]
    try:
        proc.wait(timeout=max(1.0, TIMEOUT - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired as e:
        proc.kill()
        raise AssertionError(f"pip's dry run took over {TIMEOUT} s: {' '.join(cmd)}") from e
    log = (folder / "pip.log").read_text()
    assert proc.returncode == 0, f"pip cannot resolve {' '.join(args)}:\n{log[-6000:]}"
    return json.loads((folder / "report.json").read_text()), log


def requirements_args() -> tuple[str, ...]:
    return ("-r", str(REQ))
