"""Command line: ``python -m r3lab [job]``. The default job is the transport benchmark on the embedded workloads."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOBS = {
    "transport": ROOT / "bench" / "bench_transport.py",
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m r3lab", description="r3lab jobs")
    ap.add_argument("job", nargs="?", default="transport", choices=sorted(JOBS), help="what to run (default: transport)")
    args, rest = ap.parse_known_args(argv)
    script = JOBS[args.job]
    if not script.exists():
        sys.exit(f"r3lab: {script} not found; run from a source checkout")
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
