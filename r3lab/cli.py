"""The command line: ``r3lab`` (or ``python -m r3lab``).

``r3lab`` alone runs the main job, the drift experiment (``r3lab drift``). Benchmarks live in a source
checkout's ``bench/`` folder, not in the installed package: ``r3lab bench NAME`` (or ``r3lab NAME``)
runs ``bench/bench_NAME.py`` there and says so plainly when there is no checkout.
"""

from __future__ import annotations

import argparse
import functools
import runpy
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from r3lab._extras import missing_extra, require
from r3lab.config import (
    DEFAULT_MODES,
    RL_QUICK_SEEDS,
    RL_SEEDS,
    TRAINER_DTYPES,
    CaptureConfig,
    DriftConfig,
    RLConfig,
    add_config_flags,
    config_overrides,
    quick_help,
)
from r3lab.errors import ConfigError, MissingExtraError, R3LabError
from r3lab.vocabulary import RunKind

__all__ = ["main", "BENCHMARKS"]

def _benchmarks() -> dict[str, str]:
    """``bench/bench_NAME.py`` of a source checkout -> the first line of its docstring (empty without a checkout).

    The scripts are the one list of benchmarks: a new ``bench_NAME.py`` is ``r3lab bench NAME`` with no other edit.
    """
    import re

    from r3lab.paths import bench_dir

    folder = bench_dir()
    out = {}
    for script in sorted(folder.glob("bench_*.py")) if folder is not None and folder.is_dir() else []:
        m = re.match(r'\s*(?:#[^\n]*\n\s*)*[rRuU]?"""\s*([^\n]*?)\s*(?:"""|\n)', script.read_text(encoding="utf-8"))
        out[script.stem.removeprefix("bench_")] = m.group(1).rstrip(".") if m else ""
    return out


