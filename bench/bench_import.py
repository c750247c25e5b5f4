"""How fast the importers turn a framework's dump into an r3lab run: this checkout against a baseline revision.

The dumps are the suite's generators' (tests/dumps_skyrl_verl.py: the tiny config's layers, samples of at least 8
tokens with routes; tests/make_dumps.py: NeMo-RL's JSONL, 12 tokens a sample, no routes), written once into a
scratch folder. Each code version (this checkout, and
``--baseline REV`` checked out into a temporary git worktree) imports each dump ``--repeats`` times in a fresh
Python of this environment with that version first on ``PYTHONPATH``; the best wall time counts. Both versions'
runs of a dump must hold the same bytes (token and prompt tables, routes, step records: everything but the run
config's creation time and thread counts), else the benchmark stops: a faster import that writes something else is
no result.

Run: ``python bench/bench_import.py --baseline REV`` (writes bench/results/import.md); ``--samples`` sets the size.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
FORMATS = ("skyrl", "skyrl-packed", "verl", "nemo-rl")

_IMPORT = """\
import sys, time
from pathlib import Path
kind, src, out, config, repeats = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])
from r3lab.importers import import_run
fmt = kind.split("-packed")[0]
best = None
for i in range(repeats):
    t = time.perf_counter()
    import_run(fmt, src, out / f"run{i}", **({} if config == "-" else {"config": config}))
    best = min(best or 1e9, time.perf_counter() - t)
import r3lab
print(best, r3lab.__file__)
"""


def _dumps(folder: Path, samples: int) -> dict[str, tuple[Path, str]]:
    """Each format's dump (generated once) and the config its import needs ("-": none)."""
    sys.path.insert(0, str(TESTS))
    import dumps_skyrl_verl as g
    import make_dumps as md

    out = {}
    for kind in FORMATS:
        d = folder / kind
        if kind == "nemo-rl":
            if not d.exists():
                md.nemo_rl_large(d, samples=samples)
            out[kind] = (d, "-")
        else:
            if not d.exists():
                g.large(kind, d, samples=samples)
            out[kind] = (d, str(g.CONFIG))
    return out


def _time(tree: Path, kind: str, src: Path, out: Path, config: str, repeats: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, "-c", _IMPORT, kind, str(src), str(out), config, str(repeats)],
                          env=env, capture_output=True, text=True, cwd=tree)
    if proc.returncode:
        raise SystemExit(f"bench_import: {kind} under {tree} failed:\n{proc.stderr[-3000:]}")
    seconds, where = proc.stdout.split()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"bench_import: the import under {tree} used the r3lab at {where}")
    return float(seconds)


def _same_bytes(a: Path, b: Path) -> None:
    """Two runs of one dump hold the same bytes; their configs too, but for when, where from and with how many threads
    they were made (``created``, ``name``, ``versions``: the r3lab source path, ``threads``)."""
    cmp = filecmp.dircmp(a, b, ignore=["config.json"])
    stack, differ = [cmp], []
    while stack:
        c = stack.pop()
        differ += [str(Path(c.left) / f) for f in c.diff_files + c.left_only + c.right_only]
        _, mismatch, errors = filecmp.cmpfiles(c.left, c.right, c.common_files, shallow=False)
        differ += [str(Path(c.left) / f) for f in mismatch + errors]
        stack += c.subdirs.values()
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    for c in (ca, cb):
        for key in ("created", "name", "versions", "threads"):
            c.pop(key, None)
    if ca != cb:
        differ.append("config.json")
    if differ:
        raise SystemExit(f"bench_import: the two versions wrote different runs of one dump: {sorted(set(differ))}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="the git revision to compare with (checked out temporarily)")
    ap.add_argument("--samples", type=int, default=40_000, help="samples per dump (default 40000)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "import.md")
    args = ap.parse_args(argv)
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = " with uncommitted changes" if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                                          cwd=ROOT, capture_output=True, text=True).stdout else ""
    with tempfile.TemporaryDirectory(prefix="r3lab-bench-import-") as tmp:
        scratch = Path(tmp)
        base_tree = scratch / "baseline"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base_tree), rev], cwd=ROOT, check=True)
        try:
            dumps = _dumps(scratch / "dumps", args.samples)
            rows = []
            for kind, (src, config) in dumps.items():
                mb = sum(f.stat().st_size for f in src.rglob("*") if f.is_file()) / 1e6
                new = _time(ROOT, kind, src, scratch / "new" / kind, config, args.repeats)
                old = _time(base_tree, kind, src, scratch / "old" / kind, config, args.repeats)
                _same_bytes(scratch / "new" / kind / "run0", scratch / "old" / kind / "run0")
                rows.append((kind, mb, old, new))
                print(f"{kind}: {old:.2f} s -> {new:.2f} s", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    lines = ["# Import speed: this checkout against a baseline", "",
             f"`python bench/bench_import.py --baseline {args.baseline}` on {platform.machine()}, "
             f"{os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}: each format's "
             f"generated dump ({args.samples} samples; SkyRL and verl with routes on the tests' tiny config, NeMo-RL "
             "without) imported "
             f"{args.repeats} times per version in a fresh Python, best wall time; both versions' runs hold the same "
             f"bytes. This checkout: {head}{dirty}; baseline: {rev}.", "",
             "| format | dump MB | baseline s | this checkout s | speed-up | us per sample (this checkout) |",
             "|---|---|---|---|---|---|"]
    for kind, mb, old, new in rows:
        lines.append(f"| {kind} | {mb:.0f} | {old:.2f} | {new:.2f} | {old / new:.2f}x | "
                     f"{new / args.samples * 1e6:.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.write_text(table)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
