"""The refactor byte check: a change to the code's structure must leave every run's bytes as they were.

``run OUT`` makes the quick drift run and the quick RL runs of every mode (none, R2, R3, R3W; seed 0) under OUT;
``compare BEFORE AFTER`` compares two such folders file by file: JSON and JSON-lines records equal less their timing
fields (wall-clock seconds and timestamps, which no two runs share), every other file (tokens, routes, samples) byte
for byte. Run it from a checkout before and after a change, in the same environment, with one thread:

    OMP_NUM_THREADS=1 python scripts/byte_check.py run /tmp/before     # at the old commit
    OMP_NUM_THREADS=1 python scripts/byte_check.py run /tmp/after      # at the new one
    python scripts/byte_check.py compare /tmp/before /tmp/after        # exit 1 on any difference
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

MODES = ("none", "R2", "R3", "R3W")
_START = re.compile(r"-\d{8}-\d{6}-")  # the start time in an RL run's name


def _timing(key: str) -> bool:
    """Wall-clock fields, and the path of the r3lab that wrote the run (two checkouts differ there)."""
    return key.startswith("time_") or "/time_" in key or key.endswith("_s") or "seconds" in key or key in (
        "created", "finished", "started", "wall_s", "r3lab-source")


def _strip(record):
    """A record less its timing fields, with the start time in run names (RL runs carry one) taken out."""
    if isinstance(record, dict):
        return {k: _strip(v) for k, v in record.items() if not _timing(k)}
    if isinstance(record, list):
        return [_strip(v) for v in record]
    if isinstance(record, str):
        return _START.sub("-", record)
    return record


def run(out: Path) -> None:
    """The quick drift run and the quick RL run of each mode, into ``out`` (which must not exist)."""
    if out.exists():
        raise SystemExit(f"byte_check: {out} exists; give a new folder")
    out.mkdir(parents=True)
    cli = [sys.executable, "-m", "r3lab"]
    subprocess.run([*cli, "drift", "--quick", "--runs", str(out), "--name", "drift", "--no-progress"], check=True)
    subprocess.run([*cli, "rl", "--quick", "--modes", *MODES, "--runs", str(out), "--no-progress"], check=True)


def _runs(root: Path) -> dict[str, Path]:
    """The run folders under ``root`` by name less their start time (the RL runs' names carry it)."""
    return {_START.sub("-", p.name): p for p in root.iterdir() if p.is_dir()}


def compare(before: Path, after: Path) -> list[str]:
    """Every difference between two ``run`` folders (timing fields excepted); empty when identical."""
    bad: list[str] = []
    mine, theirs_runs = _runs(before), _runs(after)
    runs = sorted(mine)
    if runs != sorted(theirs_runs):
        bad.append(f"run folders differ: {runs} against {sorted(theirs_runs)}")
    n = 0
    for name in runs:
        if name not in theirs_runs:
            continue
        a_run, b_run = mine[name], theirs_runs[name]
        files = sorted(p.relative_to(a_run) for p in a_run.rglob("*") if p.is_file())
        theirs = sorted(p.relative_to(b_run) for p in b_run.rglob("*") if p.is_file())
        if files != theirs:
            bad.append(f"{name}: file lists differ: {sorted(set(map(str, files)) ^ set(map(str, theirs)))}")
        for rel in files:
            a, b = a_run / rel, b_run / rel
            if not b.exists():
                continue
            n += 1
            if rel.suffix == ".jsonl":
                ra = [_strip(json.loads(line)) for line in a.read_text().splitlines()]
                rb = [_strip(json.loads(line)) for line in b.read_text().splitlines()]
                if ra != rb:
                    bad.append(f"{name}/{rel}: records differ ({len(ra)} against {len(rb)})")
            elif rel.suffix == ".json":
                if _strip(json.loads(a.read_text())) != _strip(json.loads(b.read_text())):
                    bad.append(f"{name}/{rel}: differs")
            elif hashlib.sha256(a.read_bytes()).digest() != hashlib.sha256(b.read_bytes()).digest():
                bad.append(f"{name}/{rel}: bytes differ")
    print(f"compared {n} files in {len(runs)} runs")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run").add_argument("out", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.out)
        return
    bad = compare(args.before, args.after)
    print("\n".join(bad) if bad else "IDENTICAL (timing fields excepted)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
