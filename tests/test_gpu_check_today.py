"""scripts/gpu_check_today.py, the GPU machine's check, runs here as its CPU dry run: every step, tiny shapes.

Steps that need what this environment lacks are skips with their reason, never passes: the wheels folder (step a;
its own network-tier test fetches the carried wheels and installs them for the GPU image's Python), and
Megatron-Bridge where it is not installed (Python 3.11). On a machine without CUDA the real check refuses to start
(exit 2, a message); a wheels folder that lacks a carried wheel fails step a (exit 1) with the wheel named.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check_today.py"


def _run(*args: str, timeout: float = 600, cuda_hidden: bool = True) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if cuda_hidden:
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch sees no GPU, on a GPU machine too
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


def _rows(text: str) -> list[tuple[str, str, str, str]]:
    """The check table's rows (step, check, result, detail)."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] in ("a", "b", "c", "d"):
            out.append(tuple(cells))
    return out


def test_cpu_dry_run_runs_every_step(tmp_path):
    from r3lab.trainers.megatron import megatron_bridge_api as mb

    out = tmp_path / "check.md"
    code, log = _run("--cpu-dry-run", "--out", str(out))
    assert code == 0, log[-4000:]
    text = out.read_text()
    assert text.startswith("# gpu_check_today on CPU dry run") and "Checks: all passed." in text
    rows = _rows(text)
    by_step = {s: [r for r in rows if r[0] == s] for s in "abcd"}
    assert [r[2] for r in by_step["a"]] == ["skip"] and "no --wheels" in by_step["a"][0][3]
    if mb.installed_version() is None:
        assert [r[2] for r in by_step["b"]] == ["skip"] and "not installed" in by_step["b"][0][3]
    else:  # the Python 3.12 workbench: Megatron-Bridge built the model and matched transformers
        assert [r[2] for r in by_step["b"]] == ["info", "ok"], by_step["b"]
        assert "max /dlogits/" in by_step["b"][1][3]
    checks = {r[1]: r[2] for r in by_step["c"]}
    assert checks["tiny-qwen3-moe: R3 with the device-decoded ids: bit-identical logits"] == "ok"
    assert checks["tiny-qwen3-moe: R3W (ids + weights, stop): bit-identical logits"] == "ok"
    assert checks["tiny-qwen3-moe: R3W other weights reach every router exactly and move the logits"] == "ok"
    decoded = [r for r in by_step["d"] if r[2] != "info"]
    assert [r[1].split(":")[0] for r in decoded] == ["raw", "bitpack"]
    assert all(r[2] == "ok" and "not a GPU number" in r[3] for r in decoded)
    assert "NOT a GPU measurement" in text  # the benchmark's own table says where it ran
    assert not [r for r in rows if r[2] == "FAIL"]


def test_refuses_a_machine_without_cuda_with_a_message():
    code, log = _run("--steps", "d")
    assert code == 2, log
    assert "no CUDA device" in log and "--cpu-dry-run" in log and "Traceback" not in log


def test_a_wheels_folder_without_the_carried_wheels_fails_step_a(tmp_path):
    (tmp_path / "wheels").mkdir()
    code, log = _run("--cpu-dry-run", "--steps", "a", "--wheels", str(tmp_path / "wheels"), "--target",
                     str(tmp_path / "site"))
    assert code == 1, log
    (row,) = [r for r in _rows(log) if r[0] == "a"]
    assert row[2] == "FAIL" and "megatron-core 0.19.2: found none" in row[3] and "--fetch-wheels" in row[3]
    assert "Checks: FAILED: a " in log


@pytest.mark.network
def test_carried_wheels_install_for_the_gpu_image(request, tmp_path):
    """The wheels the GPU machine gets (pip download for its Python 3.12 and platform) fit the carry limit and
    install with pip --no-index --no-deps into a target folder, for the image's interpreter whatever runs the test."""
    cache = getattr(request.config, "cache", None)
    wheels = Path(cache.mkdir("gpu-check-wheels")) if cache is not None else tmp_path / "wheels"
    code, log = _run("--fetch-wheels", str(wheels), timeout=300)
    assert code == 0, log[-3000:]
    size = sum(w.stat().st_size for w in wheels.glob("*.whl"))
    assert size < 16 * 2**20, f"{size / 2**20:.1f} MiB of wheels: the GPU machine takes 64 MiB with the tree"
    code, log = _run("--cpu-dry-run", "--steps", "a", "--wheels", str(wheels), "--target", str(tmp_path / "site"))
    assert code == 0, log[-3000:]
    rows = [r for r in _rows(log) if r[0] == "a"]
    assert rows and all(r[2] == "ok" for r in rows), rows
    assert (tmp_path / "site" / "megatron_bridge-0.6.2.dist-info").is_dir()
    assert (tmp_path / "site" / "megatron_core-0.19.2.dist-info").is_dir()
