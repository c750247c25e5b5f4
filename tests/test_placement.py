"""One placement step (r3lab.cluster.placement): the config says where the engine and the trainer live, one function
builds both, each placement builds its side with the config's settings, the registry takes a new placement as one
entry, no experiment branches on placement, every engine and trainer class meets its protocol (mypy, with teeth),
there is one ``load_trainer``, and the Megatron trainer takes its ranks from a transport. No engine starts here; the
one trainer loaded is the tiny transformers model."""

from __future__ import annotations

import ast
import dataclasses
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from r3lab import trainer_registry
from r3lab.cluster import (
    ENGINE,
    PLACEMENTS,
    TRAINER,
    Placement,
    PlacementSpec,
    place,
    placement_of,
    placement_spec,
    register_placement,
)
from r3lab.cluster import placement as placement_module
from r3lab.config import CaptureConfig, DriftConfig, RLConfig
from r3lab.errors import ClusterError, ConfigError
from r3lab.trainer_registry import TrainerOptions
from r3lab.trainers import TokenBatch

#: the placement step's public names: what r3lab/cluster/placement.py itself defines (its face is r3lab.cluster)
PLACEMENT_NAMES = {n for n, v in vars(placement_module).items() if not n.startswith("_")
                   and getattr(v, "__module__", placement_module.__name__) == placement_module.__name__
                   and not isinstance(v, type(placement_module))}

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "data/models/tiny-qwen3-moe"
URL = "http://gpu-node:8000"


# ---- the config says where each side lives ------------------------------------------------------------------------
def test_the_config_says_where_each_side_lives():
    one = (str(QWEN),)
    assert placement_of(DriftConfig.quick()) == Placement("local", "local")
    assert placement_of(DriftConfig.quick(models=one, engine_url=URL)) == Placement("attached", "local")
    assert placement_of(DriftConfig.quick(cluster="ray")) == Placement("ray", "ray")
    # a server samples, the trainer scores on Ray: engine_url is asked before cluster
    assert placement_of(DriftConfig.quick(models=one, engine_url=URL, cluster="ray")) == Placement("attached", "ray")
    assert placement_of(RLConfig.quick()) == Placement("local", "local")
    assert placement_of(RLConfig.quick(cluster="10.0.0.1:6379")) == Placement("ray", "ray")
    assert placement_of(CaptureConfig(model=str(QWEN))) == Placement("local", "local")  # no cluster field at all
    assert placement_of(CaptureConfig(engine_url=URL)) == Placement("attached", "local")
    assert place(DriftConfig.quick(cluster="ray"), QWEN).placement == Placement("ray", "ray")
    assert place(DriftConfig.quick(cluster="ray"), QWEN, placement=Placement()).placement == Placement()


# ---- each placement builds its side with the config's settings ----------------------------------------------------
class _Recorder:
    """Stands in for an engine or trainer class: records how it was built, counts its closes."""

    built: list[tuple[str, tuple, dict]] = []

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.closed = args, kwargs, 0
        _Recorder.built.append((type(self).__name__, args, kwargs))

    def close(self) -> None:
        self.closed += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def recorded(monkeypatch):
    """Every engine and trainer class (and ``connect``) the placements build, replaced by recorders."""
    import r3lab.cluster.engine
    import r3lab.cluster.trainer
    import r3lab.rollout

    _Recorder.built = []
    kinds = {name: type(name, (_Recorder,), {}) for name in ("RolloutEngine", "connect", "RayEngine", "RayTrainer",
                                                              "RayMegatronTrainer")}
    monkeypatch.setattr(r3lab.rollout, "RolloutEngine", kinds["RolloutEngine"])
    monkeypatch.setattr(r3lab.rollout, "connect", kinds["connect"])
    monkeypatch.setattr(r3lab.cluster.engine, "RayEngine", kinds["RayEngine"])
    monkeypatch.setattr(r3lab.cluster.trainer, "RayTrainer", kinds["RayTrainer"])
    fake = types.ModuleType("r3lab.cluster.megatron")
    fake.RayMegatronTrainer = kinds["RayMegatronTrainer"]
    monkeypatch.setitem(sys.modules, "r3lab.cluster.megatron", fake)  # no torch or Megatron import for this
    return _Recorder.built


