"""What R3 changes on the shipped tiny models: train-inference k3 KL without replay and with the engine's routes.

Regenerates the committed table bench/results/drift.md and the reference run bench/results/drift-run/ (read
by ``r3lab figures``) from ``r3lab.experiments.run_drift``. The main job, ``r3lab drift``, prints the same
table and never writes here. Run: ``python bench/bench_drift.py [--quick]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from r3lab.config import DriftConfig
from r3lab.experiments import drift_table, run_drift
from r3lab.paths import results_dir

RESULTS = results_dir() / "drift.md"
REFERENCE = RESULTS.parent / "drift-run"  # the reference run: regenerated whole by this script only


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens (smoke run); writes nothing")
    args = ap.parse_args(argv)
    config = DriftConfig.quick() if args.quick else DriftConfig()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_drift(config, runs_root=tmp, run_name=REFERENCE.name)
        table = drift_table(rows, config, command="python bench/bench_drift.py")
        print(table)
        if not args.quick:
            RESULTS.write_text(table)
            if REFERENCE.exists():
                shutil.rmtree(REFERENCE)  # the reference is regenerated whole, never merged with an older one
            shutil.copytree(Path(tmp) / REFERENCE.name, REFERENCE)
            print(f"wrote {RESULTS} and {REFERENCE}", file=sys.stderr)


if __name__ == "__main__":
    main()
