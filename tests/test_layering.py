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
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {contracts} kept, 0 broken." in r.stdout, r.stdout  # every contract checked and kept


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package with ``line`` appended to ``module`` (a path under r3lab/)."""
    shutil.copytree(ROOT / "r3lab", tmp_path / "r3lab", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    f = tmp_path / "r3lab" / module
    f.write_text(f.read_text() + f"\n{line}  # noqa\n")
    return tmp_path


def _broken(stdout: str) -> list[str]:
    """The names of the broken contracts in lint-imports' report."""
    names, current = [], []
    for ln in stdout.splitlines():
        current.append(ln.strip())
        if ln.endswith(("KEPT", "BROKEN")) or " KEPT (" in ln or " BROKEN (" in ln:
            if "BROKEN" in ln:
                names.append(" ".join(current))
            current = []
    return names


def test_an_arrow_from_the_inference_side_to_the_trainer_side_breaks_the_contract(tmp_path):
    r = _lint(_copy_with(tmp_path, "rollout/__init__.py", "import r3lab.replay"))
    assert r.returncode != 0, r.stdout
    assert "BROKEN" in r.stdout and "r3lab.rollout" in r.stdout and "r3lab.replay" in r.stdout, r.stdout


def test_product_code_importing_the_test_helpers_breaks_the_testing_contract(tmp_path):
    """An experiment importing r3lab.testing breaks exactly that contract; the layers allow the arrow (testing sits
    below experiments), so only the forbidden contract catches it."""
    r = _lint(_copy_with(tmp_path, "experiments/drift.py", "from r3lab.testing import random_routes"))
    assert r.returncode != 0, r.stdout
    (broken,) = _broken(r.stdout)
    assert "nothing but r3lab.testing imports" in broken, r.stdout
    assert "r3lab.experiments.drift -> r3lab.testing" in r.stdout, r.stdout


def test_a_trainer_importing_an_experiment_breaks_the_layers(tmp_path):
    """Trainers sit below experiments: the arrow back up breaks the layers contract."""
    r = _lint(_copy_with(tmp_path, "trainers/base.py", "import r3lab.experiments"))
    assert r.returncode != 0, r.stdout
    (broken,) = _broken(r.stdout)
    assert "The pipeline flows one way" in broken, r.stdout


def test_ruff_is_clean():
    """The style rules in pyproject.toml (line length 120 included) hold over the whole tree."""
    ruff = Path(sys.executable).parent / "ruff"
    r = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_every_benchmark_script_is_an_r3lab_bench_name():
    """`r3lab bench NAME` reaches every bench/bench_NAME.py (a new benchmark cannot be left out of the command)."""
    from r3lab.cli import BENCHMARKS

    bench = Path(__file__).resolve().parents[1] / "bench"
    scripts = {p.stem.removeprefix("bench_") for p in bench.glob("bench_*.py")}
    assert scripts == set(BENCHMARKS), (sorted(scripts - set(BENCHMARKS)), sorted(set(BENCHMARKS) - scripts))