def test_each_engine_placement_builds_with_the_configs_settings(recorded):
    opts = {"seed": 3, "engine_quant": "none"}
    place(DriftConfig.quick(), QWEN).start_engine(**opts)
    place(DriftConfig.quick(models=(str(QWEN),), engine_url=URL), QWEN).start_engine(**opts)
    ray = DriftConfig.quick(cluster="ray", engine_resources='{"GPU": 1}', cluster_timeout=42.0)
    place(ray, QWEN).start_engine(**opts)
    assert recorded == [
        ("RolloutEngine", (QWEN,), opts),
        ("connect", (URL,), {"model": QWEN}),  # the server's own seed: not r3lab's to set
        ("RayEngine", (QWEN,), {"resources": '{"GPU": 1}', "cluster": "ray", "timeout_s": 42.0, **opts}),
    ]


def test_each_trainer_placement_builds_with_the_configs_settings(recorded):
    options = TrainerOptions(dtype="bfloat16", lr=1e-3)
    cfg = RLConfig.quick(cluster="ray", trainer_resources='{"CPU": 2}', cluster_timeout=7.0)
    place(cfg, QWEN).start_trainer(options)
    mg = RLConfig.quick(trainer="megatron", tp=2, cluster="ray", trainer_resources='{"CPU": 1}')
    place(mg, QWEN).start_trainer(TrainerOptions(tp=2, lr=1e-3, megatron_loader=mg.megatron_loader))
    (name, args, kwargs), (mg_name, mg_args, mg_kwargs) = recorded
    assert (name, args, kwargs) == ("RayTrainer", ("hf", QWEN, options),
                                    {"cluster": "ray", "resources": '{"CPU": 2}', "timeout_s": 7.0})
    assert (mg_name, mg_args) == ("RayMegatronTrainer", (QWEN,))
    assert mg_kwargs == dict(tp=2, pp=1, ep=1, dp=1, dtype="float32", lr=1e-3, cluster="ray", resources='{"CPU": 1}',
                             timeout_s=300.0, megatron_loader=mg.megatron_loader)


def test_the_local_trainer_is_the_registrys_own_load():
    """The local placement's trainer scores as the registry's loader's does, bit for bit (one checkpoint, one
    batch)."""
    from r3lab.trainers.hf import HFTrainer

    batch = TokenBatch.from_ids([[5, 6, 7, 8, 9], [11, 12, 13]], [2, 1])
    options = TrainerOptions(dtype="float32")
    with place(DriftConfig.quick(), QWEN).start_trainer(options) as placed, \
            trainer_registry.load_trainer("hf", QWEN, options) as direct:
        assert isinstance(placed, HFTrainer)
        a, b = placed.score(batch, record=True), direct.score(batch, record=True)
    assert np.array_equal(a.logprobs, b.logprobs) and np.array_equal(a.routes.values, b.routes.values)


def test_the_attached_placement_refuses_what_a_server_cannot_do_before_connecting(recorded):
    cfg = DriftConfig.quick(models=(str(QWEN),), engine_url=URL)
    with pytest.raises(ConfigError, match="capture_weights needs the in-process engine") as e:
        place(cfg, QWEN).start_engine(capture_weights=True)
    assert e.value.field == "engine_url" and "--engine-url" in str(e.value)
    with pytest.raises(ConfigError, match="engine_quant='int8' applies to an engine r3lab starts"):
        place(cfg, QWEN).start_engine(engine_quant="int8")
    assert recorded == []  # refused before any connection


