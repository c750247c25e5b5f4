"""No replay vs R2 vs R3 in the GRPO loop on CPU, over seeds, on the shipped models; and knobs that make mismatch bite.

Regenerates the committed reference runs under bench/results/rl/ (each run's config.json, steps.jsonl and
summary.json: readable with ``r3lab.runs.load``) and the table bench/results/rl.md. Token tables and routes
are written to a temporary folder and not committed. Run: ``python bench/bench_rl.py [--quick]``
(``r3lab rl`` runs the same loop and writes to data/runs/ instead).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from r3lab.experiments.rl import RLConfig, comparison_rows, comparison_table, run_comparison
from r3lab.runs import load

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("tiny-qwen3-moe", "tiny-glm4-moe")
KNOBS = {  # what changes how much routing mismatch there is, each against the default
    "default": {},
    "stale rollouts (2 updates behind)": {"staleness": 2},
    "8 mini-batches per rollout batch": {"mini_batches": 8},
    "bf16 trainer (fp32 routers)": {"trainer_dtype": "bfloat16"},
    "fp32 engine": {"engine_dtype": "float32"},
}


def _curve(steps: list[dict], key: str, at: list[int]) -> str:
    vals = [steps[i].get(key) for i in at]
    return " / ".join("-" if v is None else f"{v:.2e}" if key.startswith("mismatch") else f"{v:.3f}" for v in vals)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 steps, one seed, default knobs only; writes nothing")
    args = ap.parse_args(argv)
    seeds = (0,) if args.quick else (0, 1, 2)
    knobs = {"default": {}} if args.quick else KNOBS
    tmp = Path(tempfile.mkdtemp(prefix="r3lab-bench-rl-"))
    t0 = time.perf_counter()
    all_runs, sections = [], []
    for model in MODELS:
        for label, change in knobs.items():
            base = (RLConfig.quick if args.quick else RLConfig)(model=model, **change)
            seeds_here = seeds if label == "default" else seeds[:1]
            prefix = f"{model}-{'default' if not change else '-'.join(f'{k}{v}' for k, v in change.items())}"
            runs = run_comparison(base, seeds=seeds_here, runs_root=tmp, prefix=prefix)
            all_runs += runs
            sections.append((model, label, base, runs))
            print(f"done: {model} {label} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    d = RLConfig()
    lines = [
        "# No replay vs R2 vs R3 in a GRPO loop on CPU",
        "",
        f"`python bench/bench_rl.py{' --quick' if args.quick else ''}` on {platform.machine()}, "
        f"{time.perf_counter() - t0:.0f} s in all. Task: the share of response words starting with "
        f"'{d.target_letter}'. Default run: {d.steps} steps of {d.prompts_per_step} prompts x "
        f"{d.samples_per_prompt} samples x {d.max_tokens} tokens, {d.mini_batches} mini-batch updates per rollout "
        f"batch, AdamW lr {d.lr:g}, clip {d.clip_eps}, engine {d.engine_dtype}, trainer {d.trainer_dtype}, "
        "weights pushed to the engine after every step. Each cell: the run's mean, as median (min - max) over "
        "seeds. k3 KL and F(2) compare the trainer's old log-probs (under the mode's routing) with the engine's.",
        "",
    ]
    for model, label, base, runs in sections:
        if label != "default":
            continue
        lines += [f"## {model}: default knobs, {len(runs) // 3} seeds", "",
                  comparison_table(comparison_rows([(r.config, r.steps) for r in runs]))]
        at = sorted({0, 1, base.steps // 4, base.steps // 2, base.steps - 1})
        lines += [f"Curves, seed 0, at steps {at}:", "",
                  "| mode | k3 KL | reward | route change (last mini-batch) |", "|---|---|---|---|"]
        for r in runs:
            if r.config.seed == 0:
                lines.append(f"| {r.config.mode} | {_curve(r.steps, 'mismatch/k3_kl', at)} | "
                             f"{_curve(r.steps, 'reward_mean', at)} | "
                             f"{_curve(r.steps, 'routing/route_change_last_mb', at)} |")
        floors_t = [s["noise/k3_kl_trainer_vs_trainer"] for r in runs for s in r.steps]
        floors_e = [s["noise/k3_kl_engine_vs_engine"] for r in runs for s in r.steps
                    if s["noise/k3_kl_engine_vs_engine"] is not None]
        lines += ["", f"Noise floors over these runs (k3 KL of a scorer against itself): trainer max "
                  f"{max(floors_t):.1e}, engine max {max(floors_e) if floors_e else float('nan'):.1e}.", ""]
    if not args.quick:
        lines += ["## Knobs that change the mismatch (seed 0)", ""]
        rows = []
        for _model, label, _base, runs in sections:
            for row in comparison_rows([(r.config, r.steps) for r in runs if r.config.seed == 0]):
                rows.append((label, row))
        lines += ["| knob | model | mode | k3 KL | F(2) | route change (last mini-batch) | reward rise |",
                  "|---|---|---|---|---|---|---|"]
        for label, row in rows:
            lines.append(f"| {label} | {row['model']} | {row['mode']} | {row['mismatch/k3_kl'][1]:.2e} | "
                         f"{row['mismatch/extreme_frac_tau2'][1]:.4f} | "
                         f"{row['routing/route_change_last_mb'][1]:.3f} | {row['reward_rise'][1]:+.3f} |")
        lines.append("")
    table = "\n".join(lines) + "\n"
    print(table)
    if not args.quick:
        out = RESULTS / "rl"
        if out.exists():
            shutil.rmtree(out)  # the committed reference is regenerated whole, never merged with an older one
        for r in all_runs:
            dst = out / r.path.name
            dst.mkdir(parents=True)
            for f in ("config.json", "steps.jsonl", "summary.json"):
                shutil.copy(r.path / f, dst / f)
            if not load(dst).finished:
                raise RuntimeError(f"copied run {dst} does not read back as finished")
        (RESULTS / "rl.md").write_text(table)
        print(f"wrote {RESULTS / 'rl.md'} and {len(all_runs)} runs under {out}", file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
