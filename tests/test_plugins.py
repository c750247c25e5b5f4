"""Extension points by entry point: a throwaway distribution, installed with pip, adds a codec, an importer, a trainer
and a model family, and r3lab's registries, API and command line use them without r3lab being edited; a clash and
a plugin that fails to import are errors that name the plugin, its group and the distributions, never a skip.

The distributions are built from the sources below into temporary folders (``pip install --no-deps
--no-build-isolation --target``, what a user's ``pip install`` lays out: the package and its ``.dist-info`` with
``entry_points.txt``) and used by child processes whose ``PYTHONPATH`` holds them, so this process's registries
never see a plugin (the registries read their entry points once per process).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from r3lab import runs
from r3lab.compaction import decode
from r3lab.errors import ConfigError, RouteFormatError
from r3lab.importers.common import LayerMap

ROOT = Path(__file__).resolve().parent.parent

# ---- the plugin distribution: one codec, one importer, one trainer, one family ---------------------------------------
TOY = "r3lab-toy-plugins"
TOY_SOURCES = {
    "codecs.py": '''
        """A zlib byte stage (composes after any id codec: "bitpack+zlib")."""
        import zlib

        from r3lab.compaction.codecs import ByteCodec
        from r3lab.errors import RouteFormatError


        class Zlib(ByteCodec):
            codec_id = "zlib"

            def __init__(self, level=6):
                self.level = level

            def _params(self):
                return {"level": self.level}

            def encode(self, data):
                return zlib.compress(bytes(data), self.level)

            def decode(self, buf, expected_size):
                inflate = zlib.decompressobj()
                out = inflate.decompress(bytes(buf), expected_size)
                if len(out) != expected_size or inflate.unconsumed_tail or not inflate.eof:
                    raise RouteFormatError(f"zlib stage: {len(out)} bytes, expected {expected_size}")
                return out
        ''',
    "importer.py": '''
        """The importer's registry entry; its module is imported only when the kind is used."""
        from r3lab.importers.registry import ImporterSpec

        IMPORTER = ImporterSpec("toy-jsonl", "r3lab_toy_plugins.toy_importer", "import_toy_jsonl",
                                "toy JSONL dumps (a test plugin): tokens, both log-probs, routes",
                                "one .toy.jsonl file")
        ''',
    "toy_importer.py": '''
        """Lines of {step, tokens, prompt_length, logp_infer, logp_train, routes [P+R-1, MoE layers, top_k]}."""
        import json
        from pathlib import Path

        import numpy as np

        from r3lab.errors import ImportFormatError
        from r3lab.importers.common import LayerMap, Sample, write_run
        from r3lab.importers.layouts import Layout, LayoutsSeen

        OPTIONS = {"config": "the model's config.json (required: the routes' layer axis is its MoE layers)"}
        LAYOUTS = (Layout("toy-v1", "tests/test_plugins.py", "a .toy.jsonl file of step/tokens/routes lines",
                          "tokens, engine & trainer log-probs, routes"),)


        def detect(path):
            return "a .toy.jsonl file" if Path(path).name.endswith(".toy.jsonl") else None


        def _samples(src, seen):
            for n, line in enumerate(Path(src).read_text().splitlines(), 1):
                d = json.loads(line)
                seen.add("toy-v1")
                P = d["prompt_length"]
                yield Sample(step=d["step"], tokens=np.asarray(d["tokens"], np.int64),
                             response_length=len(d["tokens"]) - P, logp_infer=np.asarray(d["logp_infer"]),
                             logp_train=np.asarray(d["logp_train"]), routes=np.asarray(d["routes"], np.int64),
                             index=n - 1, where=f"{src}:{n}")


        def import_toy_jsonl(src, out, *, config=None):
            if config is None:
                raise ImportFormatError("toy-jsonl needs --config")
            seen = LayoutsSeen(LAYOUTS)
            return write_run(_samples(src, seen), out, source_format="toy-jsonl", files=[Path(src)],
                             layer_map=LayerMap.from_config(config), layouts=seen)
        ''',
    "trainer.py": '''
        """The trainer's registry entry: torch-free, its loader imported only when the trainer is loaded."""
        from r3lab.trainer_registry import TrainerSpec

        TRAINER = TrainerSpec(name="toy-trainer", description="a uniform scorer over a vocabulary (a test plugin)",
                              label="toy", loader="r3lab_toy_plugins.uniform:load")
        ''',
    "uniform.py": '''
        """A scorer that gives every token log(1 / vocab_size), the vocabulary read from the checkpoint's JSON."""
        import json
        import math

        import numpy as np

        from r3lab.trainers.base import Scorer, TrainerScores


        class UniformScorer(Scorer):
            name, batch_forward = "toy-trainer", True

            def __init__(self, vocab_size, options):
                self.vocab_size, self.options = vocab_size, options

            def score(self, batch, *, routes=None, record=False, entropy=False, weights=None):
                n = int(sum(len(q) - p for q, p in zip(batch.sequences, batch.prompt_lens)))
                return TrainerScores(logprobs=np.full(n, -math.log(self.vocab_size)))


        def load(path, options):
            return UniformScorer(json.loads(open(path).read())["vocab_size"], options)
        ''',
    "family.py": '''
        """A family whose MoE layers are the odd ones and whose expert count lives under toy_experts."""
        from r3lab.families import ModelFamily


        def odd_layers(cfg, n):
            return tuple(range(1, n, 2))


        FAMILY = ModelFamily("toy_moe", ("toy_experts",), odd_layers, strict_experts=True)
        ''',
}
TOY_ENTRY_POINTS = {
    "r3lab.codecs": {"zlib": "r3lab_toy_plugins.codecs:Zlib"},
    "r3lab.importers": {"toy-jsonl": "r3lab_toy_plugins.importer:IMPORTER"},
    "r3lab.trainers": {"toy-trainer": "r3lab_toy_plugins.trainer:TRAINER"},
    "r3lab.families": {"toy_moe": "r3lab_toy_plugins.family:FAMILY"},
}

# ---- a distribution that clashes: a built-in codec's id, and the toy distribution's trainer name ---------------------
CLASH = "r3lab-toy-clash"
CLASH_SOURCES = {
    "plugins.py": '''
        from r3lab.compaction.codecs import ByteCodec
        from r3lab.trainer_registry import TrainerSpec


        class Raw(ByteCodec):
            codec_id = "raw"

            def encode(self, data):
                return bytes(data)

            def decode(self, buf, expected_size):
                return bytes(buf)


        TRAINER = TrainerSpec(name="toy-trainer", description="another toy trainer", label="toy 2",
                              loader="r3lab_toy_clash.plugins:load")
        ''',
}
CLASH_ENTRY_POINTS = {
    "r3lab.codecs": {"raw": "r3lab_toy_clash.plugins:Raw"},
    "r3lab.trainers": {"toy-trainer": "r3lab_toy_clash.plugins:TRAINER"},
}

# ---- a broken distribution: an importer whose module fails to import, a family entry point of the wrong type ---------
BROKEN = "r3lab-toy-broken"
BROKEN_SOURCES = {
    "importer.py": '''
        import r3lab_toy_missing_dependency  # not installed: the plugin cannot import
        ''',
    "family.py": '''
        FAMILY = {"model_type": "broken_moe"}  # a dict where a ModelFamily belongs
        ''',
}
BROKEN_ENTRY_POINTS = {
    "r3lab.importers": {"broken-kind": "r3lab_toy_broken.importer:IMPORTER"},
    "r3lab.families": {"broken_moe": "r3lab_toy_broken.family:FAMILY"},
}


def _distribution(root: Path, name: str, sources: dict[str, str], entry_points: dict[str, dict[str, str]]) -> Path:
    """A source tree of distribution ``name`` (package ``name`` with underscores) declaring ``entry_points``."""
    package = name.replace("-", "_")
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    for file, text in sources.items():
        (root / package / file).write_text(textwrap.dedent(text).lstrip())
    groups = "".join(f'\n[project.entry-points."{group}"]\n' + "".join(f'"{k}" = "{v}"\n' for k, v in eps.items())
                     for group, eps in entry_points.items())
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{name}"
        version = "0.0.1"
        """) + groups + f'\n[tool.setuptools]\npackages = ["{package}"]\n')
    return root


def _pip_install(src: Path, target: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                             "--disable-pip-version-check", "-q", "--target", str(target), str(src)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=src)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """Each distribution built and installed into its own target folder (the three pip runs side by side):
    name -> folder."""
    tmp = tmp_path_factory.mktemp("plugins")
    pips = {}
    for name, sources, eps in ((TOY, TOY_SOURCES, TOY_ENTRY_POINTS), (CLASH, CLASH_SOURCES, CLASH_ENTRY_POINTS),
                               (BROKEN, BROKEN_SOURCES, BROKEN_ENTRY_POINTS)):
        pips[name] = (tmp / "site" / name, _pip_install(_distribution(tmp / "src" / name, name, sources, eps),
                                                        tmp / "site" / name))
    for name, (_, pip) in pips.items():
        log, _ = pip.communicate(timeout=300)
        assert pip.returncode == 0, f"pip cannot install {name}: {log[-3000:]}"
    return {name: target for name, (target, _) in pips.items()}


def _env(*paths: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "R3LAB_DATA")}
    return {**env, "PYTHONPATH": os.pathsep.join(map(str, paths)), "OMP_NUM_THREADS": "1"}


def _python(code: str, *paths: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_env(*paths), cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _r3lab(*args: str, paths: tuple[Path, ...], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "r3lab", *args], env=_env(*paths), cwd=cwd, capture_output=True,
                          text=True, timeout=300)


# ---- the toy distribution --------------------------------------------------------------------------------------------
E, K, LAYERS = 8, 2, 6  # the toy family: MoE layers 1, 3, 5 (its rule), experts under toy_experts
TOY_CONFIG = {"model_type": "toy_moe", "num_hidden_layers": LAYERS, "toy_experts": E, "num_experts_per_tok": K}

# whether each registry has read its group once its module is imported (the trainer registry alone: importing
# r3lab.config, as the importers do, reads it for the config's trainer choices), and the plugin modules imported then
REGISTRIES = '''
    import json, sys
    from r3lab.trainer_registry import TRAINER_REGISTRY
    unread = {"trainers": TRAINER_REGISTRY.read}
    from r3lab.compaction.codecs import CODECS
    from r3lab.importers.registry import REGISTRY
    from r3lab.families import FAMILIES
    unread.update(codecs=CODECS.read, importers=REGISTRY.read, families=FAMILIES.read,
                  imported=sorted(m for m in sys.modules if m.startswith("r3lab_toy")))
