"""What the benchmarks that keep reference runs share: read the runs they made, and keep them as the reference.

A benchmark that commits the runs its table is rendered from (``bench_rl``, ``bench_tasks``, ``bench_staleness``)
runs into a scratch folder, checks every run finished, renders its table, and then replaces its reference folder
under ``bench/results/`` whole (never merged with an older one) with each run's config, steps and summary, plus
``bench.json`` (the wall time). ``--render`` renders the table again from the committed reference.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from r3lab.runs import Run, list_runs

KEPT_FILES = ("config.json", "steps.jsonl", "summary.json")


def finished_runs(root: Path, bench: str) -> list[Run]:
    """Every run under ``root``; a run that is unreadable or unfinished stops the benchmark, naming it."""
    runs = []
    for path, run in list_runs(root):
        if not isinstance(run, Run) or not run.finished:
            raise SystemExit(f"{bench}: run {path} is unreadable or unfinished: {run}")
        runs.append(run)
    return runs


def reference_seconds(reference: Path) -> float | None:
    """The wall time the committed reference took (``bench.json``), if it says."""
    timing = reference / "bench.json"
    return json.loads(timing.read_text())["seconds"] if timing.is_file() else None


def keep_reference(runs: list[Run], scratch: Path, reference: Path, seconds: float, *,
                   extra: Mapping[str, Any] | None = None, remove_scratch: bool = True) -> None:
    """Replace ``reference`` with these runs' kept files and ``bench.json`` (the wall time ``seconds``, and the
    entries of ``extra``: per-run timings, say); remove the scratch folder unless ``remove_scratch`` is False (a
    resumable sweep's work folder stays)."""
    if extra and "seconds" in extra:
        raise ValueError("keep_reference: extra must not set 'seconds' (pass it as seconds)")
    if reference.exists():
        shutil.rmtree(reference)  # regenerated whole, never merged with an older one
    for r in runs:
        (reference / r.name).mkdir(parents=True)
        for f in KEPT_FILES:
            shutil.copy(r.path / f, reference / r.name / f)
    timing = {"seconds": round(seconds, 1), **(extra or {})}
    (reference / "bench.json").write_text(json.dumps(timing, indent=1 if extra else None) + "\n")
    if remove_scratch:
        shutil.rmtree(scratch, ignore_errors=True)


def reference_main(argv: list[str] | None, *, doc: str, bench: str, reference: Path, table_file: Path,
                   run_all: Callable[..., float], render: Callable[[list[Run], float | None], str],
                   quick_help: str | None = None) -> None:
    """The command line of a benchmark that keeps reference runs: run everything into a scratch folder (or, with
    ``--quick``, a small slice that writes nothing), render the table, keep the runs as the reference and write the
    table; ``--render`` renders the table again from the committed reference. ``run_all(root)`` (``run_all(quick,
    root)`` when the benchmark has a ``--quick``) runs the sweep and returns its wall time."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if quick_help is not None:
        ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--render", action="store_true", help=f"only render {table_file.name} from the committed runs")
    args = ap.parse_args(argv)
    quick = bool(getattr(args, "quick", False))
    if args.render:
        root, seconds = reference, reference_seconds(reference)
    else:
        root = Path(tempfile.mkdtemp(prefix=f"r3lab-{bench.replace('_', '-')}-"))
        seconds = run_all(quick, root) if quick_help is not None else run_all(root)
    runs = finished_runs(root, bench)
    table = render(runs, seconds)
    print(table)
    if quick:
        return
    if not args.render:
        keep_reference(runs, root, reference, seconds)
    table_file.write_text(table)
    print(f"wrote {table_file} ({len(runs)} runs under {reference})", file=sys.stderr)