def test_a_given_engine_is_handed_out_open_and_a_started_one_closed(recorded):
    given = _Recorder()
    recorded.clear()
    with place(DriftConfig.quick(), QWEN, engine=given).engine(seed=0) as eng:
        assert eng is given
    assert given.closed == 0 and recorded == []  # the caller's: left open, nothing started
    with place(DriftConfig.quick(), QWEN).engine(seed=0) as eng:
        assert isinstance(eng, _Recorder) and eng is not given
    assert eng.closed == 1 and [r[0] for r in recorded] == ["RolloutEngine"]
    # a config that names a running engine (engine_url) and an engine handed in: two engines for one run
    with pytest.raises(ConfigError, match="an engine was handed in and --engine-url names the attached one too"):
        place(DriftConfig.quick(models=(str(QWEN),), engine_url=URL), QWEN, engine=given)


# ---- the registry ------------------------------------------------------------------------------------------------
def _remote_trainer(config, path, options):
    """A placement of this test: a trainer service at ``config.trainer_url`` (what a SkyRL-style remote trainer is)."""
    return ("remote", config.trainer_url, Path(path), options)


@dataclasses.dataclass(frozen=True)
class _RemoteConfig:
    trainer: str = "hf"
    trainer_url: str | None = None
    cluster: str | None = None


@pytest.fixture
def remote_placement():
    spec = register_placement(PlacementSpec(name="remote", side=TRAINER, builder=f"{__name__}:_remote_trainer",
                                            chosen_by="trainer_url", description="a trainer service"))
    try:
        yield spec
    finally:
        del PLACEMENTS[TRAINER]["remote"]


def test_a_new_placement_is_one_module_and_one_registry_entry(remote_placement):
    cfg = _RemoteConfig(trainer_url="http://trainer:9000")
    assert placement_of(cfg) == Placement("local", "remote")
    assert placement_of(_RemoteConfig()) == Placement("local", "local")
    assert place(cfg, QWEN).start_trainer(TrainerOptions(lr=0.1)) == ("remote", "http://trainer:9000", QWEN,
                                                                      TrainerOptions(lr=0.1))
    assert placement_spec(TRAINER, "remote") is remote_placement


def test_the_registry_refuses_what_it_cannot_build():
    with pytest.raises(ConfigError, match="the engine side has a placement named 'local' already"):
        register_placement(PlacementSpec(name="local", side=ENGINE, builder="m:f", description=""))
    with pytest.raises(ConfigError, match="side must be one of"):
        register_placement(PlacementSpec(name="x", side="judge", builder="m:f", description=""))
    with pytest.raises(ConfigError, match="must be 'module:function'"):
        register_placement(PlacementSpec(name="x", side=ENGINE, builder="m.f", description="", chosen_by="x"))
    with pytest.raises(ConfigError, match="has a default already"):
        register_placement(PlacementSpec(name="x", side=TRAINER, builder="m:f", description=""))
    with pytest.raises(ConfigError, match="no engine placement 'gpu-farm'; known engine placements: "
                                          r"\['local', 'attached', 'ray'\]"):
        Placement(engine="gpu-farm")
    assert list(PLACEMENTS[ENGINE]) == ["local", "attached", "ray"] and list(PLACEMENTS[TRAINER]) == ["local", "ray"]


def test_every_registered_builder_resolves_to_a_function():
    import importlib

    for side in PLACEMENTS.values():
        for spec in side.values():
            module, _, attr = spec.builder.partition(":")
            assert callable(getattr(importlib.import_module(module), attr)), spec


# ---- no experiment branches on placement --------------------------------------------------------------------------
#: the config fields that say where a side lives (each placement's own field, and the Ray placements' settings)
PLACEMENT_FIELDS = frozenset({s.chosen_by for side in PLACEMENTS.values() for s in side.values() if s.chosen_by}
                             | {"engine_resources", "trainer_resources", "cluster_timeout"})