'''


def test_plugins_are_read_on_the_first_lookup_into_every_registry(installed, tmp_path):
    r = _python(REGISTRIES + '''
    names = {"codecs": list(CODECS), "importers": list(REGISTRY), "trainers": list(TRAINER_REGISTRY),
             "families": list(FAMILIES)}
    entries = {"codec": f"{CODECS['zlib'].__module__}.{CODECS['zlib'].__qualname__}",
               "importer": REGISTRY["toy-jsonl"].module, "trainer": TRAINER_REGISTRY["toy-trainer"].loader,
               "family": FAMILIES["toy_moe"].moe_layers.__module__}
    dists = [CODECS.distributions, REGISTRY.distributions, TRAINER_REGISTRY.distributions, FAMILIES.distributions]
    print(json.dumps({"unread": unread, "names": names, "entries": entries, "dists": dists,
                      "imported": sorted(m for m in sys.modules if m.startswith("r3lab_toy"))}))
    ''', installed[TOY], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    # importing the registries imports no plugin; each group is read when its registry is first looked up
    assert got["unread"] == {"codecs": False, "importers": False, "trainers": False, "families": False,
                             "imported": ["r3lab_toy_plugins", "r3lab_toy_plugins.trainer"]}
    from r3lab.compaction.codecs import CODECS
    from r3lab.families import FAMILIES
    from r3lab.importers.registry import REGISTRY
    from r3lab.trainer_registry import TRAINER_REGISTRY

    assert got["names"] == {"codecs": [*CODECS, "zlib"], "importers": [*REGISTRY, "toy-jsonl"],
                            "trainers": [*TRAINER_REGISTRY, "toy-trainer"], "families": [*FAMILIES, "toy_moe"]}
    assert "zlib" not in CODECS and "toy_moe" not in FAMILIES  # this process has no plugin on its path
    assert got["entries"] == {"codec": "r3lab_toy_plugins.codecs.Zlib", "importer": "r3lab_toy_plugins.toy_importer",
                              "trainer": "r3lab_toy_plugins.uniform:load", "family": "r3lab_toy_plugins.family"}
    assert got["dists"] == [{"zlib": TOY}, {"toy-jsonl": TOY}, {"toy-trainer": TOY}, {"toy_moe": TOY}]
    # the entries' own modules are imported, not the modules they name for later (the importer, the trainer's loader)
    assert got["imported"] == ["r3lab_toy_plugins", "r3lab_toy_plugins.codecs", "r3lab_toy_plugins.family",
                               "r3lab_toy_plugins.importer", "r3lab_toy_plugins.trainer"]


def test_the_plugin_codec_encodes_and_decodes_by_name(installed, tmp_path):
    r = _python('''
    import json, sys
    import numpy as np
    from r3lab.compaction import decode, encode
    from r3lab.compaction.codecs import pipeline_configs
    from r3lab.testing import random_routes
    routes = random_routes(np.random.default_rng(3), num_experts=64, top_k=8, num_layers=4, lengths=[40, 25])
    buf = encode(routes, "bitpack+zlib")
    open("routes.r3", "wb").write(buf)
    print(json.dumps({"same": decode(buf) == routes, "configs": pipeline_configs("bitpack+zlib"),
                      "sizes": [len(buf), len(encode(routes, "bitpack"))]}))
    ''', installed[TOY], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["same"] is True
    assert got["configs"][1] == {"id": "zlib", "level": 6} and got["configs"][0]["id"] == "bitpack"
    assert got["sizes"][0] != got["sizes"][1]
    # the buffer needs the plugin: without it (this process) its codec is unknown
    with pytest.raises(RouteFormatError, match="unknown codec 'zlib'"):
        decode((tmp_path / "routes.r3").read_bytes())


def test_the_plugin_trainer_loads_and_scores_and_the_plugin_family_lays_out_a_model(installed, tmp_path):
    ckpt = tmp_path / "uniform.json"
    ckpt.write_text(json.dumps({"vocab_size": 50}))
    r = _python(f'''
    import json
    from r3lab.moe_layout import MoELayout
    from r3lab.trainer_registry import TrainerOptions, load_trainer
    from r3lab.trainers import TokenBatch
    with load_trainer("toy-trainer", {str(ckpt)!r}, {{"dtype": "bfloat16"}}) as scorer:
        scores = scorer.score(TokenBatch.from_ids([[1, 2, 3, 4, 5], [6, 7, 8]], [2, 1]))
    lay = MoELayout.from_config({TOY_CONFIG!r})
    print(json.dumps({{"logprobs": scores.logprobs.tolist(), "options": scorer.options == TrainerOptions("bfloat16"),
                      "moe": lay.moe_layer_ids, "dense": lay.dense_layer_ids, "experts": lay.num_experts}}))
    ''', installed[TOY], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["logprobs"] == [-math.log(50)] * (3 + 2) and got["options"] is True  # 3 + 2 response tokens
    assert got["moe"] == [1, 3, 5] and got["dense"] == [0, 2, 4] and got["experts"] == E


def _toy_dump(path: Path, rng: np.random.Generator) -> dict[int, list[dict]]:
    """Two steps of three samples in the toy importer's format; returns them by step."""
    by_step: dict[int, list[dict]] = {}
    lines = []
    for step in (1, 2):
        for _ in range(3):
            P, R = 3, int(rng.integers(2, 6))
            rows = P + R - 1
            routes = np.argsort(rng.random((rows, LAYERS // 2, E)), axis=-1)[:, :, :K]  # K distinct ids per row
            logp = -rng.uniform(0.1, 3.0, size=R)
            d = {"step": step, "tokens": rng.integers(0, 100, size=P + R).tolist(), "prompt_length": P,
                 "logp_infer": logp.tolist(), "logp_train": (logp + rng.normal(0, 1e-3, size=R)).tolist(),
                 "routes": routes.tolist()}
            by_step.setdefault(step, []).append(d)
            lines.append(json.dumps(d))
    path.write_text("\n".join(lines) + "\n")
    return by_step


def test_r3lab_imports_a_plugin_kind_and_lists_the_plugin_trainer(installed, tmp_path):
    dump, cfg = tmp_path / "run.toy.jsonl", tmp_path / "config.json"
    truth = _toy_dump(dump, np.random.default_rng(0))
    cfg.write_text(json.dumps(TOY_CONFIG))
    paths = (installed[TOY],)
    for kind in ("toy-jsonl", "auto"):
        r = _r3lab("import", kind, str(dump), "--out", str(tmp_path / f"run-{kind}"), "--config", str(cfg),
                   paths=paths, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert f"imported toy-jsonl dump {dump} as run" in r.stdout, r.stdout
    assert "r3lab import auto: toy-jsonl dump (a .toy.jsonl file)" in r.stderr, r.stderr
    for kind in ("toy-jsonl", "auto"):
        run = runs.load(tmp_path / f"run-{kind}")
        assert run.config["source"]["format"] == "toy-jsonl" and run.config["source_layouts"] == ["toy-v1"]
        assert run.config["model"]["moe_layer_ids"] == [1, 3, 5] and run.config["model"]["num_experts"] == E
        for step, samples in truth.items():
            routes, toks = run.routes(step, "engine"), run.tokens([step])
            for i, d in enumerate(samples):
                assert np.array_equal(routes.sequence(i).astype(np.int64), np.asarray(d["routes"]))
                t = toks[toks["sample"] == i]
                np.testing.assert_array_equal(t["logp_infer"].to_numpy(), d["logp_infer"])
    # this process has no toy family: the same config reads as a dense model here
    with pytest.raises(ConfigError, match="dense model"):
        LayerMap.from_config(cfg)
    r = _r3lab("doctor", str(tmp_path / "run-auto"), paths=paths, cwd=tmp_path)
    assert r.returncode == 0 and "0 failed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    # where the command line lists importers, layouts and trainers, the plugin's are listed (r3lab.cli.main in one
    # process: a command's start-up is most of its time)
    r = _python("""
    import contextlib, io, json
    from r3lab.cli import main
    out = {}
    for args in (["import", "--help"], ["import", "--formats"], ["drift", "--help"], ["rescore", "--help"]):
        with contextlib.redirect_stdout(io.StringIO()) as text, contextlib.suppress(SystemExit):
            main(args)
        out[" ".join(args)] = " ".join(text.getvalue().split())
    print(json.dumps(out))
    """, *paths, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    listed = json.loads(r.stdout)
    assert "megatron-trace Megatron-LM" in listed["import --help"]
    assert "toy-jsonl toy JSONL dumps (a test plugin): tokens, both log-probs, routes auto" in listed["import --help"]
    assert "| toy-jsonl | `toy-v1` |" in listed["import --formats"]
    for args in ("drift --help", "rescore --help"):
        assert "--trainer {hf,megatron,megatron-bridge,toy-trainer}" in listed[args], listed[args]


# ---- clashes and broken plugins --------------------------------------------------------------------------------------
# every registry, its module imported and then looked up, twice: a failed read is not remembered as done, so the
# second lookup fails again (never a registry silently without the plugin)
LOOKUPS = '''
    import importlib, json
    from r3lab.errors import ConfigError
    out = {}
    for name, module, attr in (("codecs", "r3lab.compaction.codecs.registry", "CODECS"),
                               ("families", "r3lab.families", "FAMILIES"),
                               ("trainers", "r3lab.trainer_registry", "TRAINER_REGISTRY"),
                               ("importers", "r3lab.importers.registry", "REGISTRY")):
        tries = []
        for _ in range(2):
            try:
                tries.append(sorted(getattr(importlib.import_module(module), attr)))
            except ConfigError as e:
                tries.append(str(e))
        out[name] = tries
    print(json.dumps(out))
