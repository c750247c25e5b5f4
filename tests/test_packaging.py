"""r3lab as a user installs it: a wheel in a fresh virtual environment, run outside the checkout."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv holding only the r3lab wheel; its dependencies come from this environment's site-packages."""
    tmp = tmp_path_factory.mktemp("wheel")
    run = dict(check=True, capture_output=True, text=True, timeout=600)
    src = tmp / "src"  # a clean copy: an in-tree build/ folder could carry modules deleted since
    shutil.copytree(ROOT / "r3lab", src / "r3lab", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp), str(src)],
        **run,
    )
    (wheel,) = tmp.glob("r3lab-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], **run)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], **run)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], **run).stdout
    # dependencies only: a path line in a .pth adds the folder but runs none of its .pth files (no editable finder)
    (Path(site.strip()) / "_r3lab_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "R3LAB_DATA", "VIRTUAL_ENV")}
    return venv, work, env


#: what installing r3lab must never bring by itself: only an extra may (canonical names, or their beginnings)
HEAVY = ("torch", "vllm", "megatron", "mbridge", "transformer-engine", "ray", "jupyter", "notebook", "ipykernel",
         "ipywidgets", "nvidia-")


def test_the_wheel_metadata_keeps_torch_and_the_engines_in_extras(installed):
    """The built wheel's core requirements are pyproject's, none of them heavy; each extra is declared; the wheel
    ships py.typed and the console script, and nothing of the checkout but the package."""
    (wheel,) = installed[0].parent.glob("r3lab-*.whl")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        meta = email.message_from_bytes(z.read(f"{info}/METADATA"))
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist", [])]
    core = {str(r) for r in requires if r.marker is None}
    assert core == {str(Requirement(d)) for d in project["dependencies"]}
    heavy = sorted(n for n in (canonicalize_name(r.name) for r in requires if r.marker is None) if n.startswith(HEAVY))
    assert heavy == [], f"core requirements that belong in an extra: {heavy}"
    assert set(meta.get_all("Provides-Extra", [])) == set(project["optional-dependencies"])
    replay = {canonicalize_name(r.name) for r in requires if r.marker and r.marker.evaluate({"extra": "replay"})}
    assert "torch" in replay and "transformers" in replay
    assert "r3lab/py.typed" in names and "r3lab = r3lab.cli:main" in entry_points
    assert sorted({n.split("/")[0] for n in names}) == ["r3lab", info]


def _run(installed, *args, timeout=900):
    venv, work, env = installed
    return subprocess.run(list(args), cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def test_import_comes_from_the_wheel(installed):
    venv = installed[0]
    r = _run(
        installed,
        str(venv / "bin" / "python"),
        "-c",
        "import r3lab, sys; print(r3lab.__file__); "
        "print('vllm' in sys.modules); print(r3lab.rollout.RolloutEngine.__module__)",
    )
    assert r.returncode == 0, r.stderr
    path, vllm_loaded, engine_module = r.stdout.split()
    assert Path(path).is_relative_to(venv) and not Path(path).is_relative_to(ROOT / "r3lab"), path
    assert vllm_loaded == "False" and engine_module.startswith("r3lab.rollout")


def test_console_script_and_missing_checkout_messages(installed):
    venv = installed[0]
    r = _run(installed, str(venv / "bin" / "r3lab"), "--help")
    assert r.returncode == 0 and "drift" in r.stdout and "bench" in r.stdout, r.stdout + r.stderr
    r = _run(installed, str(venv / "bin" / "r3lab"), "bench", "transport", "--quick")
    assert r.returncode != 0 and "needs a source checkout" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = _run(installed, str(venv / "bin" / "python"), "-m", "r3lab", "drift", "--quick")
    assert r.returncode != 0 and "--data" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_python_m_r3lab_runs_the_drift_experiment_from_the_wheel(installed):
    venv, work, _ = installed
    runs = work / "runs-here"
    args = ["-m", "r3lab", "--quick", "--models", "tiny-qwen3-moe", "--data", str(ROOT / "data"), "--runs", str(runs),
            "--no-progress"]
    r = _run(installed, str(venv / "bin" / "python"), *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| tiny-qwen3-moe |")]
    assert len(rows) == 4, r.stdout  # bf16 and fp32 trainers: the spread over seeds, and every cell
    (run,) = runs.iterdir()  # the run went where it was told, not into the checkout
    assert (run / "summary.json").is_file() and (run / "steps.jsonl").read_text().count("\n") == 2
    info = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("INFO")]
    assert not info, info[:5]  # vLLM logs at WARNING unless the user asks for more