#: the classes and functions that start an engine or a trainer somewhere: the placements' to call, nobody else's
BUILDERS = frozenset({"RolloutEngine", "RolloutServer", "AttachedServer", "CompletionsClient", "RayEngine",
                      "RayTrainer", "RayMegatronTrainer", "MegatronTrainer", "connect", "load_trainer",
                      "build_engine", "build_trainer"})


def _names(node: ast.AST) -> set[str]:
    """Every attribute, name and string constant under ``node``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def placement_branches(source: str, where: str) -> list[str]:
    """The places in ``source`` that decide where a side lives: a condition reading a placement field, a type test
    against an engine or trainer class, a call that builds one, an import of a placement's own module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        tests: list[ast.AST] = []
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests += node.ifs
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
        for t in tests:
            hit = _names(t) & PLACEMENT_FIELDS
            if hit:
                found.append(f"{where}:{t.lineno}: a condition reads {sorted(hit)}")
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in BUILDERS:
                found.append(f"{where}:{node.lineno}: builds {name}(...) itself")
            elif name in ("isinstance", "issubclass", "getattr", "hasattr") and len(node.args) > 1:
                hit = _names(node.args[1]) & (BUILDERS | PLACEMENT_FIELDS)
                if hit:
                    found.append(f"{where}:{node.lineno}: {name}(..., {sorted(hit)})")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("r3lab.cluster"):
            names = {a.name for a in node.names}
            if node.module not in ("r3lab.cluster", "r3lab.cluster.placement") or not names <= PLACEMENT_NAMES:
                found.append(f"{where}:{node.lineno}: imports {sorted(names)} from {node.module}")
        if isinstance(node, ast.ImportFrom) and node.module == "r3lab.rollout":
            hit = {a.name for a in node.names} & BUILDERS
            if hit:
                found.append(f"{where}:{node.lineno}: imports {sorted(hit)} from r3lab.rollout")
    return found


def test_no_experiment_module_branches_on_placement():
    found = []
    for path in sorted((ROOT / "r3lab" / "experiments").rglob("*.py")):
        found += placement_branches(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, what", [
    ("if config.cluster is not None:\n    pass", "a condition reads ['cluster']"),
    ("x = a if cfg.engine_url else b", "a condition reads ['engine_url']"),
    ("y = [c for c in cs if c.trainer_resources]", "a condition reads ['trainer_resources']"),
    ("if isinstance(engine, AttachedServer):\n    pass", "isinstance(..., ['AttachedServer'])"),
    ("q = getattr(config, 'cluster', None)", "getattr(..., ['cluster'])"),
    ("eng = RolloutEngine(path, seed=0)", "builds RolloutEngine(...) itself"),
    ("eng = rollout.connect(url, model=path)", "builds connect(...) itself"),
    ("t = load_trainer(config, path)", "builds load_trainer(...) itself"),
    ("from r3lab.cluster import RayEngine", "imports ['RayEngine'] from r3lab.cluster"),
    ("from r3lab.cluster.engine import build_engine", "from r3lab.cluster.engine"),
    ("from r3lab.rollout import Engine, RolloutEngine", "imports ['RolloutEngine'] from r3lab.rollout"),
])
def test_the_branch_check_catches_each_way_of_deciding_placement(source, what):
    (found,) = placement_branches(source, "x.py")
    assert what in found, found


def test_the_branch_check_lets_the_placement_step_through():
    ok = ("from r3lab.cluster import place\nfrom r3lab.rollout import Engine, stack_routes\n"
          "with place(config, path).engine(seed=0) as engine:\n    pass\n"
          "if config.trainer == 'hf' and engine.weights_refusal is None:\n    pass\n")
    assert placement_branches(ok, "x.py") == []


