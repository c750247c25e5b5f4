"""The command line: ``r3lab`` (or ``python -m r3lab``).

``r3lab`` alone runs the main job, the drift experiment (``r3lab drift``). Benchmarks live in a source
checkout's ``bench/`` folder, not in the installed package: ``r3lab bench NAME`` (or ``r3lab NAME``)
runs ``bench/bench_NAME.py`` there and says so plainly when there is no checkout.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from r3lab.errors import R3LabError

__all__ = ["main", "BENCHMARKS"]

BENCHMARKS = {
    "transport": "codecs vs what the field sends (size and speed)",
    "rollout": "route-capture overhead of the engine",
    "slicing": "shard() throughput and per-rank memory",
    "replay": "forward+backward overhead of replay",
    "drift": "the drift experiment, writing the committed table bench/results/drift.md",
}
COMMANDS = ("drift", "bench", *[b for b in BENCHMARKS if b != "drift"])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="r3lab", description="r3lab: Rollout Routing Replay workbench. With no command, runs the drift experiment."
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser("drift", help="trainer vs engine drift without replay and with R3 (the main job)")
    d.add_argument("--quick", action="store_true", help="a smoke run: 8 prompts x 16 tokens")
    d.add_argument("--models", nargs="+", help="shipped model names or model directories (default: both tiny models)")
    d.add_argument("--prompts", type=int, help="number of corpus prompts")
    d.add_argument("--tokens", type=int, help="tokens sampled per prompt")
    d.add_argument("--seeds", type=int, nargs="+", help="seeds (each draws its own prompts and samples)")
    d.add_argument("--data", help="the data folder with models/ and corpus/ (default: the checkout's data/)")
    d.add_argument("--out", help="also write the markdown table to this file")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    b = sub.add_parser("bench", help="run a benchmark from a source checkout's bench/ folder")
    b.add_argument("name", choices=sorted(BENCHMARKS), help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
    b.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark (e.g. --quick)")
    for name in BENCHMARKS:
        if name != "drift":
            s = sub.add_parser(name, help=f"= r3lab bench {name}: {BENCHMARKS[name]}")
            s.add_argument("args", nargs=argparse.REMAINDER)
    return ap


def _drift(args: argparse.Namespace) -> None:
    from r3lab.experiments import DriftConfig, drift_table, run_drift
    from r3lab.paths import model_dir

    overrides = {
        k: v
        for k, v in (
            ("prompts", args.prompts),
            ("max_tokens", args.tokens),
            ("sampling_seed", args.seed),
            ("data", args.data),
        )
        if v is not None
    }
    if args.models:
        overrides["models"] = tuple(args.models)
    config = DriftConfig.quick(**overrides) if args.quick else DriftConfig(**overrides)
    for m in config.models:  # fail before any engine starts
        model_dir(m, config.data)
    rows = run_drift(config, progress=not args.no_progress)
    table = drift_table(rows, config, command="r3lab drift" + (" --quick" if args.quick else ""))
    print(table)
    if args.out:
        Path(args.out).write_text(table)
        print(f"wrote {args.out}", file=sys.stderr)


def _bench(name: str, rest: list[str]) -> None:
    script = Path(__file__).resolve().parent.parent / "bench" / f"bench_{name}.py"
    if not script.is_file():
        raise R3LabError(
            f"`r3lab bench {name}` needs a source checkout: benchmarks live in the repository's bench/ "
            f"folder, which an installed r3lab does not have (looked for {script}). Clone the repository "
            "and run `bash scripts/run.sh bench " + name + "` there."
        )
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["drift", *argv]
    args = _parser().parse_args(argv)
    try:
        if args.command == "drift":
            _drift(args)
        elif args.command == "bench":
            _bench(args.name, args.args)
        else:
            _bench(args.command, args.args)
    except R3LabError as e:
        sys.exit(f"r3lab: {e}")


if __name__ == "__main__":
    main()
