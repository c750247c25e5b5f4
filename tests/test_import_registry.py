"""The importer registry, `import auto`, all-or-nothing imports and the command line that reads the registries."""

from __future__ import annotations

import json
import re
from pathlib import Path

import make_dumps as md
import pytest
import torch

from r3lab import runs
from r3lab.errors import ImporterMissingError, ImportFormatError, RunFormatError
from r3lab.importers import KINDS, detect_kind, import_run
from r3lab.importers import registry as reg
from r3lab.runs import RunWriter

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def cfg(tmp_path):
    return md.model_config(tmp_path / "model")


def _leftovers(folder: Path) -> list[str]:
    """Everything an import may have left beside its run: the run itself and any hidden temporary folder."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or p.name.startswith("run"))


def _break_sample(src: Path, step: int, sample: int) -> None:
    """Rewrite one rollout file of a generated slime dump with one sample missing its 'tokens' (the test's own file,
    so it is loaded in full)."""
    path = src / f"rollout_{step}.pt"
    obj = torch.load(path, weights_only=False)
    del obj["samples"][sample]["tokens"]
    torch.save(obj, path)


# ---- the registry ---------------------------------------------------------------------------------------------------
def test_every_importer_module_is_one_registry_entry_and_declares_its_options():
    mods = {p.stem for p in (ROOT / "r3lab" / "importers").glob("*.py")} - {"__init__", "common", "registry",
                                                                              "unpickle", "train_dumps", "layouts"}
    named = {s.module.rsplit(".", 1)[1] for s in KINDS.values()}
    assert mods <= named, sorted(mods - named)  # a module without an entry would be unreachable
    for kind, spec in KINDS.items():
        assert spec.kind == kind and spec.description and spec.reads
        if spec.available:
            assert callable(spec.import_function)
            assert all(isinstance(k, str) and isinstance(v, str) and v for k, v in spec.options.items()), kind
            # every importer names the layouts it reads (recorded in runs, listed by r3lab import --formats)
            names = [lay.name for lay in spec.layouts]
            assert names and len(set(names)) == len(names), (kind, names)
            assert all(lay.writer and lay.marks and lay.gives for lay in spec.layouts), kind
    assert {"skyrl", "verl"} <= set(KINDS)


def test_a_registered_kind_without_its_module_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(reg.REGISTRY, "nowhere", reg.ImporterSpec("nowhere", "r3lab.importers.nowhere",
                                                                  "import_nowhere", "a test entry", "anything"))
    with pytest.raises(ImporterMissingError, match=r"nowhere importer \(r3lab.importers.nowhere\) is not in this"):
        import_run("nowhere", tmp_path, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ImportFormatError, match="unknown dump kind 'slimey'"):
        import_run("slimey", tmp_path, tmp_path / "run")


def test_an_option_the_kind_does_not_declare_is_refused_by_name(tmp_path, cfg):
    src = md.nemo_rl_dump(tmp_path / "dump")
    with pytest.raises(ImportFormatError, match=r"options \['train'\] do not apply to nemo-rl"):
        import_run("nemo-rl", src, tmp_path / "run", train=str(src))
    with pytest.raises(ImportFormatError, match=r"options \['colour'\] do not apply to slime dumps \(slime takes: "
                                                r"config, reward_key, train\)"):
        import_run("slime", md.slime_dump(tmp_path / "s"), tmp_path / "run", config=cfg, colour="blue")
    assert not (tmp_path / "run").exists()


# ---- auto ------------------------------------------------------------------------------------------------------------
def test_auto_recognises_each_framework_and_says_why(tmp_path, cfg, capsys):
    cases = {"slime": md.slime_dump(tmp_path / "slime"), "nemo-rl": md.nemo_rl_dump(tmp_path / "nemo"),
             "prime-rl": md.prime_rl_dump(tmp_path / "prime")}
    for kind, src in cases.items():
        got, why = detect_kind(src)
        assert got == kind and why, (kind, got, why)
    assert detect_kind(cases["prime-rl"] / "token_exports")[0] == "prime-rl"  # a folder beneath the output
    path = import_run("auto", cases["nemo-rl"], tmp_path / "run-nemo")
    err = capsys.readouterr().err
    assert "r3lab import auto: nemo-rl dump (" in err and "train_data_step" in err
    assert runs.load(path).config["source"]["format"] == "nemo-rl"
    path = import_run("auto", cases["slime"], tmp_path / "run-slime", config=cfg, train=cases["slime"] / "train")
    assert runs.load(path).summary["samples"] == 16


def test_auto_refuses_an_unknown_folder_saying_what_it_looked_for(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no dump here")
    with pytest.raises(ImportFormatError, match="no importer recognises") as e:
        import_run("auto", tmp_path / "notes", tmp_path / "run")
    for kind, spec in KINDS.items():
        if spec.available:
            assert f"{kind}: {spec.reads}" in str(e.value)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ImportFormatError, match="does not exist"):
        detect_kind(tmp_path / "nothing")


def test_auto_refuses_an_ambiguous_folder_naming_every_candidate(tmp_path, monkeypatch):
    import r3lab.importers.miles as miles

    src = md.slime_dump(tmp_path / "dump")
    monkeypatch.setattr(miles, "detect", lambda p: "rollout dumps of Miles' layout")
    with pytest.raises(ImportFormatError, match="ambiguous") as e:
        import_run("auto", src, tmp_path / "run")
    msg = str(e.value)
    assert re.search(r"slime \(rollout_\d+\.pt holding \{'rollout_id'", msg)
    assert "miles (rollout dumps of Miles' layout)" in msg
    assert "r3lab import KIND SRC, KIND one of slime, miles" in msg
    assert not (tmp_path / "run").exists()


def test_auto_checks_options_against_the_kind_it_chose(tmp_path):
    src = md.prime_rl_dump(tmp_path / "dump")
    with pytest.raises(ImportFormatError, match=r"options \['reward_key'\] do not apply to prime-rl"):
        import_run("auto", src, tmp_path / "run", reward_key="score")


# ---- all or nothing ------------------------------------------------------------------------------------------------
def test_a_refused_import_leaves_no_run_and_no_temporary_folder(tmp_path, cfg):
    """A bad sample (sample 5 of the second step) after a whole step was written: nothing at out, nothing hidden."""
    src = md.slime_dump(tmp_path / "dump", train=False)
    _break_sample(src, step=1, sample=5)
    with pytest.raises(ImportFormatError, match=r"rollout_1\.pt sample 5: sample has no 'tokens'"):
        import_run("slime", src, tmp_path / "run", config=cfg)
    assert _leftovers(tmp_path) == []


def test_ctrl_c_mid_import_leaves_nothing(tmp_path, cfg, monkeypatch):
    import r3lab.importers.slime as slime

    real, calls = slime.sample_from_dict, []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 12:  # step 1, sample 3: step 0 is already on disk
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(slime, "sample_from_dict", interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_run("slime", md.slime_dump(tmp_path / "dump", train=False), tmp_path / "run", config=cfg)
    assert len(calls) == 12 and _leftovers(tmp_path) == []


def test_an_existing_out_is_refused_untouched(tmp_path, cfg):
    src = md.slime_dump(tmp_path / "dump", train=False)
    out = tmp_path / "run"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ImportFormatError, match="exists"):
        import_run("slime", src, out, config=cfg)
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "keep me"
    assert _leftovers(tmp_path) == ["run"]


def test_a_finished_import_is_one_folder_whose_config_holds_the_capture_log(tmp_path, cfg):
    path = import_run("slime", md.slime_dump(tmp_path / "dump", "none_routes", train=False), tmp_path / "run",
                      config=cfg)
    assert _leftovers(tmp_path) == ["run"]
    meta = json.loads((path / "config.json").read_text())
    assert meta["name"] == "run" and meta["config"]["capture"]["counts"]["missing_routes"] == 2
    assert runs.load(path).finished


def test_run_writer_adds_to_its_config_and_writes_atomically(tmp_path):
    with RunWriter(tmp_path, "a", "drift", {"x": 1}, atomic=True) as w:
        assert w.path != tmp_path / "a" and w.path.name.startswith(".a.partial-")
        assert not (tmp_path / "a").exists()
        w.add_config({"late": [1, 2]})
        with pytest.raises(RunFormatError, match=r"\['x'\] are already set"):
            w.add_config({"x": 2})
        w.log_step({"step": 0})
        assert not (w.path / "config.json").exists()  # an atomic run's config is written once, by finish
        w.finish({"steps": 1})
    assert w.path == tmp_path / "a" and sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert runs.load(tmp_path / "a").config == {"x": 1, "late": [1, 2]}
    with pytest.raises(RunFormatError, match="finished"):
        w.add_config({"more": 1})
    with pytest.raises(ValueError, match="boom"), RunWriter(tmp_path, "b", "drift", {}, atomic=True) as w:
        w.log_step({"step": 0})
        raise ValueError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    with pytest.raises(ValueError), RunWriter(tmp_path, "c", "drift", {}) as w:  # not atomic: a stopped run stays
        raise ValueError("boom")
    assert runs.load(tmp_path / "c").state == "stopped"


# ---- the command line ---------------------------------------------------------------------------------------------
def _subcommands(parser) -> dict:
    import argparse

    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_cli_import_kinds_and_options_come_from_the_registry():
    from r3lab.cli import _parser

    kinds = _subcommands(_subcommands(_parser())["import"])
    assert list(kinds) == [*KINDS, "auto"]
    for kind, spec in KINDS.items():
        if not spec.available:
            continue
        flags = {o for a in kinds[kind]._actions for o in a.option_strings if o.startswith("--")}
        assert flags == {"--help", "--out", *("--" + n.replace("_", "-") for n in spec.options)}, kind


def test_cli_every_command_dispatches_through_its_func():
    from r3lab.cli import _parser

    for name, sub in _subcommands(_parser()).items():
        for sub2 in _subcommands(sub).values() if name == "import" else [sub]:
            assert callable(sub2.get_default("func")), name


def test_cli_import_auto_then_doctor_and_refusals(tmp_path, cfg, capsys):
    from r3lab.cli import main

    src = md.slime_dump(tmp_path / "dump")
    main(["import", "auto", str(src), "--out", str(tmp_path / "run"), "--config", str(cfg), "--train",
          str(src / "train")])
    cap = capsys.readouterr()
    assert "r3lab import auto: slime dump" in cap.err and "imported slime dump" in cap.out
    main(["doctor", str(tmp_path / "run")])
    assert "0 failed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # an option nemo-rl does not declare: argparse refuses it by name
        main(["import", "nemo-rl", str(md.nemo_rl_dump(tmp_path / "n")), "--out", str(tmp_path / "r2"), "--train",
              "x"])
    assert e.value.code == 2 and "--train" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # auto takes every kind's options, then checks them against its choice
        main(["import", "auto", str(tmp_path / "n"), "--out", str(tmp_path / "r3"), "--train", "x"])
    assert "options ['train'] do not apply to nemo-rl" in str(e.value.code)
    bad = md.slime_dump(tmp_path / "bad", train=False)
    _break_sample(bad, step=1, sample=5)
    with pytest.raises(SystemExit) as e:
        main(["import", "slime", str(bad), "--out", str(tmp_path / "r4"), "--config", str(cfg)])
    assert "sample 5" in str(e.value.code) and not (tmp_path / "r4").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_benchmarks_are_the_bench_scripts_with_their_docstrings():
    import ast

    from r3lab.cli import BENCHMARKS

    for script in sorted((ROOT / "bench").glob("bench_*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text()))
        assert doc, f"{script.name} has no docstring: r3lab bench lists its first line"
        assert BENCHMARKS[script.stem.removeprefix("bench_")] == doc.splitlines()[0].rstrip(".")


def test_every_benchmark_runs_as_r3lab_bench_and_a_command_keeps_its_name(monkeypatch):
    """``r3lab bench NAME ARGS`` for every script, and ``r3lab NAME ARGS`` too unless a command has that name
    (``rescore`` is a benchmark and a command: the command stays the command). A benchmark named like a command once
    made the parser itself fail, every command with it; and ``r3lab dial --quick`` was refused (argparse's REMAINDER
    drops leading flags), though the README names it."""
    from r3lab import cli

    ran: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(cli, "_bench", lambda name, args: ran.append((name, list(args))))
    commands = {"drift", "rl", "rescore", "import", "doctor", "figures", "runs", "capture", "bench"}
    assert "rescore" in cli.BENCHMARKS and commands <= set(cli._parser()._actions[-1].choices)
    for name in cli.BENCHMARKS:
        cli.main(["bench", name, "--quick", "x"])
        assert ran.pop() == (name, ["--quick", "x"])
    for name in sorted(set(cli.BENCHMARKS) - commands):  # the shortcut
        cli.main([name, "--quick", "x"])
        assert ran.pop() == (name, ["--quick", "x"])
    assert cli._parser().parse_args(["rescore", "RUN"]).func is cli._rescore and not ran
