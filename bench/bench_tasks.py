"""The RL tasks and objectives side by side on the quick setting: does the reward keep rising, and at what cost.

Runs ``RLConfig.quick`` (4 prompts x 8 samples, 2 mini-batches, lr 3e-3, R3) for each case below on one engine,
keeps each run's config.json, steps.jsonl and summary.json under bench/results/tasks/, and renders
bench/results/tasks.md from them:

* the letter task against the edges task (16 tokens, GRPO): which one is still climbing at the end;
* the edges task with GSPO (sequence ratio, clip 3e-4 / 4e-4) instead of GRPO;
* the edges task with 256-token responses (a few steps: the loop's cost at that length on CPU).

    python bench/bench_tasks.py            # run (about 3 minutes on 2 cores), then render
    python bench/bench_tasks.py --render   # render tasks.md again from the committed runs
    python bench/bench_tasks.py --quick    # 4 steps a case; writes nothing
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from reference import reference_main  # noqa: E402

from r3lab.config import RLConfig
from r3lab.experiments.rl import run_rl
from r3lab.paths import model_dir, results_dir
from r3lab.rollout import RolloutEngine
from r3lab.runs import Run

RESULTS = results_dir()
REFERENCE = RESULTS / "tasks"
STEPS = 40
CASES = {  # run name -> changes to RLConfig.quick(steps=STEPS)
    "letter-grpo-t16": {"task": "letter"},
    "edges-grpo-t16": {"task": "edges"},
    "edges-gspo-t16": {"task": "edges", "loss": "gspo"},
    "edges-grpo-t256": {"task": "edges", "max_tokens": 256, "steps": 3},
}


def run_all(quick: bool, out: Path) -> float:
    t0 = time.perf_counter()
    base = RLConfig.quick(steps=4 if quick else STEPS)
    with RolloutEngine(model_dir(base.model), seed=base.seed) as engine:
        for name, change in CASES.items():
            cfg = RLConfig.quick(**{"steps": base.steps, **change})
            if quick:
                cfg = RLConfig.quick(**{**change, "steps": min(4, cfg.steps)})
            run_rl(cfg, engine=engine, runs_root=out, run_name=name, progress=False)
            print(f"done: {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return time.perf_counter() - t0


def _window(r: np.ndarray, at: int, w: int = 5) -> float:
    return float(r[max(0, at - w // 2): at + w - w // 2].mean())


def render(runs: list[Run], seconds: float | None) -> str:
    q = RLConfig.quick()
    lines = [
        "# RL tasks and objectives on the quick setting",
        "",
        f"`python bench/bench_tasks.py` on {platform.machine()}"
        + (f", {seconds / 60:.1f} minutes in all" if seconds else "")
        + f". tiny-qwen3-moe, mode R3, seed 0, {q.prompts_per_step} prompts x {q.samples_per_prompt} samples, "
        f"{q.mini_batches} mini-batches, lr {q.lr:g}; GRPO clips token ratios at 0.2, GSPO sequence ratios at "
        "3e-4 / 4e-4. Reward cells: the mean over the 5 steps around each step. Slope: least-squares reward rise "
        "per 100 steps over the last half of the run. Collapse: the reward below half its running peak for 5 steps "
        "after a 10-step warm-up (r3lab.metrics.reward_collapse).",
        "",
        "| run | task | loss | tokens | steps | reward at 0 / 1/4 / 1/2 / 3/4 / end | slope, last half (per 100 steps) "
        "| clip frac (max per step, mean) | policy ESS (min) | k3 KL | collapse step | s / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in sorted(runs, key=lambda r: list(CASES).index(r.name) if r.name in CASES else 99):
        c, st = run.config, run.step_records
        r = np.array([s["reward_mean"] for s in st])
        n = r.size
        at = [0, n // 4, n // 2, 3 * n // 4, n - 1]
        half = np.arange(n // 2, n)
        slope = float(np.polyfit(half, r[half], 1)[0] * 100) if half.size >= 2 else float("nan")
        clip = np.mean([s["train/clip_frac_max"] for s in st])
        ess = min(s["train/policy_is_ess"] for s in st)
        k3 = np.mean([s["mismatch/k3_kl"] for s in st])
        sec = np.mean([s["time_step_s"] for s in st])
        lines.append(f"| {run.name} | {c['task']} | {c['loss']} | {c['max_tokens']} | {n} | "
                     + " / ".join(f"{_window(r, i):.3f}" for i in at)
                     + f" | {slope:+.3f} | {clip:.3f} | {ess:.3f} | {k3:.2e} | "
                     f"{run.summary.get('collapse/step')} | {sec:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    reference_main(argv, doc=__doc__, bench="bench_tasks", reference=REFERENCE, table_file=RESULTS / "tasks.md",
                   run_all=run_all, render=render, quick_help='4 steps a case; writes nothing')

if __name__ == "__main__":
    main()