# ---- one load_trainer ---------------------------------------------------------------------------------------------
def test_one_function_is_named_load_trainer():
    defs = []
    for path in sorted((ROOT / "r3lab").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "load_trainer":
                defs.append(str(path.relative_to(ROOT)))
    assert defs == ["r3lab/trainer_registry.py"], defs


# ---- every engine and trainer class meets its protocol (mypy) ----------------------------------------------------
def test_mypy_names_an_engine_class_that_stops_meeting_the_protocol(tmp_path):
    """tests/test_typing.py runs mypy over r3lab/, placement.py included, which must be clean; here a copy of the
    package whose attached client's ``score`` renamed its keyword must fail that check, naming both server classes
    (they share the client) and the member."""
    shutil.copytree(ROOT / "r3lab", tmp_path / "r3lab", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    attach = tmp_path / "r3lab" / "rollout" / "attach.py"
    text = attach.read_text()
    good = "def score(self, sequences: Sequence[Sequence[int]], *, start: int | Sequence[int] = 1)"
    assert text.count(good) == 1
    attach.write_text(text.replace(good, "def score(self, sequences: Sequence[Sequence[int]], *, first: int = 1)"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, "-m", "mypy", "--cache-dir", os.devnull, "--no-error-summary", "r3lab/cluster/placement.py"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("r3lab/cluster/placement.py") and ": error:" in ln]
    assert len(errors) == 2, r.stdout[-3000:]
    assert '"RolloutServer"; expected "Engine"' in errors[0] and '"AttachedServer"; expected "Engine"' in errors[1]
    assert "def score(self, sequences: Sequence[Sequence[int]], *, first: int = ...)" in r.stdout


# ---- the Megatron trainer takes its ranks from a transport --------------------------------------------------------
class _ScriptedRanks:
    """A rank transport with no ranks: start and call answer from a script; ``receive_stats`` on rank 1 fails."""

    label, ended = "Megatron trainer on a test bench", "every rank was let go"
    error = ClusterError
    backend = None

    def __init__(self):
        self.calls: list[str] = []
        self.closed = 0

    @property
    def pids(self):
        return [101, 102]

    def start(self, spec, world, timeout, fail):
        self.spec, self.world, self.timeout = spec, world, timeout
        return [{"rank": r} for r in range(world)]

    def call(self, cmd, kwargs, timeout, fail):
        self.calls.append(cmd)
        if cmd == "staging_stats":
            raise fail("rank 1 fell over")
        return [{"rank": r, cmd: kwargs} for r in range(self.world)]

    def export(self, timeout, fail):
        return {"weights": timeout}

    def stage_info(self, info, staged):
        return info

    def release(self, staged):
        pass

    def close(self):
        self.closed += 1


def test_the_megatron_trainer_starts_reaches_and_ends_its_ranks_through_its_transport():
    """The driver asks only the transport's interface: start with the rank spec, call, export, close; a failure is
    the transport's error type, naming the trainer as the transport labels it, after every rank was ended."""
    from r3lab.trainers.megatron.trainer import MegatronTrainer

    ranks = _ScriptedRanks()
    t = MegatronTrainer(QWEN, tp=2, lr=1e-3, timeout_s=12.0, start_timeout_s=34.0, transport=ranks)
    assert (ranks.world, ranks.timeout) == (2, 34.0) and t.ranks == [{"rank": 0}, {"rank": 1}]
    assert ranks.spec["model_dir"] == str(QWEN) and ranks.spec["lr"] == 1e-3
    assert ranks.spec["collective_timeout_s"] == 12.0 and t.pids == [101, 102]
    assert t.export_weights() == {"weights": 12.0} and len(t.timings["export"]) == 1
    with pytest.raises(ClusterError) as e:
        t.receive_stats()
    assert str(e.value) == ("Megatron trainer on a test bench (tiny-qwen3-moe, tp=2 pp=1 ep=1 dp=1, float32): rank 1 "
                            "fell over; every rank was let go")
    assert ranks.closed == 1  # ended before the error was raised
    with pytest.raises(ClusterError, match=r"the Megatron trainer on a test bench \(tiny-qwen3-moe, .*\) is closed"):
        t.export_weights()
    t.close()
    assert ranks.closed == 1 and ranks.calls == ["staging_stats"]  # closed once; nothing sent after the failure
