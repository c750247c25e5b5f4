"""The layering contract in pyproject.toml ([tool.importlinter]) holds, and it has teeth."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_layering_contracts_are_kept():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout
    kept = [ln for ln in r.stdout.splitlines() if ln.endswith(" KEPT")]
    assert len(kept) == 6, r.stdout


def test_an_arrow_from_the_inference_side_to_the_trainer_side_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "r3lab", tmp_path / "r3lab", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    init = tmp_path / "r3lab" / "rollout" / "__init__.py"
    init.write_text(init.read_text() + "\nimport r3lab.replay  # noqa\n")
    r = _lint(tmp_path)
    assert r.returncode != 0, r.stdout
    assert "BROKEN" in r.stdout and "r3lab.rollout" in r.stdout and "r3lab.replay" in r.stdout, r.stdout


def test_ruff_is_clean():
    """The style rules in pyproject.toml (line length 120 included) hold over the whole tree."""
    ruff = Path(sys.executable).parent / "ruff"
    r = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
