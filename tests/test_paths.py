"""Where r3lab reads data and writes runs and figures: a source checkout as always; an installed package (the package
in site-packages) never beside itself, but in the folder named by --data / R3LAB_DATA, else the working directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from r3lab import paths

ROOT = Path(__file__).resolve().parent.parent

#: prints where each default points, as JSON, from the r3lab the child process imports
REPORT = """
import json, sys
from r3lab import paths
from r3lab.errors import R3LabError
def attempt(fn, *args):
    try:
        return str(fn(*args))
    except R3LabError as e:
        return 'error: ' + str(e)
print(json.dumps({
    "package": paths.__file__,
    "checkout": attempt(paths.checkout),
    "data": attempt(paths.data_dir),
    "runs": attempt(paths.runs_dir),
    "figures": attempt(paths.figures_dir),
    "results": attempt(paths.results_dir),
    "bench": attempt(paths.bench_script, "transport"),
}))
"""


def _report(package_parent: Path, cwd: Path, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "R3LAB_DATA", "R3LAB_RUNS")}
    r = subprocess.run([sys.executable, "-c", REPORT], cwd=cwd, capture_output=True, text=True, timeout=120,
                       env={**base, "PYTHONPATH": str(package_parent), **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def site_packages(tmp_path_factory) -> Path:
    """A site-packages-like folder holding a copy of the package and, as other distributions leave there, a
    ``data/models`` and a ``bench/`` folder (which a checkout would have): none of them may be taken for r3lab's."""
    site = tmp_path_factory.mktemp("venv") / "lib" / "python3" / "site-packages"
    shutil.copytree(ROOT / "r3lab", site / "r3lab", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "data" / "models").mkdir(parents=True)
    (site / "bench" / "results").mkdir(parents=True)
    (site / "bench" / "bench_transport.py").write_text('"""not r3lab\'s"""\n')
    return site


@pytest.fixture
def workdir(tmp_path) -> Path:
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


def test_an_installed_package_writes_into_the_working_directory_never_site_packages(site_packages, workdir):
    got = _report(site_packages, workdir)
    assert Path(got["package"]).parent == site_packages / "r3lab"  # the copy, not this checkout
    assert got["checkout"] == "None"
    assert Path(got["runs"]) == Path("runs") and Path(got["figures"]) == Path("figures")  # relative: the cwd's
    assert got["data"].startswith("error: ") and "--data DIR or set R3LAB_DATA" in got["data"]
    assert str(site_packages) not in got["data"]
    assert got["results"].startswith("error: ") and "installed package" in got["results"]
    assert got["bench"] == "None"
    for key in ("runs", "figures"):
        assert not (workdir / got[key]).resolve().is_relative_to(site_packages), key


def test_an_installed_package_uses_the_data_folder_it_is_given(site_packages, workdir, tmp_path):
    data = tmp_path / "my-data"
    (data / "models").mkdir(parents=True)
    got = _report(site_packages, workdir, R3LAB_DATA=str(data))
    assert Path(got["data"]) == data.resolve()
    assert Path(got["runs"]) == data.resolve() / "runs"
    assert Path(got["figures"]) == data / "figures"
    got = _report(site_packages, workdir, R3LAB_DATA=str(data), R3LAB_RUNS=str(tmp_path / "elsewhere"))
    assert Path(got["runs"]) == tmp_path / "elsewhere"


def test_a_source_checkout_keeps_its_own_folders(workdir):
    got = _report(ROOT, workdir)
    assert Path(got["package"]).parent == ROOT / "r3lab"
    assert Path(got["checkout"]) == ROOT
    assert Path(got["data"]) == ROOT / "data"
    assert Path(got["runs"]) == ROOT / "data" / "runs"
    assert Path(got["figures"]) == ROOT / "docs" / "figures"
    assert Path(got["results"]) == ROOT / "bench" / "results"
    assert Path(got["bench"]) == ROOT / "bench" / "bench_transport.py"


def test_a_folder_is_a_checkout_only_with_pyproject_and_data_or_git(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "PACKAGE_PARENT", tmp_path)
    assert paths.checkout() is None
    (tmp_path / "data").mkdir()
    assert paths.checkout() is None  # data/ alone: a site-packages may hold one
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'r3lab'\n")
    assert paths.checkout() == tmp_path
    (tmp_path / "data").rmdir()
    assert paths.checkout() is None  # an unpacked sdist: no data, no history
    (tmp_path / ".git").mkdir()
    assert paths.checkout() == tmp_path


def test_figures_and_runs_take_an_explicit_folder_first(tmp_path):
    assert paths.figures_dir(tmp_path / "f") == tmp_path / "f"
    assert paths.runs_dir(tmp_path / "r") == tmp_path / "r"
