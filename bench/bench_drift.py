"""What R3 changes on the shipped tiny models: train-inference k3 KL without replay and with the engine's routes.

Regenerates the committed table bench/results/drift.md from ``r3lab.experiments.run_drift`` (the main
job, ``r3lab drift``, prints the same table and never writes here). Run: ``python bench/bench_drift.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from r3lab.experiments import DriftConfig, drift_table, run_drift

RESULTS = Path(__file__).resolve().parent / "results" / "drift.md"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens (smoke run); writes nothing")
    args = ap.parse_args(argv)
    config = DriftConfig.quick() if args.quick else DriftConfig()
    table = drift_table(run_drift(config), config, command="python bench/bench_drift.py")
    print(table)
    if not args.quick:
        RESULTS.write_text(table)
        print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