BENCHMARKS = _benchmarks()
"""Benchmark name -> its one-line description, read from the checkout's bench/ scripts."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="r3lab", description="r3lab: Rollout Routing Replay workbench. With no command, runs the drift experiment."
    )
    ap.add_argument("--version", action="store_true",
                    help="print r3lab's version and the folder it runs from (an editable install runs that checkout)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser(RunKind.DRIFT, help="trainer vs engine drift without replay and with R3 (the main job)")
    d.add_argument("--quick", action="store_true",
                   help="a smoke run: " + quick_help(DriftConfig))
    add_config_flags(d, DriftConfig)
    d.add_argument("--out", help="also write the markdown table to this file")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.add_argument("--runs", help="write the run here (default: <data>/runs; $R3LAB_RUNS)")
    d.add_argument("--name", help="the run's folder name (default: drift-<time>)")
    r = sub.add_parser(RunKind.RL, help="GRPO on CPU comparing replay modes (none, R2, R3) over seeds; writes runs")
    r.add_argument("--quick", action="store_true",
                   help="a smoke run: " + quick_help(RLConfig) + ", seed 0")
    add_config_flags(r, RLConfig)
    r.add_argument("--runs", help="write runs here (default: <data>/runs; $R3LAB_RUNS)")
    r.add_argument("--name", help="prefix of the runs' folder names (default: rl-<model>-<time>)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    c = sub.add_parser(RunKind.CAPTURE, help="send prompts through an engine (a running vLLM server: --engine-url) and "
                       "write an engine-only run: tokens, engine log-probs, routes")
    c.add_argument("--prompts", required=True, help="a text file (one prompt per line, blank lines skipped) or a "
                   '.jsonl file ({"prompt": "text" or [token ids]} per line)')
    c.add_argument("--out", required=True, help="the run folder to write (must not exist; marked stopped if the "
                   "engine fails mid-run)")
    add_config_flags(c, CaptureConfig)
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=_capture)
    ls = sub.add_parser("runs", help="list the runs in a folder")
    ls.add_argument("folder", nargs="?", help="default: <data>/runs; $R3LAB_RUNS")
    f = sub.add_parser("figures", help="regenerate every paper figure from committed results (PNG, SVG, PDF)")
    f.add_argument("--results", help="the committed results folder (default: the checkout's bench/results)")
    f.add_argument("--out", help="where figures go (default: the checkout's docs/figures)")
    f.add_argument("--formats", nargs="+", choices=("png", "svg", "pdf"), help="default: all three")
    _add_import(sub)
    dr = sub.add_parser("doctor", help="check a run (own or imported) for the silent failures of routing replay")
    dr.add_argument("run", help="the run folder")
    dr.add_argument("--strict", action="store_true", help="exit non-zero on warnings too (mismatch health)")
    dr.add_argument("--json", action="store_true", help="print the report as JSON")
    rs = sub.add_parser("rescore", help="score a finished drift or RL run's samples again with another trainer, "
                        "layout or dtype (none and R3); writes a new run beside it")
    rs.add_argument("run", help="the run folder (a drift run, or an RL run: its step 0)")
    _add_field_flags(rs, DriftConfig, ("trainer", "tp", "pp", "ep"))
    rs.add_argument("--trainer-dtype", choices=tuple(TRAINER_DTYPES),
                    help="the trainer's dtype (default: each cell's own; an RL run's trainer_dtype)")
    rs.add_argument("--out", help="the new run's name, beside RUN (default: RUN-rescore-<trainer>[-<layout>][-<dtype>];"
                    " an existing name is an error)")
    rs.add_argument("--steps", type=int, nargs="+", help="source steps to score (default: every drift cell; an RL "
                    "run: step 0, the only one at known weights)")
    rs.add_argument("--data", help="the data folder holding the run's model (default: the run's own)")
    rs.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_cluster_flags(rs)
    b = sub.add_parser("bench", help="run a benchmark from a source checkout's bench/ folder")
    b.add_argument("name", choices=sorted(BENCHMARKS) or None,
                   help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()) or "a benchmark of bench/ (needs a "
                   "source checkout)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark (e.g. --quick)")
    b.set_defaults(func=lambda a: _bench(a.name, a.args))
    d.set_defaults(func=_drift)
    r.set_defaults(func=_rl)
    ls.set_defaults(func=_runs)
    f.set_defaults(func=_figures)
    dr.set_defaults(func=_doctor)
    rs.set_defaults(func=_rescore)
    # `r3lab NAME ARGS` = `r3lab bench NAME ARGS`, unless a command has that name (drift, rl, rescore); the shortcut
    # has no option of its own (prefix "+", no -h), so every argument, --quick and -h too, goes to the script
    for name in BENCHMARKS:
        if name not in sub.choices:
            s = sub.add_parser(name, help=f"= r3lab bench {name}: {BENCHMARKS[name]}", prefix_chars="+", add_help=False)
            s.add_argument("args", nargs=argparse.REMAINDER)
            s.set_defaults(func=functools.partial(_bench_shortcut, name))
    return ap


def _add_import(sub: Any) -> None:
    """``r3lab import KIND SRC --out RUN [options]``: one sub-command per registered kind, with the options it
    declares (:mod:`r3lab.importers.registry`), and ``auto`` with every kind's options (checked once it chose)."""
    from r3lab.importers.registry import AUTO, REGISTRY

    im = sub.add_parser("import", help="import another framework's R3 dump (" + ", ".join(REGISTRY) + ", or auto) "
                        "as a run")
    im.add_argument("--formats", action="store_true", help="print every dump kind and the layouts of it this r3lab "
                    "reads (what marks each, what an import gives, the source it was read from), then exit")
    im.set_defaults(func=_import_formats)
    kinds = im.add_subparsers(dest="kind", metavar="KIND")
    every: dict[str, str] = {}
    for kind, spec in REGISTRY.items():
        if not spec.available:
            p = kinds.add_parser(kind, help=f"{spec.description} (not in this r3lab)")
            _import_args(p, spec.reads, {})
            continue
        every.update(spec.options)
        _import_args(kinds.add_parser(kind, help=spec.description, description=f"{spec.description}. SRC: "
                                      f"{spec.reads}."), spec.reads, spec.options)
    auto = kinds.add_parser(AUTO, help="recognise the framework from the files (says which it chose and why)")
    _import_args(auto, "a dump folder or file of any kind above", every)