'''


def test_a_name_clash_names_both_distributions(installed, tmp_path):
    r = _python(LOOKUPS, installed[TOY], installed[CLASH], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    codec, again = got["codecs"]
    assert codec == again and isinstance(codec, str), got
    assert codec == ("entry point group 'r3lab.codecs': the codec 'raw' of distribution r3lab-toy-clash "
                     "(r3lab_toy_clash.plugins:Raw) clashes with the codec 'raw' of distribution r3lab; a plugin adds "
                     "names, it never replaces one: rename the entry point in r3lab-toy-clash, or uninstall it")
    trainer, again = got["trainers"]
    assert trainer == again and isinstance(trainer, str), got
    assert trainer == ("entry point group 'r3lab.trainers': the trainer 'toy-trainer' is declared by 2 distributions, "
                       "r3lab-toy-clash (r3lab_toy_clash.plugins:TRAINER) and r3lab-toy-plugins "
                       "(r3lab_toy_plugins.trainer:TRAINER); one name, one trainer: uninstall all but one")
    assert "toy_moe" in got["families"][0]  # a group without a clash reads as usual
    # the importers import r3lab.config, whose trainer choices are the trainer registry's: they stop at the clash too
    assert got["importers"] == [trainer, trainer]
    # the command line stops with the message (its trainer choices need the trainer registry)
    r = _r3lab("import", "--help", paths=(installed[TOY], installed[CLASH]), cwd=tmp_path)
    assert r.returncode != 0 and trainer in r.stderr, r.stderr[-3000:]


def test_a_plugin_that_fails_to_import_is_an_error_naming_it_and_its_group(installed, tmp_path):
    r = _python(REGISTRIES + "    print(json.dumps(unread))\n" + LOOKUPS, installed[BROKEN], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    unread, got = (json.loads(line) for line in r.stdout.splitlines())
    assert unread["importers"] is False and unread["families"] is False  # importing r3lab's modules still works
    importer, again = got["importers"]
    assert importer == again and isinstance(importer, str), got
    assert importer == ("the importer plugin 'broken-kind' (r3lab_toy_broken.importer:IMPORTER) of distribution "
                        "r3lab-toy-broken, entry point group 'r3lab.importers', fails to import: ModuleNotFoundError: "
                        "No module named 'r3lab_toy_missing_dependency'. Fix r3lab-toy-broken or uninstall it")
    family, again = got["families"]
    assert family == again and isinstance(family, str), got
    assert family == ("the model family plugin 'broken_moe' (r3lab_toy_broken.family:FAMILY) of distribution "
                      "r3lab-toy-broken, entry point group 'r3lab.families': an r3lab.families entry point names a "
                      "ModelFamily, got {'model_type': 'broken_moe'}")
    assert isinstance(got["codecs"][0], list) and isinstance(got["trainers"][0], list)  # other groups unaffected
    dump = tmp_path / "x.jsonl"
    dump.write_text("{}\n")
    r = _r3lab("import", "auto", str(dump), "--out", str(tmp_path / "run"), paths=(installed[BROKEN],), cwd=tmp_path)
    assert r.returncode != 0 and importer in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "run").exists()
