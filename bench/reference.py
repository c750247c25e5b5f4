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
                   quick_help: str | None = None, resumable: bool = False) -> None:
    """The command line of a benchmark that keeps reference runs: run everything into a scratch folder (or, with
    ``--quick``, a small slice that writes nothing), render the table, keep the runs as the reference and write the
    table; ``--render`` renders the table again from the committed reference. ``run_all(root)`` (``run_all(quick,
    root)`` when the benchmark has a ``--quick``) runs the sweep and returns its wall time.

    ``resumable``: the benchmark's ``run_all`` skips the runs already finished under ``root`` and runs the rest again
    from step 0, so ``--work DIR`` runs into ``DIR`` and a killed sweep goes on where it stopped; the wall time kept
    is the sum over the invocations (``DIR/bench-seconds.json``), and ``DIR`` stays."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if quick_help is not None:
        ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--render", action="store_true", help=f"only render {table_file.name} from the committed runs")
    if resumable:
        ap.add_argument("--work", type=Path, help="run into this folder, skipping the runs finished there (resumable; "
                        "the folder stays)")
    args = ap.parse_args(argv)
    quick = bool(getattr(args, "quick", False))
    work = getattr(args, "work", None)
    if args.render:
        root, seconds = reference, reference_seconds(reference)
    else:
        root = work if work is not None else Path(tempfile.mkdtemp(prefix=f"r3lab-{bench.replace('_', '-')}-"))
        root.mkdir(parents=True, exist_ok=True)
        seconds = run_all(quick, root) if quick_help is not None else run_all(root)
        if work is not None:
            seconds = _add_session_seconds(work, seconds)
    runs = finished_runs(root, bench)
    table = render(runs, seconds)
    print(table)
    if quick:
        return
    if not args.render:
        keep_reference(runs, root, reference, seconds, remove_scratch=work is None)
    table_file.write_text(table)
    print(f"wrote {table_file} ({len(runs)} runs under {reference})", file=sys.stderr)


def _add_session_seconds(work: Path, seconds: float) -> float:
    """Record one invocation's wall time in ``work/bench-seconds.json``; the sum over every invocation so far."""
    log = work / "bench-seconds.json"
    sessions = json.loads(log.read_text())["sessions"] if log.is_file() else []
    sessions.append(round(seconds, 1))
    log.write_text(json.dumps({"sessions": sessions}) + "\n")
    return float(sum(sessions))