def _import_args(p: argparse.ArgumentParser, reads: str, options: Mapping[str, str]) -> None:
    p.add_argument("src", help=f"the dump: {reads}")
    p.add_argument("--out", required=True, help="the run folder to write (must not exist; nothing is left there if "
                   "the import fails)")
    for name, text in options.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, help=text)
    p.set_defaults(func=_import, options=tuple(options))


def _add_field_flags(parser: argparse.ArgumentParser, cls: type, names: tuple[str, ...]) -> None:
    """Flags for some fields of a config dataclass, with the field's default, type, choices and help."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(cls)}
    for n in names:
        f = fields[n]
        parser.add_argument("--" + n.replace("_", "-"), type=type(f.default), default=f.default,
                            choices=f.metadata.get("choices"), help=f"{f.metadata['help']} (default: {f.default})")


def _add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """``--cluster``, ``--trainer-resources`` and ``--cluster-timeout`` as the drift config has them."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(DriftConfig)}
    for n, typ in (("cluster", str), ("trainer_resources", str), ("cluster_timeout", float)):
        f = fields[n]
        default = f.metadata["unset"] if f.default is None else f.default
        parser.add_argument("--" + n.replace("_", "-"), type=typ, default=f.default,
                            help=f"{f.metadata['help']} (default: {default})")


def _rescore(args: argparse.Namespace) -> None:
    from r3lab.experiments.rescore import rescore_run, rescore_table

    path = rescore_run(args.run, trainer=args.trainer, tp=args.tp, pp=args.pp, ep=args.ep,
                       trainer_dtype=args.trainer_dtype, out=args.out, steps=args.steps, data=args.data,
                       progress=not args.no_progress, cluster=args.cluster, trainer_resources=args.trainer_resources,
                       cluster_timeout=args.cluster_timeout)
    print(rescore_table(path))
    print(f"run: {path}", file=sys.stderr)


def _drift(args: argparse.Namespace) -> None:
    from r3lab.experiments import drift_table, run_drift
    from r3lab.paths import model_dir, runs_dir

    overrides = config_overrides(args, DriftConfig)
    config = DriftConfig.quick(**overrides) if args.quick else DriftConfig(**overrides)
    for m in config.models:  # fail before any engine starts
        model_dir(m, config.data)

    rows = run_drift(config, progress=not args.no_progress, runs_root=runs_dir(args.runs, args.data),
                     run_name=args.name)
    table = drift_table(rows, config, command="r3lab drift" + (" --quick" if args.quick else ""))
    print(table)
    if args.out:
        Path(args.out).write_text(table)
        print(f"wrote {args.out}", file=sys.stderr)
    if rows and rows[0].run_path is not None:
        print(f"run: {rows[0].run_path}", file=sys.stderr)


def _capture(args: argparse.Namespace) -> None:
    from r3lab.experiments.capture import run_capture

    path = run_capture(CaptureConfig(**config_overrides(args, CaptureConfig)), args.prompts, args.out,
                       progress=not args.no_progress)
    print(f"run: {path}", file=sys.stderr)


def _rl(args: argparse.Namespace) -> None:
    from r3lab.experiments.rl import comparison_rows, comparison_table, run_comparison
    from r3lab.paths import model_dir, runs_dir

    overrides = config_overrides(args, RLConfig)
    base = RLConfig.quick(**overrides) if args.quick else RLConfig(**overrides)
    model_dir(base.model, base.data)  # fail before any engine starts
    seeds = args.seeds or list(RL_QUICK_SEEDS if args.quick else RL_SEEDS)
    root = runs_dir(args.runs, args.data)
    runs = run_comparison(base, modes=args.modes or list(DEFAULT_MODES), seeds=seeds, runs_root=root,
                          prefix=args.name,
                          progress=not args.no_progress)
    print(comparison_table(comparison_rows([(r.config, r.steps) for r in runs])))
    for r in runs:
        print(f"run: {r.path}", file=sys.stderr)


def _runs(args: argparse.Namespace) -> None:
    from r3lab.errors import RunFormatError
    from r3lab.paths import runs_dir
    from r3lab.runs import list_runs

    root = runs_dir(args.folder)
    if not root.exists():
        raise ConfigError(f"runs folder {str(root)!r} does not exist (give a folder of runs; default: <data>/runs, "
                          "$R3LAB_RUNS)")
    if not root.is_dir():
        raise ConfigError(f"{str(root)!r} is a file, not a folder of runs")
    found = list_runs(root)
    if not found:
        print(f"no runs in {root}")
        return
    print(f"runs in {root}:")
    print(f"{'run':48s} {'kind':6s} {'steps':>5s}  state")
    for path, run in found:
        if isinstance(run, RunFormatError):
            print(f"{path.name:48s} {'?':6s} {'':>5s}  unreadable: {run}")
        else:
            print(f"{path.name:48s} {run.kind:6s} {len(run.step_records):5d}  {run.state}")


def _figures(args: argparse.Namespace) -> None:
    from r3lab.paths import figures_dir, results_dir

    require("plotly", for_="r3lab figures")
    from r3lab.viz import EXPORT_FORMATS, paper_figures

    for path in paper_figures(results_dir(args.results), figures_dir(args.out), formats=args.formats or EXPORT_FORMATS):
        print(f"wrote {path}")


def _import_formats(args: argparse.Namespace) -> None:
    """``r3lab import --formats`` (and a bare ``r3lab import``, which also says a kind is needed)."""
    from r3lab.importers.layouts import formats_table

    if not args.formats:
        raise ConfigError("r3lab import needs a KIND (or auto) and SRC, e.g. `r3lab import auto DUMP --out RUN`; "
                          "`r3lab import --formats` lists the kinds and the layouts of each that r3lab reads")
    print(formats_table())


def _import(args: argparse.Namespace) -> None:
    from r3lab.importers import import_run

    opts = {name: getattr(args, name) for name in args.options}
    path = import_run(args.kind, args.src, args.out, **opts)
    kind = args.kind
    if kind == "auto":  # the kind it chose, as the run records it
        from r3lab.runs import load

        kind = load(path).config.get("source", {}).get("format", kind)
    print(f"imported {kind} dump {args.src} as run {path}")


def _doctor(args: argparse.Namespace) -> None:
    import json

    from r3lab.doctor import diagnose

    report = diagnose(args.run)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    if report.failed or (args.strict and report.warned):
        sys.exit(1)


def _bench_shortcut(name: str, args: argparse.Namespace) -> None:
    _bench(name, args.args)


def _bench(name: str, rest: list[str]) -> None:
    from r3lab.paths import bench_script

    script = bench_script(name)
    if script is None or not script.is_file():
        looked = f"looked for {script}" if script is not None else "this r3lab is an installed package"
        raise ConfigError(
            f"`r3lab bench {name}` needs a source checkout: benchmarks live in the repository's bench/ "
            f"folder, which an installed r3lab does not have ({looked}). Clone the repository "
            "and run `bash scripts/run.sh bench " + name + "` there."
        )
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


def _version() -> str:
    """``r3lab <version> from <package folder>``: which checkout the ``r3lab`` command runs."""
    from importlib import metadata

    from r3lab.runs import r3lab_source

    try:
        v = metadata.version("r3lab")
    except metadata.PackageNotFoundError:
        v = "(not installed: run from source)"
    return f"r3lab {v} from {r3lab_source()}"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:  # before the default command is put in front of other flags
        print(_version())
        return
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = [RunKind.DRIFT, *argv]
    try:
        parser = _parser()  # reads the plugin registries: a broken plugin is one line, not a traceback
    except R3LabError as e:
        sys.exit(f"r3lab: {e}")
    args = parser.parse_args(argv)
    if args.version:
        print(_version())
        return
    if args.command is None:
        parser.print_help()
        return
    try:
        args.func(args)
    except MissingExtraError as e:
        _exit_missing_extra(e)
    except R3LabError as e:
        sys.exit(f"r3lab: {e}")
    except ModuleNotFoundError as e:  # an extra's package reached without a guard of its own: still one line
        missing = missing_extra(e, for_=f"r3lab {args.command}")
        if missing is None:
            raise
        _exit_missing_extra(missing)


def _exit_missing_extra(error: MissingExtraError) -> NoReturn:
    """A missing extra as one line and exit status 2 (the environment, not the run: a doctor that found a problem
    exits 1)."""
    print(f"r3lab: {error}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
